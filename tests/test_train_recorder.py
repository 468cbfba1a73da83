"""Features taken while the target answers (train/recorder.py) are a feature prefill's
(train/features.py) at every position training reads, bit for bit, at the commands' default
precision (bf16 w4a8), whatever else the batch held: answers that stop at an end-of-turn token,
at their length, or at their first token; rows refilled while others ran. The feature stage then
finds them in its folder and computes nothing again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eaglespec.config import SamplingParams
from eaglespec.draft.config import default_capture
from eaglespec.model import w4a8
from eaglespec.model.llama import Transformer
from eaglespec.model.quant import quantize_model
from eaglespec.train.answering import Answer, Job, answer_all
from eaglespec.train.data import Conversation, Sample
from eaglespec.train.features import (
    FeatureShard,
    FeatureSink,
    capture_features,
    load_shard,
    shard_paths,
)
from eaglespec.train.meter import Deadline
from eaglespec.train.regen import RegenConfig, read_samples, regenerate
from helpers import NullTokenizer, tiny_target

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(w4a8.available() is not None, reason=f"w4a8: {w4a8.available()}"),
]

V = 96
PROMPTS = [[5, 17, 33, 2], [9, 1, 4], [70, 71, 72, 73, 74, 75], [3, 3], [11, 12, 13, 11], [8] * 9]
MAX_TOKENS = [14, 3, 21, 1, 12, 6]


@pytest.fixture(scope="module")
def target() -> Transformer:
    model = tiny_target(3, vocab=V, hidden=128, layers=3)
    return quantize_model(model.to(torch.bfloat16), "w4a8")


class _Tokenizer(NullTokenizer):
    """NullTokenizer with one end-of-turn id."""

    def __init__(self, eos: int) -> None:
        self.eos_ids = (eos,)


def _eos_of(target: Transformer) -> int:
    """A token the target's greedy answer to the first prompt reaches after a few tokens: with it
    as end of turn, that answer stops there and the others run to their length."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    first = next(answer_all(target, NullTokenizer(), [Job("probe", PROMPTS[0], params)]))
    return first.output.token_ids[5]


def _sample(a: Answer, eot: int) -> Sample:
    """What regen.py writes for an answer."""
    o = a.output
    resp = o.token_ids + ([eot] if o.finish_reason == "stop" else [])
    return Sample(a.job.key, a.job.prompt, resp, o.finish_reason or "length")


def _by_key(folder: Path) -> dict[str, FeatureShard]:
    return {
        k: s.sample(i) for s in map(load_shard, shard_paths(folder)) for i, k in enumerate(s.keys)
    }


@pytest.mark.parametrize("max_rows", [2, 64])
def test_recorded_features_are_the_prefills(
    target: Transformer, tmp_path: Path, max_rows: int
) -> None:
    eos = _eos_of(target)
    tok = _Tokenizer(eos)
    capture = default_capture(target.cfg.num_layers)
    jobs = [
        Job(f"j{i}", p, SamplingParams(max_tokens=n))
        for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))
    ]
    sink = FeatureSink(tmp_path / "recorded", capture, shard_samples=4)
    samples = []
    for a in answer_all(target, tok, jobs, max_rows=max_rows, budget=80, capture=capture):
        assert a.features is not None
        s = _sample(a, eos)
        samples.append(s)
        sink.add(s, a.features)
    sink.flush()
    finishes = {s.finish for s in samples}
    assert finishes == {"stop", "length"}, finishes  # both ends of an answer are covered
    assert any(len(s.response) == 1 for s in samples)  # one finished by its prefill
    assert sink.samples == len(samples) and len(shard_paths(tmp_path / "recorded")) == 2

    capture_features(target, samples, capture, tmp_path / "prefilled")
    recorded, prefilled = _by_key(tmp_path / "recorded"), _by_key(tmp_path / "prefilled")
    assert recorded.keys() == prefilled.keys() == {s.key for s in samples}
    for s in samples:
        r, p = recorded[s.key], prefilled[s.key]
        n, P = len(s.prompt) + len(s.response), len(s.prompt)
        assert torch.equal(r.ids, p.ids) and torch.equal(r.loss_mask, p.loss_mask)
        # every position but the last, whose token is never fed, bit for bit
        assert torch.equal(r.aux[: n - 1], p.aux[: n - 1]), s.key
        assert torch.equal(r.final[: n - 1], p.final[: n - 1]), s.key
        # the target's top-1 from the prompt's last position on (where the loss reads it)
        assert torch.equal(r.top[P - 1 : n - 1], p.top[P - 1 : n - 1]), s.key
        assert not r.aux[n - 1].any() and not r.final[n - 1].any() and r.top[n - 1] == 0

    # the feature stage finds every sample recorded and adds no shard
    before = shard_paths(tmp_path / "recorded")
    assert capture_features(target, samples, capture, tmp_path / "recorded") == before


