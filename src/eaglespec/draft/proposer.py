"""EAGLE-3 drafting: keeps the head's cache in step with the target's and grows draft chains.

Dims: B batch rows, T new tokens, A catch-up tokens, k draft tokens, C draft hidden,
Ct target hidden.

Alignment (spec section 1.7): the head's position p takes the pair (token x_{p+1}, feature g_p),
where g_p is the fused target state at position p, and its output at p estimates g_{p+1} and
predicts x_{p+2}. Worked example, prompt x0 x1 x2 (L = 3) and root x3 sampled by the target:

    prefill     positions 0 1 2 take (x1, g0) (x2, g1) (x3, g2); output at 2 -> first draft d1
    propose     position 3 takes (d1, out2) -> d2; position 4 takes (d2, out3) -> d3 ... (scratch)
    verify      the target runs x3 d1 d2 ... and accepts, say, d1 and then samples y
    catch up    positions 3 4 take (d1, g3) (y, g4) from the target's states of x3 and d1;
                output at 4 -> the next round's first draft token

So after every round the head's committed cache has exactly as many entries as the target's, all
computed from target features; the proposal steps run on its own outputs and are discarded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from eaglespec.cache import KVCache
from eaglespec.config import TreeConfig
from eaglespec.draft.eagle3 import DraftOutput, Eagle3Head
from eaglespec.errors import InvalidRequestError
from eaglespec.sampling import greedy_tokens
from eaglespec.tree import DraftTree, build_tree


@dataclass(frozen=True, slots=True)
class PendingCatchUp:
    """One zero-draft round's catch-up, not yet fed to the head."""

    tokens: torch.Tensor  # (B, 1) the round's next root
    aux: list[torch.Tensor]  # the target states of its root, each (B, 1, Ct)


@dataclass
class DraftState:
    cache: KVCache  # the head's KV cache; committed length == the target's minus `pending`
    logits: torch.Tensor  # (B, Vd) fp32 head output at the last committed position
    prenorm: torch.Tensor  # (B, C) its pre-norm state: the feature estimate for the next step
    # Catch-ups of zero-draft rounds (one token per row each), not yet fed to the head: drafting
    # rounds feed them all in one forward, so plain steps do not pay a head step each. One entry
    # a round, joined only when fed (joining them every round cost O(rounds) a round: 5% of a
    # 256-token run of plain rounds on SmolLM2).
    pending: list[PendingCatchUp] = field(default_factory=list)

    def select_rows(self, rows: Sequence[int]) -> DraftState:
        idx = torch.tensor(list(rows), device=self.logits.device)
        return DraftState(
            self.cache.select_rows(rows),
            self.logits[idx],
            self.prenorm[idx],
            [PendingCatchUp(p.tokens[idx], [a[idx] for a in p.aux]) for p in self.pending],
        )

    @staticmethod
    def concat(parts: Sequence[DraftState]) -> DraftState:
        """Parts without pending catch-ups (Eagle3Proposer.concat feeds them first)."""
        assert not any(p.pending for p in parts), "feed pending catch-ups first"
        return DraftState(
            KVCache.concat([p.cache for p in parts]),
            torch.cat([p.logits for p in parts]),
            torch.cat([p.prenorm for p in parts]),
        )


def check_min_prob(min_prob: float) -> float:
    """`min_prob` if a chain can stop at it (a probability in [0, 1)), else an error naming the
    flag that sets it."""
    if not 0.0 <= min_prob < 1.0:
        raise InvalidRequestError(
            f"the draft min prob (--draft-min-prob) must be in [0, 1), got {min_prob}"
        )
    return min_prob


