"""Sampling: filters agree with transformers' logits processors; draws follow the distribution."""

from __future__ import annotations

import pytest
import torch

from eaglespec import sampling
from eaglespec.config import SamplingParams
from eaglespec.errors import InvalidRequestError
from eaglespec.sampling import (
    SamplingTensors,
    apply_repetition_penalty,
    greedy_tokens,
    probs_from_logits,
    sample,
)

lp = pytest.importorskip("transformers.generation.logits_process")


def _st(**kw: float) -> SamplingTensors:
    return SamplingTensors.from_params([SamplingParams(**kw)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kw,warpers",
    [
        ({"temperature": 0.7, "top_k": 5}, lambda: [lp.TopKLogitsWarper(5)]),
        ({"temperature": 1.3, "top_p": 0.8}, lambda: [lp.TopPLogitsWarper(0.8)]),
        ({"temperature": 1.0, "min_p": 0.1}, lambda: [lp.MinPLogitsWarper(0.1)]),
        (
            {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.05},
            lambda: [lp.TopKLogitsWarper(20), lp.TopPLogitsWarper(0.9), lp.MinPLogitsWarper(0.05)],
        ),
    ],
)
def test_filters_keep_the_same_tokens_as_transformers(kw, warpers) -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)) * 3
    ours = probs_from_logits(logits, _st(**kw))
    ref = logits / kw["temperature"]
    for w in warpers():
        ref = w(None, ref)
    torch.testing.assert_close(ours, torch.softmax(ref, -1))


def test_repetition_penalty_matches_transformers() -> None:
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(1))
    seen_ids = torch.tensor([[1, 5, 9], [2, 5, 31]])
    seen = torch.zeros(2, 32, dtype=torch.bool).scatter_(1, seen_ids, True)
    ours = apply_repetition_penalty(logits, seen, torch.tensor([1.3, 1.3]))
    ref = lp.RepetitionPenaltyLogitsProcessor(1.3)(seen_ids, logits.clone())
    torch.testing.assert_close(ours, ref)


def test_greedy_rows_are_one_hot_in_a_mixed_batch() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(2))
    st = SamplingTensors.from_params([SamplingParams(), SamplingParams(temperature=1.0)])
    probs = probs_from_logits(logits, st)
    assert probs[0].argmax() == logits[0].argmax() and probs[0].max() == 1.0
    torch.testing.assert_close(probs[1], torch.softmax(logits[1], -1))


def test_draws_follow_the_distribution_and_never_a_zero() -> None:
    """Chi-square goodness of fit of 40k draws against p (fixed seed, 8 categories; zeros
    between them and at both ends are never drawn)."""
    p = torch.tensor([0.0, 0.3, 0.2, 0.15, 0.0, 0.1, 0.1, 0.08, 0.05, 0.02, 0.0])
    n = 40_000
    gen = torch.Generator().manual_seed(3)
    draws = torch.cat(
        [sample(p.expand(1000, 11), [gen] * 1000, greedy=False) for _ in range(n // 1000)]
    )
    counts = torch.bincount(draws, minlength=11).double()
    assert counts[p == 0].sum() == 0
    counts, p = counts[p > 0], p[p > 0]
    chi2 = (((counts - n * p) ** 2) / (n * p)).sum().item()
    assert chi2 < 24.3, f"chi-square {chi2:.1f} above the p=0.001 critical value for 7 dof"


@pytest.mark.parametrize(
    "kw,warpers",
    [
        ({"temperature": 1.0, "top_p": 0.99}, lambda: [lp.TopPLogitsWarper(0.99)]),
        ({"temperature": 0.8, "top_k": 2000}, lambda: [lp.TopKLogitsWarper(2000)]),
        (
            {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
            lambda: [lp.TopKLogitsWarper(50), lp.TopPLogitsWarper(0.9)],
        ),
        ({"temperature": 1.0, "min_p": 0.02}, lambda: [lp.MinPLogitsWarper(0.02)]),
    ],
)
@pytest.mark.parametrize("tiers", [(1024,), (64, 1024), (64, 256, 1024)])
def test_filters_over_a_large_vocabulary_match_transformers(
    kw, warpers, tiers, monkeypatch
) -> None:
    """Past a tier of `CANDIDATES` tokens only a row's best candidates are sorted, unless its
    filters reach past them (flat rows, a top-k above them) and it goes on to the next tier or
    a whole sort: peaked and flat rows in one batch (scales 12 / 5 / 4 / 2.2: a nucleus of 0.99
    ends within 64 / 256 / 1024 / 5000 of them, a min-p floor of 0.02 within 64 / 64 / 64 / 256)."""
    monkeypatch.setattr(sampling, "CANDIDATES", tiers)
    V = 5000
    gen = torch.Generator().manual_seed(5)
    logits = (
        torch.randn(6, V, generator=gen) * torch.tensor([12.0, 5.0, 0.5, 4.0, 0.2, 2.2])[:, None]
    )
    st = SamplingTensors.from_params([SamplingParams(**kw)] * 6)  # type: ignore[arg-type]
    ours = probs_from_logits(logits, st)
    ref = logits / kw["temperature"]
    for w in warpers():
        ref = w(None, ref)
    want = torch.softmax(ref, -1)
    assert torch.equal(ours > 0, want > 0)  # the same tokens kept, row by row
    torch.testing.assert_close(ours, want)


def test_seeded_sampling_repeats_and_rows_are_independent() -> None:
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(4)), -1)

    def run(order: list[int]) -> list[int]:
        gens = [torch.Generator().manual_seed(s) for s in (10, 11, 12)]
        picked = [gens[i] for i in order]
        return sample(probs[order], picked, greedy=False).tolist()

    a = run([0, 1, 2])
    assert a == run([0, 1, 2])
    # The same seeded row draws the same token whatever else is in the batch.
    assert run([2, 0])[1] == a[0]


@pytest.mark.parametrize(
    "kw",
    [{"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"max_tokens": 0}, {"stop": "x"}],
)
def test_invalid_params_are_rejected(kw) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_argmax_first_maximum_included(dtype: torch.dtype) -> None:
    """torch.max's indices stand in for argmax on the greedy path: the same token for every row,
    the first of tied maxima (bf16 logits tie often)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 1000).to(dtype)
    logits[0, 0, [7, 400, 999]] = 50.0  # a three-way tie
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert greedy_tokens(logits)[0, 0] == 7
