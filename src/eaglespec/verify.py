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
Sampled (recursive rejection sampling over siblings, lossless): at node i, with p = p_i, try the
children in index order; child c (token x, drawn from q_c) is accepted with probability
min(1, p(x) / q_c(x)); on rejection p <- norm(max(p - q_c, 0)) and the next sibling is tried.
Deterministic draft picks (top-k, no sampling) have q_c = one-hot(x): acceptance p(x), and the
rejection zeroes x in p. If no child is accepted, the recovered token is sampled from the final p.
Greedy rows can share the sampled path with one-hot target probabilities (sampling.py makes them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglespec.sampling import RowRandom, greedy_tokens
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
    so the loop bounds are the host ints D and K and nothing syncs."""
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
    # A row that still walks after D levels, or stopped at a node without children, takes a bonus.
    leaf = tree.children[rows, node, 0] < 0
    next_token = rng.sample(p)
    return VerifyResult(
        path=tree.paths[rows, node],
        num_accepted=tree.depth[rows, node],
        next_token=next_token,
        bonus=leaf,
        last_node=node,
    )
