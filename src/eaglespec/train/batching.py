"""Length-bucketed batches: one rule for regeneration, feature capture and training."""

from __future__ import annotations

from collections.abc import Sequence


def length_batches(
    lengths: Sequence[int], budget: int, max_rows: int | None = None
) -> list[list[int]]:
    """Indices sorted by length, cut so that rows * longest row <= `budget` (padded positions)
    and rows <= `max_rows`. A row longer than the budget gets a batch of its own.
    Example: lengths [5, 2, 3, 9], budget 8 -> [[1, 2], [0], [3]]."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        full = max_rows is not None and len(cur) >= max_rows
        if cur and (full or (len(cur) + 1) * lengths[i] > budget):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches
