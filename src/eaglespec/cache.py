"""Static, preallocated KV cache and the attention masks over it.

Pure tensor code: no model imports.

Dims: L layers, B batch rows, Hkv KV heads, S capacity, D head dim, T new tokens, K attended keys,
A kept.

Layout is layer-major, (L, B, Hkv, S, D), so each layer's slice `k[l]` is one contiguous
(B, Hkv, S, D) block that SDPA reads directly.

Lifecycle of one forward over T new tokens:
  1. `write_slots(T)` tells the model where row b's new entries go: slots len_b .. len_b + T - 1.
  2. the model writes K/V there and attends over slots [0, max(len) + T) with `attention_mask`.
  3. the caller commits: `advance(counts)` keeps the first counts[b] new entries of each row
     (plain decoding, ragged prefill), or `keep(src, counts)` gathers accepted entries from anywhere
     among the new ones (speculative verification keeps one root-to-leaf path of a tree).
Entries past a row's length are scratch: never attended, overwritten by the next write.

Lengths live on the host as plain ints: they decide slice bounds, and reading them from the device
would cost a sync per step. Callers that learn counts on the device sync once to commit.

A forward never reads the lengths itself: `plan(T, new_mask)` turns them into a `CachePlan` (the
write index as tensors, the number of keys, the mask), built on the host before the forward, and
the layers take one layer's cache tensors (`k_layers[l]`, views made once per cache) plus the plan.
So the forward's tensor code sees no Python state that changes every step, and `torch.compile`
can trace it once (model/llama.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class CachePlan:
    """Where one forward's T new entries go and which keys each new token sees."""

    # Row b writes its T new entries to slots[b]: the (row, head, slot) index of one index_put,
    # shapes (B, 1, 1), (1, Hkv, 1), (B, 1, T), built once per forward for all layers.
    write_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    slots: torch.Tensor  # (B, T) int64: the same slots as one tensor (the CPU row-op kernels')
    num_keys: int  # K = max(len) + T: attention reads slots [0, K) of every row
    mask: torch.Tensor | None  # (B, 1, T, K) bool, or None (see `attention_mask`)
    prefix_free: bool  # no committed entries and no mask: plain causal attention among the new
    # (on CPU `mask` then holds that causal mask too, for eaglespec's attention kernel)


