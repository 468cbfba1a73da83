"""Static KV cache: writes, commits, gather-by-index and the attention mask, against hand-drawn
cases."""

from __future__ import annotations

import torch

from eaglespec.cache import KVCache, attention_mask, compact_order


def _cache(batch: int = 2, capacity: int = 16) -> KVCache:
    return KVCache.allocate(
        num_layers=2,
        batch=batch,
        num_kv_heads=1,
        capacity=capacity,
        head_dim=1,
        dtype=torch.float32,
    )


def _entries(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)[:, None, :, None]  # (B, Hkv=1, T, D=1)


def test_uniform_and_ragged_writes_land_after_each_row() -> None:
    c = _cache()
    c.write(0, _entries([[1, 2], [3, 4]]), _entries([[1, 2], [3, 4]]))
    c.advance([2, 1])  # row 1 keeps only its first entry
    c.write(0, _entries([[5], [6]]), _entries([[5], [6]]))  # ragged: slots 2 and 1
    c.advance([1, 1])
    assert c.lengths == [3, 2]
    assert c.k[0, 0, 0, :3, 0].tolist() == [1, 2, 5]
    assert c.k[0, 1, 0, :2, 0].tolist() == [3, 6]


def test_keep_gathers_accepted_entries_to_the_front() -> None:
    c = _cache()
    c.advance([7, 2])
    new = _entries([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]])
    c.write(1, new, new)
    # row 0 keeps new entries 0, 2, 5 (a root-to-leaf path); row 1 keeps entry 0 only.
    c.keep(torch.tensor([[0, 2, 5], [0, 4, 4]]), counts=[3, 1])
    assert c.lengths == [10, 3]
    assert c.k[1, 0, 0, 7:10, 0].tolist() == [10, 12, 15]
    assert c.v[1, 1, 0, 2, 0].item() == 20


def test_truncate_and_select_rows() -> None:
    c = _cache(batch=3)
    c.write(0, _entries([[1], [2], [3]]), _entries([[1], [2], [3]]))
    c.advance([1, 1, 1])
    c.truncate([1, 0, 1])
    sub = c.select_rows([2, 0])
    assert sub.lengths == [1, 1]
    assert sub.k[0, :, 0, 0, 0].tolist() == [3, 1]


def test_compact_order_refills_gaps_from_the_end() -> None:
    assert compact_order(6, [0, 2, 3, 4, 5]) == [0, 5, 2, 3, 4]
    assert compact_order(6, [1, 3, 5]) == [3, 1, 5]
    assert compact_order(4, [0, 1, 2, 3]) == [0, 1, 2, 3]
    assert compact_order(3, [2]) == [2]
    assert compact_order(3, []) == []


def test_compact_moves_only_the_movers_in_place_and_select_rows_copies() -> None:
    c = _cache(batch=5)
    for layer in range(2):
        c.write(
            layer,
            _entries([[10], [11], [12], [13], [14]]),
            _entries([[20], [21], [22], [23], [24]]),
        )
    c.advance([1, 1, 1, 1, 1])
    c.lengths = [1, 2, 3, 4, 5]  # distinct, to see them follow their rows
    rows = compact_order(5, [0, 2, 4])  # rows 1 and 3 leave: row 4 refills the gap at 1
    assert rows == [0, 4, 2]
    want_k = c.k[:, rows].clone()
    want_v = c.v[:, rows].clone()
    copy = c.select_rows(rows)
    assert copy.k.data_ptr() != c.k.data_ptr() and torch.equal(copy.k, want_k)
    before = c.k.clone()
    c.select_rows([1])  # a copy leaves its source as it was
    assert torch.equal(c.k, before)
    sub = c.compact(rows)
    assert sub.k.data_ptr() == c.k.data_ptr()  # a view: nothing was reallocated
    assert torch.equal(sub.k, want_k) and torch.equal(sub.v, want_v)
    assert sub.lengths == [1, 5, 3] and sub.batch == 3
    assert [t.is_contiguous() for t in sub.k_layers] == [True, True]  # what the kernels read
    # Another order copies, and leaves the cache it came from as it was.
    again = sub.compact([2, 0])
    assert again.k.data_ptr() != sub.k.data_ptr()
    assert torch.equal(again.k, want_k[:, [2, 0]]) and torch.equal(sub.k, want_k)


def test_attention_mask_prefix_causal_and_padding() -> None:
    m = attention_mask([2, 1], 2, None, torch.device("cpu"))
    assert m is not None and m.shape == (2, 1, 2, 4)
    assert m[0, 0].int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert m[1, 0].int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]


def test_attention_mask_tree() -> None:
    tree = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)  # root, 2 children
    m = attention_mask([2], 3, tree, torch.device("cpu"))
    assert m is not None
    assert m[0, 0].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]


def test_attention_mask_fast_paths_return_none() -> None:
    assert attention_mask([5, 5], 1, None, torch.device("cpu")) is None  # decode step
    assert attention_mask([0, 0], 7, None, torch.device("cpu")) is None  # fresh prompt


def test_attention_mask_window_reaches_into_committed_scratch() -> None:
    """Drafting a tree level by level: entries of the previous level were committed temporarily
    (length 5 = 3 prefix + 2 level-1 nodes); the two new level-2 nodes each see their own parent
    only among the level-1 entries, plus the prefix and themselves."""
    level2 = torch.tensor([[[1, 0, 1, 0], [0, 1, 0, 1]]], dtype=torch.bool)  # W = 4 = 2 + T
    m = attention_mask([5], 2, level2, torch.device("cpu"))
    assert m is not None
    assert m[0, 0].int().tolist() == [[1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 1, 0, 1]]
