"""Verification of a draft tree against the target's output for every node. Pure tensor code.

Convention (Leviathan et al.): p = target distribution, q = draft distribution.
Dims: B batch rows, N tree nodes, D max depth, K max children per node, V vocabulary.

The target's forward over the N nodes gives, for node i, the distribution of the token that
follows the root -> i path. A child c of node i is *accepted* when its token passes the test against
the target's distribution at i. The result is the deepest accepted node, its path (the *accepted*
tokens), and one more token from the target: a *bonus* token sampled at that node when the whole
walk ran out of tree, or a *recovered* token sampled from the residual distribution when every child
of the last accepted node was rejected. Either way each round yields accepted + 1 tokens.

Greedy: child c of i is accepted iff tokens[c] == argmax p_i.
Sampled, deterministic drafts (the engine's: top-k picks of a head or a draft model, no sampling):
at node i the target's token is drawn, y ~ p_i, from the row's next uniform exactly as a plain
step draws it (sampling.inverse_transform); the child whose token is y is accepted and the walk
goes on there, else y is the recovered (or bonus) token. Every emitted token is then a draw from
the target's distribution, so this is lossless, and it accepts as often as recursive rejection
sampling with one-hot drafts (child x_j with the probability p(x_j), siblings summing). And each
emitted token uses one uniform, the one a plain step would have used: a seeded request gives the
same tokens whether a round verified drafts or took a plain step. The uniforms are peeked, not
used up: the caller advances each row's generator by the tokens it emitted once it has them on
the host (engine.speculate_round).
Sampled, drafts drawn from q (`draft_probs`; recursive rejection sampling over siblings, lossless):
at node i, with p = p_i, try the children in index order; child c (token x, drawn from q_c) is
accepted with probability min(1, p(x) / q_c(x)); on rejection p <- norm(max(p - q_c, 0)) and the
next sibling is tried. If no child is accepted, the recovered token is sampled from the final p.
Greedy rows can share the sampled paths with one-hot target probabilities (sampling.py makes them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eaglespec.sampling import RowRandom, greedy_tokens, inverse_transform
from eaglespec.tree import DraftTree


@dataclass(frozen=True, slots=True)
class VerifyResult:
    path: torch.Tensor  # (B, D + 1) node indices root -> deepest accepted node, -1 padded
    num_accepted: torch.Tensor  # (B,) draft tokens accepted (root excluded)
    next_token: torch.Tensor  # (B,) the bonus or recovered token: next round's root
    bonus: torch.Tensor  # (B,) bool, True when next_token is a bonus token
    last_node: torch.Tensor  # (B,) the deepest accepted node (0 = only the root)


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> VerifyResult:
    """target_logits (B, N, V) -> the longest root path whose every token is the target's argmax."""
    B, N = tree.tokens.shape
    argmax = greedy_tokens(target_logits)  # (B, N): the target's next token after each node
    if tree.is_chain:
        return _verify_greedy_chain(tree, argmax)
    parent = tree.parents.clamp(min=0)
    correct = tree.tokens == torch.gather(argmax, 1, parent)  # (B, N): node matches its parent
    correct[:, 0] = True
    # A node is accepted when all of its ancestors-or-self are correct.
    ok = ~(tree.mask & ~correct[:, None, :]).any(-1)  # (B, N)
    # Deepest accepted node; ties (equal sibling tokens) go to the lowest index.
    score = torch.where(ok, tree.depth * (N + 1) + (N - torch.arange(N, device=ok.device)), -1)
    last = score.argmax(-1)  # (B,)
    rows = torch.arange(B, device=last.device)
    leaf = (
        (tree.children[rows, last, 0] < 0) if tree.max_children > 0 else torch.ones_like(ok[:, 0])
    )
    return VerifyResult(
        path=tree.paths[rows, last],
        num_accepted=tree.depth[rows, last],
        next_token=argmax[rows, last],
        bonus=leaf,
        last_node=last,
    )


@dataclass(frozen=True, slots=True)
class HostPath:
    """One row's greedy verification, on the host."""

    path: list[int]  # node indices root -> deepest accepted node; path[0] = 0, the root
    next_token: int  # the target's argmax at the deepest accepted node: the next root
    bonus: bool  # that node has no children: the walk ran out of tree


def verify_greedy_host(
    tokens: Sequence[int], argmax: Sequence[int], parents: Sequence[int]
) -> HostPath:
    """verify_greedy for one row from host lists: the N nodes' tokens, the target's argmax after
    each node and the parents (topological, parents[i] < i; parents[0] = -1). The same path,
    next token and bonus (deepest accepted node, ties at equal depth to the lowest index), in
    one pass of N steps: once the target's argmax is on the host (the round syncs for its tokens
    anyway), this is cheaper than verify_greedy's dozen small tensor ops and the gathers after."""
    N = len(tokens)
    depth = [0] * N
    ok = [True] * N  # node i and all its ancestors match the target
    has_child = [False] * N
    last = 0
    for i in range(1, N):
        p = parents[i]
        assert 0 <= p < i, f"parents must be topological, node {i} has parent {p}"
        has_child[p] = True
        depth[i] = depth[p] + 1
        ok[i] = ok[p] and tokens[i] == argmax[p]
        if ok[i] and depth[i] > depth[last]:
            last = i
    path = [last]
    while path[-1] > 0:
        path.append(parents[path[-1]])
    return HostPath(path[::-1], argmax[last], not has_child[last])