class Eagle3Proposer:
    """Greedy EAGLE-3 chains of up to k tokens. Drafting never samples: the draft picks are
    deterministic, so the verifier treats each draft token as a point mass (q one-hot).

    `min_prob` > 0 stops a chain where the head doubts it: draft j is kept while, for some row,
    the product of the head's own probabilities of picks 1 .. j is at least `min_prob`; a round
    whose first pick falls below it drafts nothing (a plain step). The head's probabilities are
    calibrated (BENCHMARKS.md, "Does the head know when it is right?"), so the verification
    slots go where acceptance is likely. Which tokens are drafted never changes, only how many,
    so the output stays the target's."""

    def __init__(self, head: Eagle3Head, capture: Sequence[int], min_prob: float = 0.0) -> None:
        check_min_prob(min_prob)
        self.head = head
        self.capture = tuple(capture)
        self.min_prob = min_prob

    def start(
        self,
        prompt_ids: torch.Tensor,  # (B, T) right-padded prompts
        roots: torch.Tensor,  # (B,) the target's first sampled tokens
        aux: Sequence[torch.Tensor],  # target states at the capture boundaries, each (B, T, Ct)
        counts: Sequence[int],  # prompt length per row
        capacity: int,
    ) -> DraftState:
        """Prefill the head over the prompt pairs (x_{p+1}, g_p), p = 0 .. L-1. Prompts of
        different lengths go row by row, each onto its own row of the cache, as the target's
        prefill does (engine.Prefill): padded to the longest, the six sets' first two prompts
        each cost the head 4x their own rows (9,228 for 2,258 tokens). Each row is computed as
        it would be alone either way."""
        last = torch.tensor(list(counts), device=prompt_ids.device)[:, None] - 1  # (B, 1)
        shifted = prompt_ids.roll(-1, dims=1).scatter(1, last, roots[:, None])  # x_1 .. x_L
        cache = self.head.new_cache(prompt_ids.shape[0], capacity)
        if len(set(counts)) == 1:
            return self._advance(cache, shifted, aux, counts)
        rows = [
            self._advance(
                cache.row(b), shifted[b : b + 1, :n], [a[b : b + 1, :n] for a in aux], [n]
            )
            for b, n in enumerate(counts)
        ]
        cache.lengths = list(counts)
        logits = torch.cat([r.logits for r in rows])  # (B, Vd)
        return DraftState(cache, logits, torch.cat([r.prenorm for r in rows]))

    def select_rows(self, state: DraftState, rows: Sequence[int]) -> DraftState:
        return state.select_rows(rows)

    def concat(self, states: Sequence[DraftState]) -> DraftState:
        return DraftState.concat([self.flush(s) for s in states])

    def catch_up(
        self,
        state: DraftState,
        tokens: torch.Tensor,  # (B, A) accepted draft tokens then the next root, right-padded
        aux: Sequence[torch.Tensor],  # target states of root + accepted nodes, each (B, A, Ct)
        counts: Sequence[int],  # accepted + 1 per row
    ) -> DraftState:
        """A zero-draft round's catch-up (one token per row) is kept pending until the next
        drafting round needs the head (`flush`); any other is fed at once, after the pending.
        Updates `state` in place and returns it."""
        if tokens.shape[1] == 1 and all(c == 1 for c in counts):
            state.pending.append(PendingCatchUp(tokens, list(aux)))
            return state
        state = self.flush(state)
        return self._advance(state.cache, tokens, aux, counts)

    def flush(self, state: DraftState) -> DraftState:
        """Feed the pending catch-ups (P tokens per row) to the head in one forward; updates
        `state` in place (its cache is advanced in place anyway) and returns it."""
        if not state.pending:
            return state
        tokens = torch.cat([p.tokens for p in state.pending], dim=1)  # (B, P)
        aux = [torch.cat(a, dim=1) for a in zip(*(p.aux for p in state.pending), strict=True)]
        fed = self._advance(state.cache, tokens, aux, [tokens.shape[1]] * tokens.shape[0])
        state.logits, state.prenorm = fed.logits, fed.prenorm
        state.pending = []
        return state

    def _advance(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        aux: Sequence[torch.Tensor],
        counts: Sequence[int],
    ) -> DraftState:
        logits, prenorm = self.head.feed_last(tokens, aux, cache, [c - 1 for c in counts])
        cache.advance(counts)
        return DraftState(cache, logits, prenorm)

    def propose(self, state: DraftState, k: int) -> torch.Tensor:
        """(B, k') target-vocabulary draft tokens, k' <= k (k' < k only under `min_prob`).
        Scratch entries are written past the committed length and forgotten afterwards (the
        cache is truncated back). Pending catch-ups are fed first."""
        self.flush(state)
        committed = list(state.cache.lengths)
        B, dev = len(committed), state.logits.device
        logits, hidden = state.logits, state.prenorm  # (B, Vd), (B, C)
        # (B,) log-probability of each row's chain so far, where chains stop on doubt
        path = torch.zeros(B, device=dev) if self.min_prob > 0 else None
        drafts: list[torch.Tensor] = []
        while len(drafts) < k:
            if drafts:  # one head step on the last draft
                logits, hidden = self.head.step_last(
                    drafts[-1][:, None], hidden[:, None], state.cache
                )
                state.cache.advance([1] * B)
            if path is not None:
                path = path + logits.float().log_softmax(-1).amax(-1)
                sure = path >= math.log(self.min_prob)
                if not bool(sure.any()):  # sync: the host decides the chain's length
                    break
            drafts.append(self.head.to_target(greedy_tokens(logits)))  # (B,)
        state.cache.truncate(committed)
        if not drafts:
            return torch.empty(B, 0, dtype=torch.long, device=dev)
        return torch.stack(drafts, dim=1)

    def propose_tree(self, state: DraftState, roots: torch.Tensor, shape: TreeConfig) -> DraftTree:
        """EAGLE-2 dynamic tree (spec section 3.2): expand the top_k best candidates of each level
        by cumulative draft log-probability, then keep the num_nodes best candidates overall.

        Level l's nodes (level 1 = children of the root) are fed at position committed + l - 1,
        each with its parent's pre-norm output; they see the committed prefix, their ancestors
        among the earlier levels' scratch entries and themselves."""
        self.flush(state)
        B, K = roots.shape[0], shape.top_k
        dev = roots.device
        committed = list(state.cache.lengths)
        score, idx = torch.log_softmax(state.logits, -1).topk(K, -1)  # (B, K) level 1
        scores, tokens = [score], [self.head.to_target(idx)]
        parents = [torch.full((B, K), -1, device=dev)]  # global candidate ids; -1 = the root
        fed = torch.arange(K, device=dev).expand(B, K)  # global ids of the nodes fed next
        fed_tokens = tokens[0]  # (B, K)
        # (B, K, C), copied: an expanded view's zero stride would give the compiled head a graph
        # of its own, apart from the catch-ups' (same T, contiguous)
        hidden = state.prenorm[:, None].expand(B, K, -1).contiguous()
        ancestors = torch.zeros(B, K, 0, dtype=torch.bool, device=dev)
        eye = torch.eye(K, dtype=torch.bool, device=dev).expand(B, K, K)
        start = torch.tensor(committed, device=dev)[:, None]  # (B, 1)
        for level in range(1, shape.depth):
            mask = torch.cat([ancestors, eye], -1)  # (B, K, level * K)
            out: DraftOutput = self.head(
                fed_tokens,
                hidden,
                (start + level - 1).expand(B, K),
                state.cache,
                attn_mask=mask,
            )
            state.cache.advance([K] * B)
            child, child_idx = torch.log_softmax(out.logits, -1).topk(K, -1)  # (B, K, K)
            cum = (score[:, :, None] + child).flatten(1)  # (B, K*K) cumulative path log-prob
            scores.append(cum)
            tokens.append(self.head.to_target(child_idx).flatten(1))
            parents.append(fed[:, :, None].expand(B, K, K).flatten(1))
            score, best = cum.topk(K, -1)  # (B, K) expanded next
            slot = best // K  # which fed node each comes from
            fed = (K + (level - 1) * K * K) + best
            fed_tokens = tokens[-1].gather(1, best)
            hidden = out.prenorm.gather(1, slot[..., None].expand(-1, -1, out.prenorm.shape[-1]))
            picked = ancestors.gather(1, slot[..., None].expand(-1, -1, ancestors.shape[-1]))
            ancestors = torch.cat([picked, torch.nn.functional.one_hot(slot, K).bool()], -1)
        state.cache.truncate(committed)
        return _rerank(roots, scores, tokens, parents, shape)


