"""Tree tensors against a hand-drawn tree (see the diagram in tree.py's docstring)."""

from __future__ import annotations

import pytest
import torch

from eaglespec.tree import build_tree, chain_tree, verify_positions


def _example():
    #   root(0) ─┬─ a(1) ── c(3) ── e(5)
    #            └─ b(2) ── d(4)
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3]])
    return build_tree(tokens, parents, max_depth=3, max_children=2)


def test_depth_mask_paths_children() -> None:
    t = _example()
    assert t.depth.tolist() == [[0, 1, 1, 2, 2, 3]]
    assert t.mask[0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 1, 0, 1, 0, 1],
    ]
    assert t.paths[0].tolist() == [
        [0, -1, -1, -1],
        [0, 1, -1, -1],
        [0, 2, -1, -1],
        [0, 1, 3, -1],
        [0, 2, 4, -1],
        [0, 1, 3, 5],
    ]
    assert t.children[0].tolist() == [[1, 2], [3, -1], [4, -1], [5, -1], [-1, -1], [-1, -1]]


def test_positions_follow_depth() -> None:
    t = _example()
    assert verify_positions(t, torch.tensor([7])).tolist() == [[7, 8, 8, 9, 9, 10]]


def test_chain_is_a_path() -> None:
    t = chain_tree(torch.tensor([5, 6]), torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert t.tokens.tolist() == [[5, 1, 2, 3], [6, 4, 5, 6]]
    assert t.depth.tolist() == [[0, 1, 2, 3]] * 2
    assert t.mask[1].int().tril().equal(t.mask[1].int()) and bool(t.mask[1].all(-1)[-1])
    assert t.paths[0, 3].tolist() == [0, 1, 2, 3]
    assert t.children[0, :, 0].tolist() == [1, 2, 3, -1]


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_chain_structure_in_closed_form_is_build_trees(k: int) -> None:
    """chain_tree writes a chain's structure down directly; build_tree derives the same."""
    root, draft = torch.tensor([5, 6, 7]), torch.arange(3 * k).view(3, k) + 10
    fast = chain_tree(root, draft)
    parents = torch.arange(-1, k).expand(3, k + 1)
    slow = build_tree(fast.tokens, parents, max_depth=k, max_children=1)
    for field in ("tokens", "parents", "depth", "mask", "paths", "children"):
        assert torch.equal(getattr(fast, field), getattr(slow, field)), field
    assert (fast.max_depth, fast.max_children) == (slow.max_depth, slow.max_children)


def test_batch_rows_with_different_shapes() -> None:
    tokens = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    parents = torch.tensor([[-1, 0, 1, 2], [-1, 0, 0, 0]])  # a chain and a star
    t = build_tree(tokens, parents, max_depth=3, max_children=3)
    assert t.depth.tolist() == [[0, 1, 2, 3], [0, 1, 1, 1]]
    assert t.children[1, 0].tolist() == [1, 2, 3]
    assert t.paths[1, 3].tolist() == [0, 3, -1, -1]
