"""Speculative decoding on the real default model (SmolLM2-135M-Instruct, fp32): greedy output
equals plain greedy output token for token, with a randomly initialised EAGLE-3 head (drafts almost
always rejected) and with an oracle proposer (drafts almost always accepted)."""

from __future__ import annotations

from typing import Any

import pytest

from eaglespec import LLM, SamplingParams
from eaglespec.draft.loader import random_eagle3
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.engine import generate_speculative
from eaglespec.generate import generate_stream
from eaglespec.methods import DEFAULT_LOOKUP_TOKENS
from eaglespec.registry import pull
from eaglespec.requests import collect_outputs
from oracle import OracleProposer

pytestmark = pytest.mark.real

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a Python function to add two numbers.",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    path = pull("smollm2-135m", progress=False)
    return LLM(str(path), dtype="float32", quant="none", draft="none", progress=False)


@pytest.mark.parametrize("proposer_kind", ["random-head", "oracle"])
def test_greedy_speculative_equals_plain(llm: LLM, proposer_kind: str) -> None:
    prompts = [llm.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=40)] * len(prompts)
    plain = collect_outputs(generate_stream(llm.model, llm.tokenizer, prompts, params))
    if proposer_kind == "random-head":
        head = random_eagle3(llm.model, seed=0)
        L = llm.config.num_layers
        proposer = Eagle3Proposer(head, (2, L // 2, L - 3))
    else:
        seqs = [p + o.token_ids + [0] * 8 for p, o in zip(prompts, plain, strict=True)]
        proposer = OracleProposer(seqs, llm.config.vocab_size)
    spec = collect_outputs(
        generate_speculative(llm.model, proposer, llm.tokenizer, prompts, params, num_draft=4)
    )
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids and b.text == a.text
        assert b.finish_reason == a.finish_reason
    if proposer_kind == "oracle":
        assert all(o.stats.mean_accept_length > 3.0 for o in spec)


def test_shipped_head_is_small_lossless_and_accepts(llm: LLM) -> None:
    """The EAGLE-3 head shipped for SmolLM2 (heads/smollm2-135m): within the 25 MB budget, loads
    against the real target sharing its embedding, decodes exactly as plain greedy decoding, in a
    chain and in a tree, and accepts drafts (a random head stays at ~1.0 tokens per forward)."""
    from eaglespec.config import TreeConfig
    from eaglespec.draft.loader import load_eagle3
    from eaglespec.heads import packaged_head

    folder = packaged_head("smollm2-135m")
    assert folder is not None
    assert sum(f.stat().st_size for f in folder.iterdir()) < 25e6
    loaded = load_eagle3(folder, llm.model)
    assert loaded.report.shared == ("embed_tokens",)
    prompts = [llm.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=48)] * len(prompts)
    plain = collect_outputs(generate_stream(llm.model, llm.tokenizer, prompts, params))
    for tree in (None, TreeConfig(depth=4, top_k=4, num_nodes=16)):
        proposer = Eagle3Proposer(loaded.head, loaded.capture)
        spec = collect_outputs(
            generate_speculative(
                llm.model, proposer, llm.tokenizer, prompts, params, num_draft=4, tree=tree
            )
        )
        for a, b in zip(plain, spec, strict=True):
            assert b.token_ids == a.token_ids
        rounds = sum(o.stats.rounds for o in spec)
        accepted = sum(o.stats.accepted_tokens for o in spec)
        assert (accepted + rounds) / rounds > 1.1  # 1.25 (chain) measured; random ~1.0


@pytest.mark.parametrize("lookup_tokens", [0, DEFAULT_LOOKUP_TOKENS])
def test_auto_precision_is_the_ggufs_own_and_lossless(lookup_tokens: int) -> None:
    """What the commands run by default (`--dtype auto --quant auto`): the Q4_1 file as w4a8 in
    bfloat16 where the kernel runs (else unquantized fp32), and greedy speculation with the
    shipped head, chain and tree, with and without the prompt-lookup tokens the commands graft
    in by default, equal to plain greedy decoding of that same model."""
    from eaglespec.config import TreeConfig
    from eaglespec.heads import packaged_head
    from eaglespec.model import w4a8
    from eaglespec.policy import DraftChoice, FixedDraft

    head = packaged_head("smollm2-135m")
    auto = LLM(
        str(pull("smollm2-135m", progress=False)),
        dtype="auto",
        quant="auto",
        draft=str(head),
        progress=False,
        speculation="off",  # generate() decodes plainly unless given a policy
        lookup_tokens=lookup_tokens,
    )
    p = auto.loaded.precision
    if w4a8.available() is None:
        assert (p.dtype, p.quant) == ("bfloat16", "w4a8") and "Q8_0" in p.reason
    else:
        assert (p.dtype, p.quant) == ("float32", "none")
    assert auto.quant == p.quant and str(auto.model.dtype) == f"torch.{p.dtype}"
    prompts = [auto.encode(q) for q in PROMPTS]
    params = SamplingParams(max_tokens=48)
    plain = [o.token_ids for o in auto.generate(prompts, params)]
    tree = TreeConfig(depth=4, top_k=4, num_nodes=16)
    for choice in (DraftChoice(4, None), DraftChoice(0, tree)):
        spec = auto.generate(prompts, params, policy=FixedDraft(choice))
        assert [o.token_ids for o in spec] == plain
        assert sum(o.stats.accepted_tokens for o in spec) > 0
    # rounds that draft nothing: the plain step (engine._plain_round) wherever lookup grafts
    # nothing, with the head's catch-ups left pending; the same tokens
    from eaglespec import engine

    plain_rounds = [0]
    real = engine._plain_round

    def counted(*args: Any) -> Any:
        plain_rounds[0] += 1
        return real(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "_plain_round", counted)
        spec = auto.generate(prompts, params, policy=FixedDraft(DraftChoice(0)))
    assert [o.token_ids for o in spec] == plain
    rounds = max(o.stats.rounds for o in spec)  # the batch's rounds (each row counts its own)
    assert 0 < plain_rounds[0] <= rounds
    if lookup_tokens == 0:
        assert plain_rounds[0] == rounds