@dataclass(slots=True)
class KVCache:
    k: torch.Tensor  # (L, B, Hkv, S, D)
    v: torch.Tensor  # (L, B, Hkv, S, D)
    lengths: list[int]  # committed entries per row, host side
    # Per-layer views k[l], v[l], each (B, Hkv, S, D): what the layers write and read.
    k_layers: tuple[torch.Tensor, ...] = ()
    v_layers: tuple[torch.Tensor, ...] = ()
    # The (row, head) parts of every plan's write index, (B, 1, 1) and (1, Hkv, 1): fixed for the
    # cache's life, so made once (three index tensors a forward cost 20 us, a twentieth of a
    # draft step).
    row_head_index: tuple[torch.Tensor, ...] = ()

    def __post_init__(self) -> None:
        # select, not unbind: autograd forbids in-place writes to unbind's multi-output views
        # (training backpropagates through cache writes, train/ttt.py's tests).
        self.k_layers = tuple(self.k[i] for i in range(self.k.shape[0]))
        self.v_layers = tuple(self.v[i] for i in range(self.v.shape[0]))
        B, Hkv, dev = self.k.shape[1], self.k.shape[2], self.k.device
        self.row_head_index = (
            torch.arange(B, device=dev)[:, None, None],
            torch.arange(Hkv, device=dev)[None, :, None],
        )

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        return cls(
            k=torch.zeros(shape, dtype=dtype, device=device),
            v=torch.zeros(shape, dtype=dtype, device=device),
            lengths=[0] * batch,
        )

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def uniform(self) -> bool:
        """All rows have the same length: writes are one slice and no padding mask is needed."""
        return min(self.lengths) == max(self.lengths)

    def check_room(self, num_new: int) -> None:
        need = max(self.lengths) + num_new
        if need > self.capacity:
            raise ValueError(f"KV cache overflow: {need} entries needed, capacity {self.capacity}")

    def write_slots(self, num_new: int) -> torch.Tensor:
        """(B, T) int64 slot of each new entry: lengths [3, 5], T=2 -> [[3, 4], [5, 6]]."""
        if len(self.lengths) == 1:  # one op where two would do (a decode or draft step)
            n = self.lengths[0]
            return torch.arange(n, n + num_new, device=self.k.device)[None]
        start = torch.tensor(self.lengths, device=self.k.device)[:, None]  # (B, 1)
        return start + torch.arange(num_new, device=self.k.device)

    def plan(self, num_new: int, new_mask: torch.Tensor | None = None) -> CachePlan:
        """The plan of a forward over `num_new` tokens (raises if they do not fit)."""
        self.check_room(num_new)
        slots = self.write_slots(num_new)
        prefix_free = new_mask is None and max(self.lengths) == 0
        mask = attention_mask(self.lengths, num_new, new_mask, self.k.device)
        if prefix_free and num_new > 1 and self.k.device.type == "cpu":
            # eaglespec's CPU attention takes a prefill as masked rows onto the cache, each
            # computed as a one-token step at its position would be (layers.cached_attention):
            # a prompt then leaves the same cache bits in one chunk or many, alone or batched.
            t = torch.arange(num_new, device=self.k.device)
            mask = (t[None, :] <= t[:, None]).expand(len(self.lengths), 1, num_new, num_new)
        return CachePlan(
            write_index=self._write_index(slots),
            slots=slots,
            num_keys=max(self.lengths) + num_new,
            mask=mask,
            prefix_free=prefix_free,
        )

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """k_new, v_new (B, Hkv, T, D) written at each row's next T slots."""
        index = self._write_index(self.write_slots(k_new.shape[2]))
        write_entries(self.k_layers[layer], self.v_layers[layer], index, k_new, v_new)

    def _write_index(
        self,
        slots: torch.Tensor,  # (B, T) from write_slots
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, head, slot) index tensors that broadcast to (B, Hkv, T) (`CachePlan`)."""
        rows, heads = self.row_head_index  # (B, 1, 1), (1, Hkv, 1)
        return rows, heads, slots[:, None, :]  # slots (B, 1, T)

    def view(self, layer: int, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first K slots of one layer: two (B, Hkv, K, D) views."""
        return self.k[layer, :, :, :num_keys], self.v[layer, :, :, :num_keys]

    def advance(self, counts: Sequence[int]) -> None:
        """Commit the first counts[b] new entries of row b."""
        self.lengths = [n + c for n, c in zip(self.lengths, counts, strict=True)]

    def truncate(self, lengths: Sequence[int]) -> None:
        """Forget everything past lengths[b] in row b (no data moves)."""
        if any(n > old for n, old in zip(lengths, self.lengths, strict=True)):
            raise ValueError(f"truncate can only shorten rows: {list(lengths)} vs {self.lengths}")
        self.lengths = list(lengths)

    def compact(self, rows: Sequence[int]) -> KVCache:
        """`select_rows` for a caller that drops this cache: when every row either stays where it
        is or moves down from at or past the new size (`compact_order`'s order), the rows are
        moved in place and the result is a view of this cache's tensors, so a departure copies
        the moving rows only (a copy of a 64-row cache took 0.17 s, a step of those rows about
        0.08 s). This cache must not be used after. Any other order copies (`select_rows`)."""
        n = len(rows)
        if len(set(rows)) != n or any(r != i and r < n for i, r in enumerate(rows)):
            return self.select_rows(rows)
        for i, r in enumerate(rows):
            if r != i:
                self.k[:, i] = self.k[:, r]
                self.v[:, i] = self.v[:, r]
        return KVCache(k=self.k[:, :n], v=self.v[:, :n], lengths=[self.lengths[r] for r in rows])

    def row(self, b: int) -> KVCache:
        """Row b as a one-row cache over the same memory (a view: what a forward writes into it
        is row b's), with row b's length; the caller sets this cache's lengths after. Each
        layer's slice of a one-row view is contiguous, as the kernels want."""
        return KVCache(k=self.k[:, b : b + 1], v=self.v[:, b : b + 1], lengths=[self.lengths[b]])

    def select_rows(self, rows: Sequence[int]) -> KVCache:
        """A cache holding only the given rows, in that order (a copy)."""
        idx = torch.tensor(list(rows), device=self.k.device)
        return KVCache(
            k=self.k.index_select(1, idx),
            v=self.v.index_select(1, idx),
            lengths=[self.lengths[r] for r in rows],
        )

    @classmethod
    def concat(cls, parts: Sequence[KVCache]) -> KVCache:
        """One cache holding the rows of `parts` in order (new sequences joining a running batch),
        with the largest capacity among them. Only committed slots are copied; the rest is zeros,
        so scratch never holds garbage (a NaN there would poison attention's zero weights)."""
        first = parts[0]
        L, _, Hkv, _, D = first.k.shape
        capacity = max(c.capacity for c in parts)
        batch = sum(c.batch for c in parts)
        shape = (L, batch, Hkv, capacity, D)
        k = torch.zeros(shape, dtype=first.k.dtype, device=first.k.device)
        v = torch.zeros_like(k)
        row = 0
        for c in parts:
            n = max(c.lengths)
            k[:, row : row + c.batch, :, :n] = c.k[:, :, :, :n]
            v[:, row : row + c.batch, :, :n] = c.v[:, :, :, :n]
            row += c.batch
        return cls(k=k, v=v, lengths=[n for c in parts for n in c.lengths])

    def keep(self, src: torch.Tensor, counts: Sequence[int]) -> None:
        """Gather-by-index commit: row b keeps new entries src[b, :counts[b]] (offsets from len_b,
        increasing), moved to slots len_b .. len_b + counts[b] - 1.

        src (B, A) int64. Entries of src past counts[b] may hold anything in [0, T): they copy
        scratch to scratch.
        Example: len 7, src [0, 2, 5], count 3 -> slots 7, 9, 12 move to 7, 8, 9.
        """
        B, A = src.shape
        # Row by row, an index_select then a copy into a slice: 45 us for one row against 141
        # for one advanced-index gather and scatter over all rows (SmolLM2's 30 layers, 3
        # entries, 2 threads), and no slower up to 16 rows.
        for b in range(B):
            n = self.lengths[b]
            for cache in (self.k, self.v):
                picked = cache[:, b].index_select(2, src[b] + n)  # (L, Hkv, A, D), a copy
                cache[:, b, :, n : n + A].copy_(picked)  # so overlapping src / dst is safe
        self.advance(counts)


