"""What the speculative engine needs from a proposer (EAGLE-3 head, classic draft model, prompt
lookup). The engine owns the target and the verification; a proposer owns its own state.

Round protocol, per batch (B rows, ragged):
    state = start(prompt_ids, roots, aux, counts, capacity)   after the target's prefill
    drafts = propose(state, k)                                (B, k') target-vocabulary tokens,
                                                              k' <= k (a head may stop early)
    state = catch_up(state, tokens, aux, counts)              after verification
    state = select_rows(state, rows)                          when finished rows leave
    state = concat([state, ...])                              when new rows join (serving)
`roots` are the tokens the target just chose (not yet in its cache). In `catch_up`, row b's
`tokens[b, :counts[b]]` are its accepted draft tokens followed by the next root, and `aux` holds the
target's captured states of the previous root and the accepted tokens (same width), for proposers
that read target features (`capture` non-empty).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from eaglespec.config import TreeConfig
from eaglespec.tree import DraftTree


class Proposer(Protocol):
    capture: tuple[int, ...]  # target boundaries whose states the proposer reads; () for none

    def start(
        self,
        prompt_ids: torch.Tensor,  # (B, T) right-padded prompts
        roots: torch.Tensor,  # (B,) the target's first sampled token per row
        aux: Sequence[torch.Tensor],  # target states at `capture`, each (B, T, Ct)
        counts: Sequence[int],  # prompt length per row
        capacity: int,  # cache slots the target holds per row
    ) -> Any: ...

    def propose(self, state: Any, k: int) -> torch.Tensor: ...

    def catch_up(
        self,
        state: Any,
        tokens: torch.Tensor,  # (B, A) accepted draft tokens then the next root, right-padded
        aux: Sequence[torch.Tensor],  # target states of previous root + accepted, each (B, A, Ct)
        counts: Sequence[int],  # accepted + 1 per row
    ) -> Any: ...

    def select_rows(self, state: Any, rows: Sequence[int]) -> Any: ...

    def concat(self, states: Sequence[Any]) -> Any: ...


class NoDraft:
    """Proposes nothing: rounds of zero draft tokens are plain decoding steps. Lets one engine loop
    serve without a draft, the same code path a draft takes when drafting stops paying."""

    capture: tuple[int, ...] = ()

    def start(
        self,
        prompt_ids: torch.Tensor,
        roots: torch.Tensor,
        aux: Sequence[torch.Tensor],
        counts: Sequence[int],
        capacity: int,
    ) -> None:
        return None

    def propose(self, state: None, k: int) -> torch.Tensor:
        raise ValueError("NoDraft proposes no tokens; run rounds with num_draft=0")

    def catch_up(
        self, state: None, tokens: torch.Tensor, aux: Sequence[torch.Tensor], counts: Sequence[int]
    ) -> None:
        return None

    def select_rows(self, state: None, rows: Sequence[int]) -> None:
        return None

    def concat(self, states: Sequence[None]) -> None:
        return None


@runtime_checkable
class TreeProposer(Protocol):
    """A proposer that can also draft EAGLE-2 dynamic trees (the EAGLE-3 head)."""

    def propose_tree(self, state: Any, roots: torch.Tensor, shape: TreeConfig) -> DraftTree: ...


@runtime_checkable
class GraftingProposer(Protocol):
    """A proposer that adds candidates of its own to each round's chain or tree, verified in the
    same forward (the EAGLE-3 head with prompt lookup). `room`: draft tokens the round may verify
    at most; the grafted tree never exceeds it, and adds at most `graft_tokens` nodes."""

    graft_tokens: int

    def graft(self, state: Any, tree: DraftTree, room: int) -> DraftTree: ...