def _rerank(
    roots: torch.Tensor,
    scores: list[torch.Tensor],
    tokens: list[torch.Tensor],
    parents: list[torch.Tensor],
    shape: TreeConfig,
) -> DraftTree:
    """Keep the num_nodes best candidates of all levels (sorted by global id, which is
    topological) and map parent ids to node indices. Deeper levels get a 1e-6 handicap per level
    so that a parent always outranks its children, even on exact ties."""
    handicap = torch.cat([torch.full_like(s, 1e-6 * level) for level, s in enumerate(scores)], 1)
    all_scores = torch.cat(scores, 1) - handicap  # (B, M)
    keep = all_scores.topk(shape.num_nodes, -1).indices.sort(-1).values  # (B, n)
    node_tokens = torch.cat(tokens, 1).gather(1, keep)
    parent_ids = torch.cat(parents, 1).gather(1, keep)
    # global id -> node index (1 + rank among the kept); root children keep parent 0.
    parent_nodes = torch.searchsorted(keep, parent_ids.clamp(min=0)) + 1
    parent_nodes = torch.where(parent_ids < 0, 0, parent_nodes)
    B = roots.shape[0]
    all_tokens = torch.cat([roots[:, None], node_tokens], 1)  # (B, n + 1)
    all_parents = torch.cat([torch.full((B, 1), -1, device=roots.device), parent_nodes], 1)
    return build_tree(all_tokens, all_parents, max_depth=shape.depth, max_children=shape.top_k)