def compact_order(batch: int, keep: Sequence[int]) -> list[int]:
    """The rows `keep` (increasing) in the order in which `KVCache.compact` moves the fewest:
    each row that left below the new size is refilled by a kept row from past it.
    Example: batch 6, keep [0, 2, 3, 4, 5] -> [0, 5, 2, 3, 4] (row 5 moves, nothing else)."""
    n = len(keep)
    assert n <= batch
    stay = {r for r in keep if r < n}
    movers = iter(r for r in keep if r >= n)
    return [i if i in stay else next(movers) for i in range(n)]


def write_entries(
    k_cache: torch.Tensor,  # (B, Hkv, S, D) one layer's cache
    v_cache: torch.Tensor,  # (B, Hkv, S, D)
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # CachePlan.write_index
    k_new: torch.Tensor,  # (B, Hkv, T, D)
    v_new: torch.Tensor,  # (B, Hkv, T, D)
) -> None:
    """Row b's T new entries go to its slots: one index_put over (row, head, slot) each."""
    k_cache.index_put_(index, k_new)
    v_cache.index_put_(index, v_new)


def sliding_plan(
    plan: CachePlan,
    positions: torch.Tensor,  # (B, T) int64 RoPE positions of the new tokens
    window: int,
) -> CachePlan:
    """The plan of a sliding-window layer (Gemma 3): `plan`'s keys less those `window` or more
    positions behind each query, as transformers masks them (key position > query position -
    window). A committed entry's position is its slot (rows commit in order; a verified tree's
    accepted path is moved into consecutive slots), a new entry's is its own. Where the keys
    reach back less than `window` positions every key is within every window and `plan` is
    returned as it is (no mask is made: the usual case below the window)."""
    K = plan.num_keys
    if window >= K:  # positions never exceed slots here: every key is within reach
        return plan
    B, T = positions.shape
    dev = positions.device
    key_pos = torch.arange(K, device=dev).expand(B, K).clone()  # (B, K): committed slot s at s
    key_pos.scatter_(1, plan.slots, positions)  # the new entries at their own positions
    band = key_pos[:, None, :] > positions[:, :, None] - window  # (B, T, K)
    if plan.mask is not None:
        base = plan.mask  # (B, 1, T, K)
    elif T == 1:
        base = torch.ones(B, 1, 1, K, dtype=torch.bool, device=dev)  # the whole prefix
    else:  # no prefix: causal among the new tokens (K == T)
        t = torch.arange(T, device=dev)
        base = (t[None, :] <= t[:, None]).expand(B, 1, T, T)
    return CachePlan(
        write_index=plan.write_index,
        slots=plan.slots,
        num_keys=K,
        mask=base & band[:, None],
        prefix_free=False,
    )


