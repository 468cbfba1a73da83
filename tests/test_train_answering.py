"""Answering for training data (train/answering.py): one continuously refilled batch gives every
job exactly its solo plain greedy answer (fp32), never holds more rows or cache positions than
allowed, and stops decoding when the caller closes it; the stage meter reports what it counted."""

from __future__ import annotations

import pytest
import torch

from eaglespec.config import SamplingParams
from eaglespec.generate import generate_stream
from eaglespec.model.llama import Transformer
from eaglespec.requests import collect_outputs
from eaglespec.train import answering
from eaglespec.train.answering import Job, answer_all
from eaglespec.train.meter import Meter
from helpers import NullTokenizer, tiny_target

V = 96
PROMPTS = [[5, 17, 33, 2], [9, 1, 4], [70, 71, 72, 73, 74, 75], [3, 3], [11, 12, 13, 11], [8] * 9]
MAX_TOKENS = [14, 3, 21, 1, 12, 6]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_target(0, vocab=V)


def _jobs() -> list[Job]:
    return [
        Job(f"j{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))
    ]


class _Watched(answering.BatchRunner):
    """Records the rows and cache positions of every round."""

    rounds: list[tuple[int, int]] = []

    def round(self, num_draft, tree):  # type: ignore[no-untyped-def]
        assert self.batch is not None
        _Watched.rounds.append((len(self.seqs), len(self.seqs) * self.batch.cache.capacity))
        return super().round(num_draft, tree)


@pytest.mark.parametrize("max_rows", [1, 2, 4, 64])
def test_every_job_gets_its_solo_answer(
    target: Transformer, max_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(answering, "BatchRunner", _Watched)
    _Watched.rounds = []
    budget = 100
    got = {
        a.job.key: a.output.token_ids
        for a in answer_all(target, NullTokenizer(), _jobs(), max_rows=max_rows, budget=budget)
    }
    for job in _jobs():
        solo = collect_outputs(generate_stream(target, NullTokenizer(), [job.prompt], [job.params]))
        assert got[job.key] == solo[0].token_ids, job.key
    rows = [r for r, _ in _Watched.rounds]
    assert max(rows) <= max_rows and all(p <= budget for _, p in _Watched.rounds)
    if max_rows == 2:  # refilled while others ran: more than one join kept two rows busy
        assert rows.count(2) > max(MAX_TOKENS) // 2


def test_a_job_longer_than_the_budget_runs_alone(target: Transformer) -> None:
    jobs = _jobs()
    out = list(answer_all(target, NullTokenizer(), jobs, max_rows=8, budget=10))
    assert sorted(a.job.key for a in out) == sorted(j.key for j in jobs)


def test_closing_stops_decoding(target: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(answering, "BatchRunner", _Watched)
    _Watched.rounds = []
    answers = answer_all(target, NullTokenizer(), _jobs(), max_rows=64)
    first = next(answers)
    assert first.job.key == "j3"  # one token: finished by its prefill
    answers.close()
    assert _Watched.rounds == []  # no round ran after the caller stopped


def test_meter_counts_and_rates() -> None:
    now = [0.0]
    lines: list[str] = []
    m = Meter("regen", "turns", lines.append, total=10, every=5.0, clock=lambda: now[0])
    m.add(1, 100)
    assert lines == []  # not yet 5 s
    now[0] = 6.0
    m.add(2, 200)
    assert lines == ["regen: 3/10 turns, 300 tokens, 50 tokens/s"]
    now[0] = 10.0
    assert m.result() == {"turns": 3, "tokens": 300, "seconds": 10.0, "tokens_per_s": 30.0}
    # a resumed run shows what the file already holds; its record is this run's alone
    r = Meter("synth", "prompts", lines.append, total=10, done=4, clock=lambda: now[0])
    r.add(2, 50)
    now[0] = 20.0
    assert r.result()["prompts"] == 2 and lines[-1] == "synth: 6/10 prompts, 50 tokens, 5 tokens/s"


def test_dense_weight_reads_any_linear_layer() -> None:
    from eaglespec.model.quant import Int8Linear, dense_weight

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=False)
    assert dense_weight(lin) is not None and torch.equal(dense_weight(lin), lin.weight)
    q = Int8Linear.from_linear(lin)
    assert torch.equal(dense_weight(q), q.dequantize())
    with pytest.raises(TypeError, match="not a linear layer"):
        dense_weight(torch.nn.ReLU())
