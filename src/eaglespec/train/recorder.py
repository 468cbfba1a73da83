"""The target's states of every position of its answers, taken while it answers.

`FeatureRecorder` is a proposer that drafts nothing (the engine's protocol, draft/base.py): its
`start` receives the target's states of each prompt after the prefill and its `catch_up` those of
each token fed after every step, so answering with it leaves nothing for a feature prefill
(features.py) to compute. The kernels compute a row the same way in a prefill as in a one-token
step (model/w4a8.py), so the recorded states equal the prefill's wherever both exist, and under
greedy answering the token the target chose after each answer position is its top-1 there. Two
kinds of positions differ, neither ever trained on (ttt.py's loss mask): the answer's last
position, whose token is never fed (features.recorded_sample gives it zero states and top-1), and
the prompt's positions before its last, whose top-1 is recorded as the prompt's own next token.

Dims: B batch rows, T positions, A captured states, Ct target hidden.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from eaglespec.model.llama import Transformer


def split_states(
    model: Transformer, hidden: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's states captured at (*capture, num_layers), each (B, T, Ct) -> aux (B, T,
    A*Ct), the capture boundaries low -> high, and final (B, T, Ct), the post-norm last state
    that lm_head reads. The feature prefill (features.py) and the recorder both split them here."""
    return torch.cat(list(hidden[:-1]), dim=-1), model.norm(hidden[-1])


@dataclass(slots=True)
class RowFeatures:
    """One answering row's features so far (FeatureRecorder), in position order."""

    aux: list[torch.Tensor]  # chunks (t, A*Ct): the states at the capture boundaries
    final: list[torch.Tensor]  # chunks (t, Ct): the post-norm final state
    chosen: list[torch.Tensor]  # chunks (t,) int64: the token that followed each position


@dataclass(slots=True)
class RecorderState:
    rows: list[RowFeatures]  # one per batch row, in batch order


class FeatureRecorder:
    """A proposer that drafts nothing and records the target's states of every position it is fed
    (the engine's protocol, draft/base.py: `start` after the prefill, `catch_up` after each step).
    `started` receives each prefill group's new rows, in the group's order, so the caller can
    match them to its requests; a row's record is complete once its answer has finished."""

    def __init__(
        self,
        model: Transformer,
        capture: Sequence[int],
        started: Callable[[list[RowFeatures]], None],
    ) -> None:
        self.capture = (*capture, model.cfg.num_layers)  # the last: the final state, pre-norm
        self.model = model
        self.started = started

    def start(
        self,
        prompt_ids: torch.Tensor,  # (B, T) right-padded prompts
        roots: torch.Tensor,  # (B,) the first answer tokens
        aux: Sequence[torch.Tensor],  # each (B, T, Ct)
        counts: Sequence[int],  # prompt length per row
        capacity: int,
    ) -> RecorderState:
        states, final = split_states(self.model, aux)
        rows = []
        for b, n in enumerate(counts):
            # the prompt's own next tokens stand for its top-1 (never trained on), then the root
            chosen = torch.cat([prompt_ids[b, 1:n], roots[b : b + 1]])
            rows.append(RowFeatures([states[b, :n].clone()], [final[b, :n].clone()], [chosen]))
        self.started(rows)
        return RecorderState(rows)

    def propose(self, state: RecorderState, k: int) -> torch.Tensor:
        raise ValueError("FeatureRecorder proposes no tokens; run rounds with num_draft=0")

    def catch_up(
        self,
        state: RecorderState,
        tokens: torch.Tensor,  # (B, A) accepted tokens then the next root: what followed
        aux: Sequence[torch.Tensor],  # states of the previous root + accepted, each (B, A, Ct)
        counts: Sequence[int],
    ) -> RecorderState:
        states, final = split_states(self.model, aux)
        for b, (row, n) in enumerate(zip(state.rows, counts, strict=True)):
            row.aux.append(states[b, :n])
            row.final.append(final[b, :n])
            row.chosen.append(tokens[b, :n])
        return state

    def select_rows(self, state: RecorderState, rows: Sequence[int]) -> RecorderState:
        return RecorderState([state.rows[r] for r in rows])

    def concat(self, states: Sequence[RecorderState]) -> RecorderState:
        return RecorderState([row for s in states for row in s.rows])
