"""Continuous batching on the engine (`BatchRunner`): sequences join a running batch between
rounds and leave when finished or cancelled, and every row's greedy output stays exactly its solo
plain greedy output (fp32), whatever joined or left around it and whatever the draft length of
each round. A copy of the target as draft model must still accept every draft token after joins:
the concatenated draft caches stay aligned with the target's."""

from __future__ import annotations

import copy

import pytest
import torch

from eaglespec.cache import KVCache
from eaglespec.config import SamplingParams, TreeConfig
from eaglespec.draft.base import NoDraft, Proposer
from eaglespec.draft.draft_model import DraftModelProposer
from eaglespec.draft.hybrid import HybridProposer
from eaglespec.draft.loader import random_eagle3
from eaglespec.draft.lookup import PromptLookupProposer
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.engine import BatchRunner
from eaglespec.generate import generate_stream
from eaglespec.model.llama import Transformer
from eaglespec.requests import RequestOutput, StreamEvent, collect_outputs
from helpers import NullTokenizer, tiny_target

V = 96
PROMPTS = [
    [5, 17, 33, 2, 8, 5, 17],
    [9, 1, 4],
    [70, 71, 72, 73, 74, 75, 76, 77, 78],
    [3, 3, 3, 3, 3],
    [11, 12, 13, 11, 12],
]
MAX_TOKENS = [14, 9, 21, 1, 12]
JOIN_AT = [0, 0, 2, 3, 5]  # the round before which each request arrives


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_target(0, vocab=V)


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def _solo(target: Transformer) -> list[RequestOutput]:
    return [
        collect_outputs(generate_stream(target, NullTokenizer(), [p], [sp]))[0]
        for p, sp in zip(PROMPTS, _params(), strict=True)
    ]


def _staggered(
    target: Transformer,
    proposer: Proposer,
    draft_lengths: list[int],
    tree: TreeConfig | None = None,
    cancel: dict[int, int] | None = None,
    chunk: int | None = None,
) -> tuple[dict[int, list[int]], list[RequestOutput]]:
    """Run PROMPTS arriving at JOIN_AT; round r drafts draft_lengths[r % len]. `cancel` maps a
    request to the round before which it is dropped. With `chunk`, newcomers prefill `chunk`
    prompt tokens per round, the running batch's rounds in between (as the server does), and
    later arrivals wait for the group ahead. Returns streamed ids per request and the outputs."""
    runner = BatchRunner(target, proposer, NullTokenizer(), max_draft=max(draft_lengths))
    params = _params()
    streamed: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    events: list[StreamEvent] = []
    waiting = list(range(len(PROMPTS)))
    prefill = None
    r = 0
    while waiting or runner.seqs or prefill is not None:
        for i, at in (cancel or {}).items():
            if at == r:
                runner.drop([i])
        new = [i for i in waiting if JOIN_AT[i] <= r]
        if new and prefill is None:
            waiting = [i for i in waiting if i not in new]
            prompts, ps = [PROMPTS[i] for i in new], [params[i] for i in new]
            if chunk is None:
                events += runner.join(prompts, ps, new)
            else:
                prefill = runner.begin_join(prompts, ps, new, chunk=chunk)
        if prefill is not None and prefill.step():
            events += runner.complete_join(prefill)
            prefill = None
        if runner.seqs:
            events += runner.round(draft_lengths[r % len(draft_lengths)], tree).events
        r += 1
    for e in events:
        streamed[e.index] += e.token_ids
    return streamed, collect_outputs(events)


def _check(
    target: Transformer, proposer: Proposer, lengths: list[int], tree=None, chunk=None
) -> None:
    solo = _solo(target)
    streamed, outs = _staggered(target, proposer, lengths, tree, chunk=chunk)
    assert [o.index for o in outs] == list(range(len(PROMPTS)))
    for s, o in zip(solo, outs, strict=True):
        assert o.token_ids == s.token_ids, o.index
        assert streamed[o.index] == s.token_ids  # nothing lost or duplicated in the stream
        assert o.finish_reason == "length"


def test_no_draft_joins_equal_plain(target: Transformer) -> None:
    _check(target, NoDraft(), [0])


@pytest.mark.parametrize("lengths", [[3], [0, 2, 4, 1]])
def test_draft_model_joins_equal_plain(target: Transformer, lengths: list[int]) -> None:
    draft = tiny_target(7, vocab=V, layers=2, hidden=32, kv_heads=1)
    _check(target, DraftModelProposer(draft, target_vocab_size=V), lengths)


