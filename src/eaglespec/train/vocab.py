"""The draft vocabulary (spec section 1.4): the most frequent target tokens among the responses the
head is trained on, sorted by target id, as EAGLE and SpecForge build it.

  d2t (Vd,) int64 offsets: target_id = draft_id + d2t[draft_id]
  t2d (V,)  bool membership of each target id

Worked example: V = 8, Vd = 3, responses count {5: 9, 1: 4, 6: 4, 2: 1} -> most common 5, 1, 6
(ties by first seen) -> sorted ids [1, 5, 6] -> d2t [1, 4, 4], t2d [0 1 0 0 0 1 1 0].
With fewer distinct tokens than Vd the smallest unused ids fill the rest (SpecForge does the same).

`keep` (`eaglespec train --init-from HEAD --keep-vocab`): the continued head's ids first, then
the most frequent others up to `size`. A stage's 400K response tokens rank the rarer ids
differently from the last stage's: rebuilt from stage 14's data, stage 13's vocabulary kept only
5,056 of its 8,192 trained rows. Yet on equal data the rebuilt, kept and 16K (kept + 8K) heads
measured within 1.2% of each other on the six sets (session 26), so rebuilding is the default.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DraftVocab:
    ids: torch.Tensor  # (Vd,) int64 target ids, ascending
    vocab_size: int  # V

    @property
    def d2t(self) -> torch.Tensor:
        return self.ids - torch.arange(len(self.ids))

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.ids] = True
        return mask

    def coverage(self, tokens: Iterable[int]) -> float:
        """Share of `tokens` that the draft vocabulary can propose."""
        ids = torch.tensor(list(tokens), dtype=torch.long)
        return float(self.t2d[ids].float().mean()) if len(ids) else 0.0


def target_ids(d2t: torch.Tensor) -> list[int]:
    """The target id of each draft row of a saved head's d2t offsets."""
    return (torch.arange(len(d2t)) + d2t.cpu()).tolist()


def build_draft_vocab(
    responses: Sequence[Sequence[int]],
    size: int,
    vocab_size: int,
    keep: Sequence[int] = (),
) -> DraftVocab:
    """The `size` most frequent ids over `responses` (the loss-masked tokens), after every id in
    `keep` (a continued head's vocabulary; at most `size` of them); `size` >= `vocab_size`
    gives the whole target vocabulary."""
    if size >= vocab_size:
        return DraftVocab(torch.arange(vocab_size), vocab_size)
    if len(set(keep)) > size:
        raise ValueError(f"cannot keep {len(set(keep))} tokens in a draft vocabulary of {size}")
    counts: Counter[int] = Counter()
    for r in responses:
        counts.update(r)
    chosen = list(dict.fromkeys(keep))
    used = set(chosen)
    chosen += [t for t, _ in counts.most_common(size) if t not in used][: size - len(chosen)]
    if len(chosen) < size:
        used = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in used][: size - len(chosen)]
    return DraftVocab(torch.tensor(sorted(chosen), dtype=torch.long), vocab_size)
