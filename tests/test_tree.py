"""Tree tensors against a hand-drawn tree (see the diagram in tree.py's docstring)."""

from __future__ import annotations

import pytest
import torch

from eaglespec.config import TreeConfig
from eaglespec.errors import InvalidRequestError
from eaglespec.tree import build_tree, chain_tree, graft_chain, graft_on_chain, verify_positions


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


# --- grafting a candidate chain (prompt lookup) into a drafted tree ------------------------------


def _grafted(chain: list[int], length: int):
    return graft_chain(_example(), torch.tensor([chain]), length)


def test_graft_continues_below_the_deepest_node_that_spells_the_chain() -> None:
    # The chain starts a, c (nodes 1, 3) then goes x, y where the tree has e (node 5) after c.
    t = _grafted([11, 13, 20, 21, 22, 23], 2)
    assert t.tokens.tolist() == [[10, 11, 12, 13, 14, 15, 20, 21]]
    assert t.parents.tolist() == [[-1, 0, 0, 1, 2, 3, 3, 6]]
    assert t.depth.tolist() == [[0, 1, 1, 2, 2, 3, 3, 4]]
    assert t.paths[0, 7].tolist() == [0, 1, 3, 6, 7, -1]
    assert t.children[0, 3].tolist() == [5, 6, -1]
    assert (t.max_depth, t.max_children) == (5, 3)


def test_graft_of_a_whole_drafted_path_extends_it() -> None:
    # a, c, e is the tree's deepest path: the graft hangs chain[3:5] below e (node 5).
    t = _grafted([11, 13, 15, 30, 31, 32], 2)
    assert t.tokens.tolist() == [[10, 11, 12, 13, 14, 15, 30, 31]]
    assert t.parents.tolist() == [[-1, 0, 0, 1, 2, 3, 5, 6]]
    assert t.depth[0, -1].item() == 5


def test_graft_without_a_match_is_a_new_branch_of_the_root() -> None:
    # b matches node 2 but chain[1] = 99 is no child of it: graft from chain[1] under b. A chain
    # that starts with a token the tree lacks goes under the root.
    t = _grafted([12, 99, 98, 0, 0, 0], 3)
    assert t.parents.tolist()[0][6:] == [2, 6, 7]
    assert t.tokens.tolist()[0][6:] == [99, 98, 0]
    t = _grafted([50, 51, 52, 53, 54, 55], 3)
    assert t.parents.tolist()[0][6:] == [0, 6, 7]
    assert t.tokens.tolist()[0][6:] == [50, 51, 52]
    assert t.depth.tolist()[0][6:] == [1, 2, 3]


def test_graft_per_row_and_onto_a_chain() -> None:
    # Row 0's chain repeats the drafts then continues (a longer chain); row 1's departs at once.
    chain = chain_tree(torch.tensor([1, 1]), torch.tensor([[2, 3], [2, 3]]))
    t = graft_chain(chain, torch.tensor([[2, 3, 4, 5], [7, 8, 9, 9]]), 2)
    assert t.tokens.tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, 7, 8]]
    assert t.parents.tolist() == [[-1, 0, 1, 2, 3], [-1, 0, 1, 0, 3]]
    assert t.mask[1].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 0, 1, 0],
        [1, 0, 0, 1, 1],
    ]
    assert not t.is_chain  # bounds, not data: row 1 branches


@pytest.mark.parametrize("seed", range(6))
def test_graft_on_chain_builds_graft_chains_tree_from_host_lists(seed: int) -> None:
    """hybrid.py's CPU path: the tree graft_chain builds over a chain, its structure cached per
    (chain length, hang depth, graft length), field for field. Rows share a few tokens, so the
    continuations leave their chains at every depth, the root and the last draft included."""
    gen = torch.Generator().manual_seed(seed)
    B = 1 + seed % 3
    k = 1 + seed % 4
    length = 1 + (seed + 1) % 3
    drafts = torch.randint(0, 3, (B, k), generator=gen)
    roots = torch.tensor([9] * B)
    cont = torch.randint(0, 3, (B, k + length), generator=gen)
    cont[0, : k - 1] = drafts[0, : k - 1]  # row 0 leaves its chain at the last draft at most
    chain = chain_tree(roots, drafts)
    want = graft_chain(chain, cont, length)
    rows = chain.tokens.tolist()
    got = graft_on_chain(rows, cont.tolist(), length, torch.device("cpu"))
    for name in ("tokens", "parents", "depth", "mask", "paths", "children"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.max_depth, got.max_children, got.draft_probs) == (
        want.max_depth,
        want.max_children,
        None,
    )


def test_graft_refuses_sampled_drafts() -> None:
    chain = chain_tree(torch.tensor([1]), torch.tensor([[2]]), draft_probs=torch.ones(1, 2, 4))
    with pytest.raises(ValueError, match="deterministic"):
        graft_chain(chain, torch.tensor([[2, 3]]), 1)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((0, 4, 16), "tree depth 0, top_k 4: both must be at least 1"),
        ((3, 0, 4), "tree depth 3, top_k 0: both must be at least 1"),
        ((2, 2, 7), "num_nodes must be in [1, 6], got 7"),
        ((2, 2, 0), "num_nodes must be in [1, 6], got 0"),
    ],
)
def test_a_tree_shape_that_cannot_be_built_names_its_problem(
    shape: tuple[int, int, int], message: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        TreeConfig(*shape)
    assert message in str(err.value)