def test_lookup_joins_equal_plain(target: Transformer) -> None:
    _check(target, PromptLookupProposer(), [4, 0, 2])


@pytest.mark.parametrize("tree", [None, TreeConfig(depth=3, top_k=2, num_nodes=5)])
def test_eagle3_joins_equal_plain(target: Transformer, tree: TreeConfig | None) -> None:
    head = random_eagle3(target, seed=0, capture=(1, 3, 5))
    _check(target, Eagle3Proposer(head, (1, 3, 5)), [3, 0, 1], tree)


@pytest.mark.parametrize("tree", [None, TreeConfig(depth=3, top_k=2, num_nodes=5)])
def test_eagle3_with_lookup_joins_equal_plain(target: Transformer, tree: TreeConfig | None) -> None:
    head = Eagle3Proposer(random_eagle3(target, seed=1), (1, 3, 5))
    _check(target, HybridProposer(head, 3, min_ngram=1), [3, 0, 1], tree)


@pytest.mark.parametrize("chunk", [1, 2, 4])
def test_chunked_prefill_joins_equal_plain(target: Transformer, chunk: int) -> None:
    """Newcomers prefilled a few prompt tokens per round, rounds of the running batch in
    between: EAGLE-3 chains and trees (the head starts from states gathered over the chunks)
    and a draft model."""
    head = random_eagle3(target, seed=0, capture=(1, 3, 5))
    tree = TreeConfig(depth=3, top_k=2, num_nodes=5) if chunk == 2 else None
    _check(target, Eagle3Proposer(head, (1, 3, 5)), [3, 0, 1], tree, chunk=chunk)
    draft = tiny_target(7, vocab=V, layers=2, hidden=32, kv_heads=1)
    _check(target, DraftModelProposer(draft, target_vocab_size=V), [2], chunk=chunk)


def test_copy_draft_accepts_everything_after_joins(target: Transformer) -> None:
    proposer = DraftModelProposer(copy.deepcopy(target), target_vocab_size=V)
    _, outs = _staggered(target, proposer, [3])
    for o, n in zip(outs, MAX_TOKENS, strict=True):
        s = o.stats
        # Every round drafts 3 and accepts all 3 (whatever joined or left around it); what the
        # last round accepted past max_tokens is cut, so each row ends in the fewest rounds: the
        # prefill's token, then 4 a round. (The 1-token request ends at its prefill.)
        assert s.draft_tokens == 3 * s.rounds and s.accepted_tokens == s.draft_tokens
        assert s.rounds == -(-(n - 1) // 4)


def test_cancelled_row_leaves_and_others_are_unchanged(target: Transformer) -> None:
    solo = _solo(target)
    draft = tiny_target(7, vocab=V, layers=2, hidden=32, kv_heads=1)
    proposer = DraftModelProposer(draft, target_vocab_size=V)
    streamed, outs = _staggered(target, proposer, [2], cancel={2: 4})
    assert 2 not in [o.index for o in outs]  # dropped before it finished
    assert 0 < len(streamed[2]) < MAX_TOKENS[2]
    assert streamed[2] == solo[2].token_ids[: len(streamed[2])]
    for o in outs:
        assert o.token_ids == solo[o.index].token_ids


def test_kv_concat_copies_committed_slots_and_zeros_the_rest() -> None:
    def cache(batch: int, capacity: int, lengths: list[int], fill: float) -> KVCache:
        c = KVCache.allocate(
            num_layers=2, batch=batch, num_kv_heads=1, capacity=capacity, head_dim=2,
            dtype=torch.float32,
        )  # fmt: skip
        c.k.fill_(fill)
        c.v.fill_(-fill)
        c.lengths = lengths
        return c

    merged = KVCache.concat([cache(2, 6, [3, 1], 1.0), cache(1, 9, [5], 2.0)])
    assert merged.k.shape == (2, 3, 1, 9, 2) and merged.lengths == [3, 1, 5]
    assert (merged.k[:, :2, :, :3] == 1).all() and (merged.k[:, :2, :, 3:] == 0).all()
    assert (merged.v[:, 2, :, :5] == -2).all() and (merged.v[:, 2, :, 5:] == 0).all()
    assert len(merged.k_layers) == 2 and merged.k_layers[1].shape == (3, 1, 9, 2)