class _Turns(NullTokenizer):
    """User turns written as their ids ("5 17 33")."""

    eos_ids = (V - 1,)

    def encode_turns(self, turns, answers):  # type: ignore[no-untyped-def]
        return [int(t) for t in turns[-1].split()]

    def decode(self, ids):  # type: ignore[no-untyped-def]
        return " ".join(map(str, ids))


CONVS = [Conversation((" ".join(map(str, p)),), f"c{i}") for i, p in enumerate(PROMPTS)]


def test_regenerate_writes_the_shards(target: Transformer, tmp_path: Path) -> None:
    """regen.py with a sink: every answer's shard row is written, keyed as its sample."""
    convs = CONVS
    capture = default_capture(target.cfg.num_layers)
    sink = FeatureSink(tmp_path / "features", capture)
    cfg = RegenConfig(max_new_tokens=8)
    summary = regenerate(target, _Turns(), convs, tmp_path / "r.jsonl", cfg, features=sink)
    assert summary.new == len(PROMPTS) and sink.samples == len(PROMPTS)
    assert set(_by_key(tmp_path / "features")) == {f"c{i}#0" for i in range(len(PROMPTS))}
    with pytest.raises(ValueError, match="greedily"):
        regenerate(
            target,
            _Turns(),
            convs,
            tmp_path / "s.jsonl",
            RegenConfig(temperature=0.7),
            features=sink,
        )


class Ticks:
    """A clock that moves one second at each reading: a deadline then passes after a known
    number of checks, whatever the machine's speed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_regenerate_stops_at_its_deadline_and_resumes(target: Transformer, tmp_path: Path) -> None:
    """`--regen-seconds`: answering stops at the first answer that finishes after the deadline
    (one clock reading before answering, one after each answer), keeps what it wrote with its
    features, and a later run answers only the rest."""
    capture = default_capture(target.cfg.num_layers)
    sink = FeatureSink(tmp_path / "features", capture)
    out = tmp_path / "r.jsonl"
    cfg = RegenConfig(max_new_tokens=8)
    # made at reading 1, due at 4.5; read before answering (2) and after answers 1, 2, 3 (3, 4,
    # 5): the third is kept, then the run stops
    late = Deadline.after(3.5, Ticks())
    first = regenerate(target, _Turns(), CONVS, out, cfg, features=sink, deadline=late)
    assert first.new == first.samples == 3 and sink.samples == 3
    assert len(read_samples(out)) == 3 and set(_by_key(tmp_path / "features")) == {
        s.key for s in read_samples(out)
    }
    passed = Deadline(at=0.0, clock=lambda: 1.0)
    assert regenerate(target, _Turns(), CONVS, out, cfg, deadline=passed).new == 0
    rest = regenerate(target, _Turns(), CONVS, out, cfg)
    assert rest.new == len(PROMPTS) - 3 and rest.samples == len(PROMPTS)
    # the stopped run's answers are those a run without a deadline gives
    whole = tmp_path / "whole.jsonl"
    regenerate(target, _Turns(), CONVS, whole, cfg)
    by_key = {s.key: s.response for s in read_samples(whole)}
    assert all(s.response == by_key[s.key] for s in read_samples(out))
