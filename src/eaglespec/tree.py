"""Draft trees and the tensors the target's verification forward needs. Pure tensor code.

Dims: B batch rows, N tree nodes (node 0 is the root), D max depth, V vocabulary.

A tree is given by its node tokens and parent indices, in topological order (parents[i] < i):

        root(0)                     tokens  [t0, a, b, c]
        ├── a(1) ── c(3)            parents [-1, 0, 0, 1]
        └── b(2)                    depth   [0, 1, 1, 2]

    mask (ancestor-or-self):        paths (root -> node, -1 padded, width D + 1):
        0: 1 0 0 0                      0: [0, -1, -1]
        1: 1 1 0 0                      1: [0,  1, -1]
        2: 1 0 1 0                      2: [0,  2, -1]
        3: 1 1 0 1                      3: [0,  1,  3]

The root is the last token the target sampled; it is not in the target's cache yet, so the verify
forward runs all N nodes at positions `prefix_len + depth` with `mask` as the attention mask among
them. Every node's root path is a candidate (a prefix of a leaf path is a candidate too), so
verification picks the deepest fully accepted node and needs no list of leaves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DraftTree:
    tokens: torch.Tensor  # (B, N) int64 target-vocabulary ids; tokens[:, 0] is the root
    parents: torch.Tensor  # (B, N) int64, -1 for the root, parents[i] < i
    depth: torch.Tensor  # (B, N) int64, 0 for the root
    mask: torch.Tensor  # (B, N, N) bool, mask[b, i, j]: j is i or an ancestor of i
    paths: torch.Tensor  # (B, N, D + 1) int64, node indices root -> i, -1 padded
    children: torch.Tensor  # (B, N, K) int64, the children of each node in index order, -1 padded
    draft_probs: torch.Tensor | None  # (B, N, V) q each node's token was drawn from; None: picked
    max_depth: int  # D, host side: bounds the verification loop without a sync
    max_children: int  # K, host side

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def is_chain(self) -> bool:
        """At most one child per node: in topological order that is the chain 0 -> 1 -> 2 ...,
        so node i sits at depth i, its root path is 0 .. i and its mask row is causal."""
        return self.max_children <= 1


def build_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    *,
    max_depth: int,
    max_children: int,
    draft_probs: torch.Tensor | None = None,
) -> DraftTree:
    """Derive depth, mask, paths and children from tokens (B, N) and parents (B, N).

    `max_depth` / `max_children` are the bounds the builder knows by construction (a chain of k
    tokens: k and 1; a top-k tree of depth d: d and k); they are not checked against the data."""
    B, N = tokens.shape
    dev = tokens.device
    idx = torch.arange(N, device=dev)
    # Transitive closure by squaring: M = I | parent-edge, then M <- M M until paths of length
    # >= N are covered (ceil(log2 N) rounds of a (B, N, N) matmul; N is small).
    # edge[b, i, parents[b, i]] = 1 (a scatter, not boolean indexing, which would sync on GPU)
    has_parent = (parents >= 0).float()[..., None]  # (B, N, 1)
    edge = torch.zeros(B, N, N, device=dev).scatter_(2, parents.clamp(min=0)[..., None], has_parent)
    reach = edge + torch.eye(N, device=dev)
    for _ in range(max(1, (N - 1).bit_length())):
        reach = (reach @ reach).clamp_(max=1.0)
    mask = reach > 0
    depth = mask.sum(-1) - 1  # ancestors excluding self
    # paths[b, i, depth[j]] = j for each ancestor-or-self j of i (one j per depth: amax picks it).
    width = max_depth + 1
    src = torch.where(mask, idx, -1)  # (B, N, N)
    slot = depth[:, None, :].expand(B, N, N).clamp(max=width - 1)
    paths = torch.full((B, N, width), -1, dtype=torch.long, device=dev)
    paths.scatter_reduce_(2, slot, src, reduce="amax")
    children = _children(parents, max_children)
    return DraftTree(
        tokens, parents, depth, mask, paths, children, draft_probs, max_depth, max_children
    )


def _children(parents: torch.Tensor, max_children: int) -> torch.Tensor:
    """(B, N, K) children of each node in index order. Example: parents [-1, 0, 0, 1] ->
    children[0] = [1, 2], children[1] = [3, -1], children[2] = children[3] = [-1, -1]."""
    B, N = parents.shape
    dev = parents.device
    idx = torch.arange(N, device=dev)
    same = parents[:, :, None] == parents[:, None, :]  # (B, N, N): j, j' share a parent
    earlier = idx[None, :] < idx[:, None]  # (N, N): j' < j
    rank = (same & earlier).sum(-1)  # (B, N): position of j among its siblings
    children = torch.full((B, N + 1, max_children + 1), -1, dtype=torch.long, device=dev)
    # Roots (parent -1) and ranks past K land in the spare row / column, dropped below.
    parent_slot = torch.where(parents >= 0, parents, N)
    rank_slot = rank.clamp(max=max_children)
    rows = torch.arange(B, device=dev)[:, None].expand(B, N)
    children[rows, parent_slot, rank_slot] = idx.expand(B, N)
    return children[:, :N, :max_children]


def chain_tree(
    root: torch.Tensor, draft: torch.Tensor, draft_probs: torch.Tensor | None = None
) -> DraftTree:
    """A chain: root (B,) then k draft tokens (B, k), each the child of the one before."""
    B, k = draft.shape
    tokens = torch.cat([root[:, None], draft], dim=1)  # (B, N)
    parents, depth, mask, paths, children = _chain_structure(B, k, draft.device)
    return DraftTree(
        tokens=tokens,
        parents=parents,
        depth=depth,
        mask=mask,
        paths=paths,
        children=children,
        draft_probs=draft_probs,
        max_depth=k,
        max_children=1,
    )


@functools.lru_cache(maxsize=64)
def _chain_structure(B: int, k: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A chain's parents, depth, mask, paths and children, each expanded over B rows: known in
    closed form (build_tree derives the same, with matmuls): node i has parent i - 1, depth i,
    ancestors-or-self 0 .. i, path [0 .. i, -1 ...], child i + 1. The same for every round of a
    shape, so made once (nine ops, about 8% of a chain round's work outside the forwards); the
    tensors are expanded views, never written."""
    N = k + 1
    idx = torch.arange(N, device=device)
    mask = idx[None, :] <= idx[:, None]  # (N, N) lower triangle
    paths = torch.where(mask, idx[None, :], -1)  # (N, N): row i is 0 .. i, then -1
    children = torch.where(idx < k, idx + 1, -1)[:, None]  # (N, 1)
    return (
        (idx - 1).expand(B, N),
        idx.expand(B, N),
        mask.expand(B, N, N),
        paths.expand(B, N, N),
        children.expand(B, N, 1),
    )


