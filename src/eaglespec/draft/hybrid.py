"""EAGLE-3 drafting with prompt lookup grafted in: each round the head drafts its chain or tree,
and where the row's context already holds the text that follows (an n-gram of its last tokens
seen before: a summary quoting its article, code repeating an identifier, a list going on), that
continuation joins the same draft tree and is verified in the same target forward. The head's
drafts and the copied text compete in one round instead of one method per request; the copied
text costs no draft forward, only verification slots, and rounds without a match add nothing.
Where the text that followed the row's last tokens leaves the head's one draft, what followed
them with the draft appended is looked up too, so the two agree and the round stays a chain.

The lookup's tokens are deterministic picks like the head's, so greedy and sampled verification
stay lossless over the grafted tree (verify.py). The head's catch-up is unchanged: it is fed the
accepted path's tokens and target states whichever branch they came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eaglespec.config import TreeConfig
from eaglespec.draft.lookup import LookupState, PromptLookupProposer
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.tree import DraftTree, chain_tree, graft_chain, graft_on_chain


@dataclass
class HybridState:
    head: Any  # the EAGLE-3 proposer's state
    lookup: LookupState


class HybridProposer:
    """An EAGLE-3 head's chains and trees with up to `lookup_tokens` prompt-lookup tokens a round
    (n-gram matches of min_ngram .. max_ngram tokens)."""

    def __init__(
        self, head: Eagle3Proposer, lookup_tokens: int, max_ngram: int = 3, min_ngram: int = 2
    ) -> None:
        if lookup_tokens < 1:
            raise ValueError(f"lookup_tokens must be at least 1, got {lookup_tokens}")
        self.head = head
        self.lookup = PromptLookupProposer(max_ngram=max_ngram, min_ngram=min_ngram)
        self.lookup_tokens = lookup_tokens
        self.graft_tokens = lookup_tokens  # GraftingProposer: the most nodes a graft adds
        self.capture = head.capture

    def start(
        self,
        prompt_ids: torch.Tensor,  # (B, T) right-padded prompts
        roots: torch.Tensor,  # (B,) the target's first sampled tokens
        aux: Sequence[torch.Tensor],  # target states at the head's capture boundaries
        counts: Sequence[int],  # prompt length per row
        capacity: int,
    ) -> HybridState:
        return HybridState(
            self.head.start(prompt_ids, roots, aux, counts, capacity),
            self.lookup.start(prompt_ids, roots, (), counts, capacity),
        )

    def propose(self, state: HybridState, k: int) -> torch.Tensor:
        return self.head.propose(state.head, k)

    def propose_tree(self, state: HybridState, roots: torch.Tensor, shape: TreeConfig) -> DraftTree:
        return self.head.propose_tree(state.head, roots, shape)

    def graft(self, state: HybridState, tree: DraftTree, room: int) -> DraftTree:
        """The tree with each row's lookup continuation grafted in (graft_chain); unchanged when no
        row's context matches or no room is left.

        Over a chain of one draft on the CPU, a row whose suffix has no continuation, or one
        that leaves the head's draft, looks up what follows the draft (the history's suffix
        n-gram with the draft appended); found, that goes on from the draft and the round is a
        chain. On SmolLM2's six sets with the fixed chain of one (BENCHMARKS.md, session 48):
        2.012 -> 2.060 tokens a round, 2.058 from the rounds where lookup had found nothing
        alone; where the continuation left the draft (a tree before, whose first token was
        lookup's in 39% of those rounds and the draft's in 27%) the chain lands about as much
        and is verified without the tree's mask and gather. Over chains of 2 and 3, whose
        drafts must all be accepted first, it measured +0.5% and -0.5% tokens a round and ran
        slower, so longer chains keep the suffix's own continuation."""
        length = min(self.lookup_tokens, room - (tree.num_nodes - 1))
        if length < 1:
            return tree
        dev, D = tree.tokens.device, tree.max_depth
        width = D + length
        rows = state.lookup.rows
        found = [row.find(width) for row in rows]
        drafted = None
        if D and tree.is_chain and dev.type == "cpu":  # the drafts' host copy costs no wait
            drafted = tree.tokens.tolist()  # sync: free on the CPU
            if D == 1:  # a row's continuation that is none, or leaves the draft: after the draft
                for b, (row, (_, draft)) in enumerate(zip(rows, drafted, strict=True)):
                    f = found[b]
                    if f is None or f[0] != draft:
                        after = row.find(length, after=[draft])
                        if after is not None:
                            found[b] = [draft, *after]
        if all(f is None for f in found):
            return tree
        # rows without a match repeat their last token: wasted slots, never a wrong output
        chains = [
            f if f is not None else [row.tokens[-1]] * width
            for f, row in zip(found, rows, strict=True)
        ]
        if drafted is not None:
            # a chain again where every row's continuation goes on from its last draft
            return graft_on_chain(drafted, chains, length, dev)
        chain = torch.tensor(chains, dtype=torch.long, device=dev)  # (B, width)
        if D == 0:  # a zero-draft round's graft hangs from the root: a chain
            return chain_tree(tree.tokens[:, 0], chain)
        return graft_chain(tree, chain, length)

    def catch_up(
        self,
        state: HybridState,
        tokens: torch.Tensor,  # (B, A) accepted draft tokens then the next root, right-padded
        aux: Sequence[torch.Tensor],  # target states of root + accepted nodes, each (B, A, Ct)
        counts: Sequence[int],  # accepted + 1 per row
    ) -> HybridState:
        return HybridState(
            self.head.catch_up(state.head, tokens, aux, counts),
            self.lookup.catch_up(state.lookup, tokens, (), counts),
        )

    def select_rows(self, state: HybridState, rows: Sequence[int]) -> HybridState:
        return HybridState(
            self.head.select_rows(state.head, rows), self.lookup.select_rows(state.lookup, rows)
        )

    def concat(self, states: Sequence[HybridState]) -> HybridState:
        return HybridState(
            self.head.concat([s.head for s in states]),
            self.lookup.concat([s.lookup for s in states]),
        )
