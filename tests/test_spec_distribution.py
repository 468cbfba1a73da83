"""Sampled speculative decoding reproduces the target's distribution: over thousands of rows, the
second generated token (the first one that goes through draft verification) follows
sum_t1 p(t1) p(t2 | t1), computed exactly from the target. Chi-square at p = 0.001. On the CPU,
and on a CUDA GPU where there is one (marked gpu)."""

from __future__ import annotations

import copy

import pytest
import torch

from eaglespec.config import SamplingParams, TreeConfig
from eaglespec.draft.hybrid import HybridProposer
from eaglespec.draft.loader import random_eagle3
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.engine import generate_speculative
from eaglespec.model.llama import Transformer
from eaglespec.requests import collect_outputs
from helpers import NullTokenizer, tiny_target

V = 12
CHI2_999_DOF11 = 31.26


@pytest.fixture(scope="module")
def target() -> Transformer:
    model = tiny_target(1, vocab=V, layers=4, hidden=32, max_position=64, wide_init=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a peaked but not one-hot distribution
    return model


def _exact_second_token(target: Transformer, prompt: list[int], temperature: float) -> torch.Tensor:
    def probs(seq: list[int]) -> torch.Tensor:
        x = torch.tensor([seq])
        logits = target(x, torch.arange(len(seq))[None], target.new_cache(1, 16)).logits[0, -1]
        return torch.softmax(logits / temperature, -1).double()

    p1 = probs(prompt)
    return sum(p1[t] * probs(prompt + [t]) for t in range(V))


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("lookup", [0, 2], ids=["head", "head+lookup"])
@pytest.mark.parametrize("tree", [None, TreeConfig(depth=2, top_k=3, num_nodes=5)])
def test_second_token_follows_the_target(
    target: Transformer, tree, lookup: int, device: str
) -> None:
    torch.manual_seed(123)  # rows without a seed draw from the global generator
    prompt, n, temperature = [3, 1, 4], 6000, 0.9
    model = target if device == "cpu" else copy.deepcopy(target).to(device)  # fp32: RoPE stays
    proposer = Eagle3Proposer(random_eagle3(model, seed=5), (1, 2, 3))
    if lookup:  # unigram matches: a first token among 3, 1, 4 grafts what followed it
        proposer = HybridProposer(proposer, lookup, min_ngram=1)
    params = [SamplingParams(max_tokens=2, temperature=temperature, ignore_eos=True)] * n
    events = generate_speculative(
        model, proposer, NullTokenizer(), [prompt] * n, params, num_draft=2, tree=tree
    )
    outs = collect_outputs(events)
    second = torch.tensor([o.token_ids[1] for o in outs])
    counts = torch.bincount(second, minlength=V).double()
    expected = n * _exact_second_token(target, prompt, temperature)
    keep = expected > 5  # chi-square needs expected counts of at least ~5
    chi2 = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    assert chi2 < CHI2_999_DOF11, f"chi-square {chi2:.1f}"
    accepted = sum(o.stats.accepted_tokens for o in outs)
    assert 0 < accepted < n  # both the accept and the reject paths ran