def graft_on_chain(
    drafted: list[list[int]], chains: list[list[int]], length: int, device: torch.device
) -> DraftTree:
    """graft_chain over a chain tree, from host lists: row b's root and k drafts `drafted[b]`
    (k + 1 tokens), its candidate continuation `chains[b]` (k + length tokens). Where every
    row's continuation goes on from its last draft, the result is a chain of k + length drafts
    (verified and committed as one: no tree mask, tree walk or cache gather, ~0.8 ms a round).
    Otherwise graft_chain's tree (tokens, parents, depth, mask, paths, children, bounds), whose
    structure depends only on k, length and the node each row's graft hangs from (the chain's
    draft depth d where the continuation leaves it), so it is built once per (k, d, length) and
    reused: graft_chain's closure matmuls and scatters took 0.11 ms warm and 0.23 ms with the
    caches cold (as after a verify forward), in about a sixth of SmolLM2's rounds with lookup;
    this takes 0.005 / 0.04."""
    k = len(drafted[0]) - 1
    rows, hung = [], []
    for tokens, chain in zip(drafted, chains, strict=True):
        d = 0
        while d < k and chain[d] == tokens[d + 1]:
            d += 1
        rows.append(tokens + chain[d : d + length])
        hung.append(d)
    tokens = torch.tensor(rows, device=device)  # (B, k + 1 + length)
    if all(d == k for d in hung):
        return chain_tree(tokens[:, 0], tokens[:, 1:])
    parts = [_grafted_structure(k, d, length, device) for d in hung]
    fields = parts[0] if len(parts) == 1 else [torch.cat(f) for f in zip(*parts, strict=True)]
    parents, depth, mask, paths, children = fields
    return DraftTree(
        tokens,
        parents,
        depth,
        mask,
        paths,
        children,
        None,
        k + length,
        2,
    )


