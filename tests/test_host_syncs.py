"""Speculative decoding syncs with the host once per round (plus once for the prefill's first
token): every Python-level read of a tensor value is counted while the engine runs."""

from __future__ import annotations

import pytest
import torch

from eaglespec.config import SamplingParams, TreeConfig
from eaglespec.draft.loader import random_eagle3
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.engine import generate_speculative
from eaglespec.model.llama import Transformer
from eaglespec.requests import collect_outputs
from helpers import NullTokenizer, tiny_target

SYNCING = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_target(
        0, vocab=64, layers=5, hidden=32, max_position=128, tied=True, wide_init=False
    )


def _count_syncs(monkeypatch: pytest.MonkeyPatch, count: dict[str, int]) -> None:
    """Every Python-level read of a tensor value adds one to count["n"] (until undone)."""
    for name in SYNCING:
        original = getattr(torch.Tensor, name)

        def counting(self, *a, __original=original, **k):  # type: ignore[no-untyped-def]
            count["n"] += 1
            return __original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counting)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("tree", [None, TreeConfig(depth=3, top_k=3, num_nodes=8)])
def test_one_sync_per_round(target, monkeypatch, sampled: bool, tree: TreeConfig | None) -> None:
    proposer = Eagle3Proposer(random_eagle3(target, seed=0), (1, 2, 3))
    temp = 0.8 if sampled else 0.0
    params = [
        SamplingParams(max_tokens=9, temperature=temp, seed=s, ignore_eos=True) for s in (1, 2)
    ]
    count = {"n": 0}
    _count_syncs(monkeypatch, count)
    events = generate_speculative(
        target, proposer, NullTokenizer(), [[1, 2, 3, 4], [5, 6]], params, num_draft=3, tree=tree
    )
    outs = collect_outputs(events)
    monkeypatch.undo()
    rounds = max(o.stats.rounds for o in outs)
    assert count["n"] == rounds + 1, f"{count['n']} host syncs for {rounds} rounds"


def test_a_gated_chain_syncs_once_per_draft_step(target, monkeypatch) -> None:
    """Under min_prob the host decides each chain's length: one sync per draft step inside
    `propose` (at most k a round), and still one per round everywhere else."""
    proposer = Eagle3Proposer(random_eagle3(target, seed=0), (1, 2, 3), min_prob=0.02)
    k = 3
    count = {"n": 0, "propose": 0, "calls": 0, "most": 0}
    _count_syncs(monkeypatch, count)
    propose = Eagle3Proposer.propose

    def counted_propose(self, state, k):  # type: ignore[no-untyped-def]
        before = count["n"]
        drafts = propose(self, state, k)
        count["propose"] += count["n"] - before
        count["calls"] += 1
        count["most"] = max(count["most"], count["n"] - before)
        return drafts

    monkeypatch.setattr(Eagle3Proposer, "propose", counted_propose)
    params = [SamplingParams(max_tokens=12, ignore_eos=True) for _ in (1, 2)]
    events = generate_speculative(
        target, proposer, NullTokenizer(), [[1, 2, 3, 4], [5, 6]], params, num_draft=k
    )
    outs = collect_outputs(events)
    monkeypatch.undo()
    rounds = max(o.stats.rounds for o in outs)
    assert count["calls"] == rounds and 1 <= count["most"] <= k
    assert count["n"] - count["propose"] == rounds + 1