def attention_mask(
    lengths: Sequence[int], num_new: int, new_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """Mask (B, 1, T, K) over K = max(len) + T keys, True where query t of row b may attend.

    `new_mask` (B, T, W), W >= T, covers the last W slots up to and including the new tokens of
    each row: slots len_b + T - W .. len_b + T - 1. Slots before that window are visible; slots
    inside it are visible where new_mask says. W = T is a mask among the new tokens (a tree being
    verified); W > T also reaches back into entries written by earlier forwards and committed
    temporarily (the levels of a tree being drafted). None means causal among the new tokens.
    Returns None when no mask is needed: no new_mask, every row the same length, and either one
    new token (it sees the whole prefix) or no prefix at all (plain causal attention).
    Example: lengths [2, 1], T 2, causal -> K 4; row 0: t0 sees slots 0-2, t1 sees 0-3;
    row 1: t0 sees slots 0-1, t1 sees 0-2 (slot 3 is row 1's padding and stays hidden).
    """
    B = len(lengths)
    chain = new_mask is None and min(lengths) == max(lengths)  # causal, every row one length
    if chain and (num_new == 1 or lengths[0] == 0):
        return None
    K = max(lengths) + num_new
    if chain:  # two ops where seven would do
        causal = torch.ones(num_new, K, dtype=torch.bool, device=device).tril(K - num_new)
        return causal.expand(B, 1, num_new, K)  # t sees slots up to len + t
    length = torch.tensor(lengths, device=device)[:, None, None]  # (B, 1, 1)
    s = torch.arange(K, device=device)[None, None, :]  # (1, 1, K)
    t = torch.arange(num_new, device=device)[None, :, None]  # (1, T, 1)
    if new_mask is None:
        return (s <= length + t)[:, None]  # prefix plus causal among the new tokens
    W = new_mask.shape[2]
    assert num_new <= W and new_mask.shape[:2] == (B, num_new), tuple(new_mask.shape)
    j = s - (length + num_new - W)  # (B, 1, K): column of new_mask, negative before the window
    inside = (j >= 0) & (j < W)
    picked = torch.gather(new_mask, 2, j.clamp(0, W - 1).expand(B, num_new, K))  # (B, T, K)
    return ((j < 0) | (inside & picked))[:, None]