@functools.lru_cache(maxsize=256)
def _grafted_structure(
    k: int, d: int, length: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """parents, depth, mask, paths and children (each with a batch dim of 1) of a chain of k
    drafts with `length` nodes grafted in a chain under draft d (d = 0: the root), as
    build_tree derives them; never written (rows are concatenated, not edited)."""
    parents = list(range(-1, k)) + [d] + list(range(k + 1, k + length))
    p = torch.tensor([parents], device=device)
    tree = build_tree(p.clamp(min=0), p, max_depth=k + length, max_children=2)
    return tree.parents, tree.depth, tree.mask, tree.paths, tree.children


def verify_positions(tree: DraftTree, prefix_len: torch.Tensor) -> torch.Tensor:
    """RoPE positions of the nodes: prefix_len (B,) + depth. Prefix 7, depths [0, 1, 1, 2] ->
    [7, 8, 8, 9]."""
    return prefix_len[:, None] + tree.depth


def graft_chain(tree: DraftTree, chain: torch.Tensor, length: int) -> DraftTree:
    """Add `length` nodes to every row: the continuation of `chain` below the deepest node whose
    root path spells the chain's start (the root when none does).

    chain (B, D + length), D = tree.max_depth: a candidate continuation of each row's root (prompt
    lookup's). Where the tree already drafted the chain's first d tokens, the graft goes on from
    chain[d] under that node, so no sibling repeats a token and every row gains exactly `length`
    nodes. Example, tokens [r, a, b, c] parents [-1, 0, 0, 1] (paths r-a-c and r-b), chain
    [a, c, x, y, z, w], length 2: node 3 spells [a, c] -> nodes 4 = x (parent 3), 5 = y (parent 4).
    With chain [e, ...] nothing matches and e heads a new branch under the root.

    Drafted tokens must be deterministic picks (draft_probs None): the grafted ones are."""
    if tree.draft_probs is not None:
        raise ValueError("graft_chain needs deterministic drafts (draft_probs None)")
    B, N = tree.tokens.shape
    D = tree.max_depth
    dev = tree.tokens.device
    nodes = tree.paths.clamp(min=0)  # (B, N, D + 1)
    spelled = torch.gather(tree.tokens[:, None, :].expand(B, N, N), 2, nodes)  # (B, N, D + 1)
    agree = (spelled[:, :, 1:] == chain[:, None, :D]) | (tree.paths[:, :, 1:] < 0)  # (B, N, D)
    depth = torch.where(agree.all(-1), tree.depth, -1)  # (B, N): matching nodes' depths
    at = depth.argmax(-1)  # (B,) the deepest match (the root, depth 0, always matches)
    start = tree.depth.gather(1, at[:, None])  # (B, 1)
    steps = torch.arange(length, device=dev)
    new = chain.gather(1, start + steps)  # (B, length)
    parents = torch.cat([at[:, None], (N + steps[:-1]).expand(B, length - 1)], 1)  # (B, length)
    return build_tree(
        torch.cat([tree.tokens, new], 1),
        torch.cat([tree.parents, parents], 1),
        max_depth=D + length,
        max_children=tree.max_children + 1,
    )