def _verify_greedy_chain(tree: DraftTree, argmax: torch.Tensor) -> VerifyResult:
    """verify_greedy on a chain, in closed form: draft j is accepted when it and every draft
    before it equal the target's argmax after its parent (node j - 1)."""
    B, N = argmax.shape
    match = tree.tokens[:, 1:] == argmax[:, :-1]  # (B, N - 1)
    accepted = match.long().cumprod(1).sum(1)  # (B,) the deepest accepted node = its depth
    rows = torch.arange(B, device=argmax.device)
    return VerifyResult(
        path=tree.paths[rows, accepted],
        num_accepted=accepted,
        next_token=argmax[rows, accepted],
        bonus=accepted == N - 1,
        last_node=accepted,
    )


def verify_sampled(tree: DraftTree, target_probs: torch.Tensor, rng: RowRandom) -> VerifyResult:
    """target_probs (B, N, V), already through temperature / top-k / top-p (one-hot for greedy
    rows). Walks the tree depth by depth, all rows at once; rows that stop are masked, not removed,
    so the loop bounds are the host ints D and K and nothing syncs. Deterministic drafts peek at
    the uniforms: the caller advances `rng` by num_accepted + 1 per row (module doc)."""
    if tree.draft_probs is None:
        return _verify_drawn(tree, target_probs, rng)
    B, N, V = target_probs.shape
    dev = target_probs.device
    rows = torch.arange(B, device=dev)
    node = torch.zeros(B, dtype=torch.long, device=dev)  # current accepted node
    walking = torch.ones(B, dtype=torch.bool, device=dev)  # still descending
    coins = rng.uniform(B, max(1, tree.max_depth * tree.max_children), dev)  # (B, D * K)
    p = target_probs[:, 0].clone()  # (B, V) residual distribution at the current node
    for d in range(tree.max_depth):
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        for s in range(tree.max_children):
            child = tree.children[rows, node, s]  # (B,)
            trying = walking & ~moved & (child >= 0)
            c = child.clamp(min=0)
            x = tree.tokens[rows, c]  # (B,)
            px = p[rows, x]
            if tree.draft_probs is None:
                qx = torch.ones_like(px)
                q = torch.zeros_like(p).scatter_(1, x[:, None], 1.0)
            else:
                q = tree.draft_probs[rows, c]  # (B, V)
                qx = q[rows, x]
            accept = trying & (coins[:, d * tree.max_children + s] * qx < px)
            reject = trying & ~accept
            # Accepted rows descend: the residual restarts from the target's p at the child.
            node = torch.where(accept, c, node)
            p = torch.where(accept[:, None], target_probs[rows, c], p)
            moved |= accept
            # Rejected rows continue with norm(max(p - q, 0)) against the next sibling.
            residual = (p - q).clamp(min=0)
            total = residual.sum(-1, keepdim=True)
            residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p)
            p = torch.where(reject[:, None], residual, p)
        walking &= moved
    return _ended_at(tree, node, rng.sample(p))


def _verify_drawn(tree: DraftTree, target_probs: torch.Tensor, rng: RowRandom) -> VerifyResult:
    """Deterministic drafts: at each depth the target's own draw y from the row's next uniform;
    the child with token y is accepted, else y is the next token (module doc)."""
    B, N, V = target_probs.shape
    dev = target_probs.device
    rows = torch.arange(B, device=dev)
    u = rng.peek(B, tree.max_depth + 1, dev)  # (B, D + 1): one per token the round can emit
    node = torch.zeros(B, dtype=torch.long, device=dev)  # current accepted node
    walking = torch.ones(B, dtype=torch.bool, device=dev)
    next_token = torch.zeros(B, dtype=torch.long, device=dev)
    for d in range(tree.max_depth + 1):
        y = inverse_transform(target_probs[rows, node], u[:, d])  # (B,) the target's token
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        for s in range(tree.max_children if d < tree.max_depth else 0):
            child = tree.children[rows, node, s]  # (B,)
            hit = walking & ~moved & (child >= 0) & (tree.tokens[rows, child.clamp(min=0)] == y)
            node = torch.where(hit, child, node)
            moved |= hit
        next_token = torch.where(walking & ~moved, y, next_token)
        walking &= moved
    return _ended_at(tree, node, next_token)


def _ended_at(tree: DraftTree, node: torch.Tensor, next_token: torch.Tensor) -> VerifyResult:
    """The result of walks that ended at `node` (B,) with `next_token` (B,): a row that ran out
    of tree (its node has no children) took a bonus token, the others a recovered one."""
    rows = torch.arange(len(node), device=node.device)
    leaf = tree.children[rows, node, 0] < 0 if tree.max_children else torch.ones_like(node).bool()
    return VerifyResult(
        path=tree.paths[rows, node],
        num_accepted=tree.depth[rows, node],
        next_token=next_token,
        bonus=leaf,
        last_node=node,
    )
