"""Log-probabilities of generated tokens (logprobs.py): the target's own distribution for each
chosen token and its top alternatives, the same from plain and speculative decoding (chains,
trees, rows that ask and rows that do not), and equal to a teacher-forced forward over the
output."""

from __future__ import annotations

import pytest
import torch

from eaglespec.config import SamplingParams, TreeConfig
from eaglespec.draft.loader import random_eagle3
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.engine import generate_speculative
from eaglespec.errors import InvalidRequestError
from eaglespec.generate import generate_stream
from eaglespec.logprobs import token_logprobs
from eaglespec.model.llama import Transformer
from eaglespec.requests import RequestOutput, StreamEvent, collect_outputs
from helpers import NullTokenizer, tiny_target
from oracle import OracleProposer

V = 96
PROMPTS = [[5, 17, 33, 2, 8], [9, 1, 4], [70, 71, 72, 73]]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_target(0, vocab=V, layers=3)


def _params(logprobs: list[int | None], temperature: float = 0.0) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=12, ignore_eos=True, logprobs=n, temperature=temperature, seed=i)
        for i, n in enumerate(logprobs)
    ]


def _teacher_forced(target: Transformer, prompt: list[int], out: list[int]) -> torch.Tensor:
    """(len(out), V) log-probabilities of the positions that predicted each output token."""
    ids = torch.tensor([prompt + out])
    cache = target.new_cache(1, ids.shape[1])
    logits = target(ids, torch.arange(ids.shape[1])[None], cache).logits[0]  # (T, V)
    return torch.log_softmax(logits.float(), -1)[len(prompt) - 1 : -1]


def test_token_logprobs_math() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 10, generator=gen)
    tokens = torch.tensor([[1, 2, 3], [9, 0, 4]])
    t = token_logprobs(logits, tokens, 4)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(t.chosen, ref.gather(-1, tokens[..., None]).squeeze(-1))
    assert t.top_ids.shape == (2, 3, 4) and torch.all(
        t.top_logprobs[..., :-1] >= t.top_logprobs[..., 1:]
    )
    torch.testing.assert_close(t.top_logprobs, ref.gather(-1, t.top_ids))
    assert token_logprobs(logits, tokens, 0).top_ids.shape == (2, 3, 0)


def test_params_bound_logprobs() -> None:
    with pytest.raises(InvalidRequestError, match="logprobs must be between 0 and 20"):
        SamplingParams(logprobs=21)


def _check_against_forward(target: Transformer, outs: list[RequestOutput], tops: list) -> None:
    for prompt, out, k in zip(PROMPTS, outs, tops, strict=True):
        if k is None:
            assert out.logprobs is None
            continue
        assert out.logprobs is not None and [lp.token_id for lp in out.logprobs] == out.token_ids
        ref = _teacher_forced(target, prompt, out.token_ids)
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        want = ref.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for lp, row in zip(out.logprobs, ref, strict=True):
            assert len(lp.top) == k
            ids = [i for i, _ in lp.top]
            torch.testing.assert_close(
                torch.tensor([v for _, v in lp.top]), row[ids], atol=1e-4, rtol=1e-4
            )
            assert ids == row.topk(k).indices.tolist() or k == 0


def _events_match_outputs(events: list[StreamEvent], outs: list[RequestOutput]) -> None:
    for out in outs:
        mine = [lp for e in events if e.index == out.index for lp in (e.logprobs or [])]
        assert mine == (out.logprobs or [])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_plain_decoding_reports_the_models_distribution(target: Transformer, temperature) -> None:
    tops = [3, None, 0]
    events = list(generate_stream(target, NullTokenizer(), PROMPTS, _params(tops, temperature)))
    outs = collect_outputs(iter(events))
    _check_against_forward(target, outs, tops)
    _events_match_outputs(events, outs)
    if temperature == 0:  # greedy: the chosen token is the most likely one
        assert all(lp.top[0][0] == lp.token_id for lp in outs[0].logprobs or [])


@pytest.mark.parametrize("draft", ["oracle", "random-head", "tree"])
def test_speculative_logprobs_equal_plain_decodings(target: Transformer, draft: str) -> None:
    tops = [2, 5, None]
    params = _params(tops)
    plain = collect_outputs(generate_stream(target, NullTokenizer(), PROMPTS, params))
    seqs = [p + o.token_ids + [0] * 8 for p, o in zip(PROMPTS, plain, strict=True)]
    tree = None
    if draft == "oracle":
        proposer = OracleProposer(seqs, V, wrong_every=3)  # multi-token rounds, some rejections
    elif draft == "tree":
        # The oracle's ladder: a wrong sibling before each right token, so accepted paths skip
        # nodes and each token's logprobs come from a node that is not its depth's first.
        proposer = OracleProposer(seqs, V)
        tree = TreeConfig(depth=3, top_k=2, num_nodes=7)
    else:  # rejects every draft: each token is a round's root
        proposer = Eagle3Proposer(random_eagle3(target, seed=1), (1, 2, 3))
    events = list(
        generate_speculative(
            target, proposer, NullTokenizer(), PROMPTS, params, num_draft=3, tree=tree
        )
    )
    spec = collect_outputs(iter(events))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    _events_match_outputs(events, spec)
    for s, p in zip(spec, plain, strict=True):
        if p.logprobs is None:
            assert s.logprobs is None
            continue
        assert s.logprobs is not None
        torch.testing.assert_close(
            torch.tensor([lp.logprob for lp in s.logprobs]),
            torch.tensor([lp.logprob for lp in p.logprobs]),
            atol=1e-4,
            rtol=1e-4,
        )
        assert [[i for i, _ in lp.top] for lp in s.logprobs] == [
            [i for i, _ in lp.top] for lp in p.logprobs
        ]
    if draft != "random-head":  # rounds of several tokens
        assert max(o.stats.mean_accept_length for o in spec) > (2.5 if draft == "tree" else 1.5)
