"""Prompt lookup decoding: draft by copying what followed an earlier occurrence of the text's last
few tokens (n-gram matching, as transformers' `prompt_lookup_num_tokens` and vLLM's ngram
proposer do). No model: drafting costs a dictionary lookup per row, so a round costs just the
target's verification forward. It pays off where the output quotes its context (code edits,
summaries, extraction, retrieval-augmented answers) or repeats itself.

Matching, per row, over its history h = prompt + generated tokens (the current root included):
for n from max_ngram down to min_ngram, find the most recent earlier start i of the suffix n-gram
h[-n:] and propose what followed it. Worked example, h = [1, 2, 3, 4, 1, 2], k = 3:

    n = 3  suffix [4, 1, 2]   no earlier occurrence
    n = 2  suffix [1, 2]      found at i = 0 -> propose h[2:5] = [3, 4, 1]

A continuation that runs into the end of the history continues into the proposal itself (the match
predicts a repeat): h = [7, 8, 7, 8], n = 2 matches i = 0 and h[2:] has only [7, 8], so k = 3 gives
[7, 8, 7]. With no match at any n the row proposes its last token k times: every row must return
exactly k tokens, and a wrong draft costs nothing but the verification slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


class NgramIndex:
    """One row's token history and, for each n, the latest earlier start of every n-gram.

    `last[n]` maps each n-gram of the history except the final one (the suffix being matched) to
    its latest start, so looking the suffix up gives its most recent *earlier* occurrence in O(1).
    Appending a token makes the previous suffix an earlier occurrence: h = [1, 2, 3], n = 2 indexes
    (1, 2) -> 0 but not the suffix (2, 3); appending 4 indexes (2, 3) -> 1.
    """

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.tokens: list[int] = []
        self.last: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_ngram, max_ngram + 1)
        }

    def extend(self, tokens: Iterable[int]) -> None:
        h = self.tokens
        for t in tokens:
            h.append(t)
            for n, table in self.last.items():
                start = len(h) - 1 - n  # the n-gram that just stopped being the suffix
                if start >= 0:
                    table[tuple(h[start : start + n])] = start

    def propose(self, k: int) -> list[int]:
        """k tokens: the continuation of the longest suffix n-gram seen before, else the last token
        repeated."""
        found = self.find(k)
        return found if found is not None else [self.tokens[-1]] * k

    def find(self, k: int, after: Sequence[int] = ()) -> list[int] | None:
        """k tokens continuing the longest suffix n-gram seen before; None when none was. With
        `after`, of the history followed by those tokens (drafts not yet verified: what would
        follow them), as if they had been appended, without indexing them."""
        h, T = self.tokens, len(self.tokens)
        size = T + len(after)

        def at(i: int) -> int:  # token i of the history followed by `after`
            return h[i] if i < T else after[i - T]

        for n in sorted(self.last, reverse=True):
            if size <= n:
                continue
            key = tuple(h[-n:]) if not after else tuple(at(i) for i in range(size - n, size))
            start = None
            # occurrences the table does not hold, latest first: those reaching into `after`,
            # then the history's own final n-gram (the table's entries end before it)
            for p in range(size - n - 1, T - n - 1, -1) if after else ():
                if p >= 0 and all(at(p + i) == key[i] for i in range(n)):
                    start = p
                    break
            if start is None:
                start = self.last[n].get(key)
            if start is not None:
                out: list[int] = []
                src = start + n  # < size: the match is earlier than the suffix
                for j in range(k):
                    # Past the end the proposal continues from its own tokens.
                    i = src + j
                    out.append(at(i) if i < size else out[i - size])
                return out
        return None


@dataclass
class LookupState:
    rows: list[NgramIndex]  # one history per active row, in batch order
    device: torch.device  # where the engine wants the (B, k) drafts


class PromptLookupProposer:
    """Drafts chains of k tokens by n-gram lookup in each row's own prompt and output."""

    capture: tuple[int, ...] = ()  # reads tokens only

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def start(
        self,
        prompt_ids: torch.Tensor,  # (B, T) right-padded prompts
        roots: torch.Tensor,  # (B,) the target's first sampled tokens
        aux: Sequence[torch.Tensor],  # unused: capture is ()
        counts: Sequence[int],  # prompt length per row
        capacity: int,  # unused: the history is host-side and unbounded
    ) -> LookupState:
        prompts = prompt_ids.tolist()  # sync: histories live on the host
        first = roots.tolist()  # sync
        rows = []
        for prompt, n, root in zip(prompts, counts, first, strict=True):
            index = NgramIndex(self.min_ngram, self.max_ngram)
            index.extend(prompt[:n] + [root])
            rows.append(index)
        return LookupState(rows, prompt_ids.device)

    def propose(self, state: LookupState, k: int) -> torch.Tensor:
        drafts = [row.propose(k) for row in state.rows]
        return torch.tensor(drafts, dtype=torch.long, device=state.device).view(len(drafts), k)

    def catch_up(
        self,
        state: LookupState,
        tokens: torch.Tensor,  # (B, A) accepted draft tokens then the next root, right-padded
        aux: Sequence[torch.Tensor],  # unused: capture is ()
        counts: Sequence[int],  # accepted + 1 per row
    ) -> LookupState:
        host = tokens.tolist()  # sync: one small copy per round
        for row, toks, n in zip(state.rows, host, counts, strict=True):
            row.extend(toks[:n])
        return state

    def select_rows(self, state: LookupState, rows: Sequence[int]) -> LookupState:
        return LookupState([state.rows[r] for r in rows], state.device)

    def concat(self, states: Sequence[LookupState]) -> LookupState:
        return LookupState([row for s in states for row in s.rows], states[0].device)
