"""torch.compile'd decode and verify steps (`Transformer.compile_steps`): the compiled step computes
what the eager one does (fp32, attention spelled out instead of SDPA), keeps the cache protocol
(writes land where the plan says, ragged rows and tree masks included), and speculative decoding
over a compiled target stays lossless against plain decoding of the same compiled target, with
int4 weights too.

Each test compiles a tiny model: inductor's C++ compile costs seconds to minutes the first time
(9 of the default run's 16 minutes on 2 cores), then its on-disk cache answers. So they carry the
`compile` marker, which the default `python -m pytest` leaves out (compiling is opt-in for users
too: `--compile`); `.ci/run` runs them after it with `python -m pytest -m compile`."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from eaglespec.config import SamplingParams
from eaglespec.draft.loader import random_eagle3
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.engine import generate_speculative
from eaglespec.errors import InvalidRequestError
from eaglespec.generate import generate_stream
from eaglespec.model import cpu_attention, cpu_layer, w4a8
from eaglespec.model.llama import Transformer
from eaglespec.model.quant import quantize_model
from eaglespec.policy import DraftChoice, FixedDraft
from eaglespec.requests import collect_outputs
from helpers import (
    RAGGED_KEEP,
    RAGGED_PROMPTS,
    TINY_TREE,
    NullTokenizer,
    ragged_steps,
    step_positions,
    tiny_adaptive_llm,
    tiny_target,
)
from oracle import OracleProposer

pytestmark = pytest.mark.compile

V = 96


@pytest.fixture(scope="module")
def eager() -> Transformer:
    return tiny_target(0, vocab=V)


@pytest.fixture(scope="module")
def kernel_sized() -> Transformer:
    """Head dim 32: one the CPU attention kernel and the fused w4a8 layer take (16 is not)."""
    model = tiny_target(0, vocab=V, hidden=128)
    assert model.cfg.head_dim in cpu_attention.HEAD_DIMS
    return model


def _compiled(model: Transformer, mode: str) -> Transformer:
    twin = copy.deepcopy(model)
    twin.compile_steps(mode)
    return twin


@pytest.mark.parametrize("mode", ["block", "full"])
def test_compiled_steps_compute_the_eager_steps(eager: Transformer, mode: str) -> None:
    comp = _compiled(eager, mode)
    caches = [m.new_cache(2, 32) for m in (eager, comp)]
    for m, c in zip((eager, comp), caches, strict=True):
        m(RAGGED_PROMPTS, torch.arange(6).expand(2, 6), c)  # prefill: eager in both (prefix-free)
        c.advance(RAGGED_KEEP)  # ragged: row 1 keeps 3 entries
    # Steps of 1 token, then a 3-token tree (root, two siblings), on ragged rows.
    for ids, mask, keep in ragged_steps():
        outs = []
        for m, c in zip((eager, comp), caches, strict=True):
            pos = step_positions(c.lengths, mask, ids.shape[1])
            outs.append(m(ids, pos, c, attn_mask=mask, capture=(0, 2)))
            c.advance(keep)
        torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
        for a, b in zip(outs[0].hidden, outs[1].hidden, strict=True):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    # The compiled steps wrote the same entries to the cache.
    torch.testing.assert_close(caches[1].k, caches[0].k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[1].v, caches[0].v, atol=1e-4, rtol=1e-4)


PROMPTS = [[5, 17, 33, 2, 8], [9, 1, 4], [70, 71, 72, 73, 74, 75, 76, 77, 78]]


_W4A8 = pytest.mark.skipif(
    w4a8.available() is not None, reason=f"w4a8 kernel unavailable: {w4a8.available()}"
)


@pytest.mark.parametrize(
    ("quant", "compile"),
    [(q, c) for q in ("none", "int8", "int4") for c in ("none", "block")]
    + [("int4", "full")]
    + [pytest.param("w4a8", c, marks=_W4A8) for c in ("none", "block", "full")],
)
def test_speculation_over_a_quantized_or_compiled_target_is_lossless(
    eager: Transformer, kernel_sized: Transformer, quant: str, compile: str
) -> None:
    """Greedy identity with respect to the same target, for each quantization, eager and
    compiled: the quantized kernels compute each row alone (tests/test_quant.py,
    tests/test_w4a8.py), so verifying k tokens in one forward gives the tokens k single steps
    give. w4a8 runs in bf16, its intended dtype: its int8 activation codes turn a last-bit
    difference into a whole quantization step, and in fp32 the attention over k tokens differs
    from k one-token steps in the last bits (measured on this model: logits 0.2-0.6 apart after
    such a flip); in bf16 every step here is bitwise the same (and the bf16 test below)."""
    if quant == "w4a8":  # at a head dim the attention kernel and the fused layer take
        target = quantize_model(copy.deepcopy(kernel_sized).to(torch.bfloat16), quant)
        assert all(cpu_layer.block_args(block) is not None for block in target.layers)
    else:
        target = quantize_model(copy.deepcopy(eager), quant)
    target.compile_steps(compile)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (14, 9, 20)]
    plain = collect_outputs(generate_stream(target, NullTokenizer(), PROMPTS, params))
    seqs = [p + o.token_ids + [0] * 8 for p, o in zip(PROMPTS, plain, strict=True)]
    drafts = {
        "oracle-noisy": OracleProposer(seqs, V, wrong_every=3),
        "random-head": Eagle3Proposer(random_eagle3(target, seed=1), (1, 3, 4)),
    }
    for proposer in drafts.values():
        spec = collect_outputs(
            generate_speculative(target, proposer, NullTokenizer(), PROMPTS, params, num_draft=3)
        )
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_unknown_compile_mode_names_the_supported_ones(eager: Transformer) -> None:
    with pytest.raises(InvalidRequestError, match="'fast'.*none, block, full"):
        copy.deepcopy(eager).compile_steps("fast")


@pytest.mark.parametrize("mode", ["block", "full"])
def test_compiled_head_steps_compute_the_eager_head(eager: Transformer, mode: str) -> None:
    """An EAGLE-3 head's compiled steps (`Eagle3Head.compile_steps`): after an eager prefill
    over the prompt, single-token draft steps and a multi-token catch-up that projects one
    column per row (`logit_index`, ragged rows) give the eager head's logits and states."""
    head = random_eagle3(eager, draft_vocab_size=48, seed=2)
    comp = copy.deepcopy(head)
    comp.compile_steps(mode)
    gen = torch.Generator().manual_seed(0)
    C = head.cfg.hidden_size
    ids = torch.tensor([[5, 17, 33, 2, 8], [9, 1, 4, 6, 0]])
    hidden = torch.randn(2, 5, C, generator=gen)
    caches = [h.new_cache(2, 24) for h in (head, comp)]
    outs = [
        h(ids, hidden, torch.arange(5).expand(2, 5), c)
        for h, c in zip((head, comp), caches, strict=True)
    ]
    for c in caches:
        c.advance([5, 4])
    for step in range(3):
        torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(outs[1].prenorm, outs[0].prenorm, atol=1e-4, rtol=1e-4)
        pos = torch.tensor(caches[0].lengths)[:, None]
        if step == 1:  # a catch-up of 3 and 2 tokens, logits at each row's last
            nxt, state = torch.tensor([[3, 4, 5], [7, 8, 0]]), torch.randn(2, 3, C, generator=gen)
            last = torch.tensor([[2], [1]])
            outs = [
                h(nxt, state, pos + torch.arange(3), c, logit_index=last)
                for h, c in zip((head, comp), caches, strict=True)
            ]
            advance = [3, 2]
        else:
            nxt = torch.tensor([[3 + step], [7 + step]])
            state = [o.prenorm[:, -1:] for o in outs]
            outs = [h(nxt, s, pos, c) for h, s, c in zip((head, comp), state, caches, strict=True)]
            advance = [1, 1]
        for c in caches:
            c.advance(advance)
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[1].prenorm, outs[0].prenorm, atol=1e-4, rtol=1e-4)


def _decode_then_verify(model: Transformer, tokens: list[int]) -> tuple[list, object]:
    """The forwards of len(tokens) one-token steps, and of one causal verification of all of
    them, onto the same 6-token prefix (prefilled eagerly), capturing every boundary state."""
    prompt = torch.tensor([[5, 17, 33, 2, 8, 1]])
    capture = tuple(range(model.cfg.num_layers + 1))

    def prefilled():
        cache = model.new_cache(1, 32)
        model(prompt, torch.arange(6)[None], cache)
        cache.advance([6])
        return cache

    cache = prefilled()
    steps = []
    for j, t in enumerate(tokens):
        steps.append(model(torch.tensor([[t]]), torch.tensor([[6 + j]]), cache, capture=capture))
        cache.advance([1])
    T = len(tokens)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))[None]
    verify = model(torch.tensor([tokens]), torch.arange(6, 6 + T)[None], prefilled(), mask, capture)
    return steps, verify


@pytest.mark.parametrize("mode", ["block", "full"])
def test_compiled_bf16_verification_is_bitwise_the_decode_steps(
    eager: Transformer, mode: str
) -> None:
    """In bf16 the compiled one-token and multi-token graphs fuse differently; with inductor's
    precision-cast emulation (COMPILE_OPTIONS) both round where eager does, so a verification
    forward gives bitwise the logits and states of the decode steps it replaces. Without it the
    whole-body graph's states parted from the second layer on (SmolLM2, w4a8), which let greedy
    speculation over that target drift from plain greedy decoding."""
    model = _compiled(eager, mode).to(torch.bfloat16)
    steps, verify = _decode_then_verify(model, [7, 3, 11, 40])
    for j, step in enumerate(steps):
        assert torch.equal(step.logits[0, 0], verify.logits[0, j]), f"logits of token {j}"
        for b, (h1, hT) in enumerate(zip(step.hidden, verify.hidden, strict=True)):
            assert torch.equal(h1[0, 0], hT[0, j]), f"token {j}, boundary {b}"


def test_one_graph_serves_every_multi_token_step(eager: Transformer) -> None:
    """After one one-token step and one 2-token verification, 3- and 4-token verifications
    reuse the compiled graphs. With dynamo's duck sizing the 2-token graph assumed T == the 2
    KV heads of this model and every other T compiled anew, mid-generation."""
    comp = _compiled(eager, "full")
    cache = comp.new_cache(1, 32)
    comp(torch.tensor([[5, 17, 33]]), torch.arange(3)[None], cache)
    cache.advance([3])
    for T in (1, 2):  # the graphs: one-token steps, multi-token verification
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))[None] if T > 1 else None
        comp(torch.arange(T)[None] + 7, 3 + torch.arange(T)[None], cache, mask, (0, 2))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T in (3, 4, 2):
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool))[None]
            comp(torch.arange(T)[None] + 7, 3 + torch.arange(T)[None], cache, mask, (0, 2))


def test_each_compiled_model_keeps_its_own_graphs(eager: Transformer) -> None:
    """Full mode skips dynamo's guards on the module's own parameters and submodules (their
    checks cost more than a tenth of a SmolLM2 decode step), so each model's step gets a code
    object of its own: a dense model and an int8 copy of the same class, compiled and called in
    turn, each compute their own eager steps, never the other's graph."""
    dense = copy.deepcopy(eager)
    int8 = quantize_model(copy.deepcopy(eager), "int8")
    ids, pos = torch.tensor([[5, 17, 33]]), torch.arange(3)[None]
    want = {}
    for name, model in (("dense", dense), ("int8", int8)):
        cache = model.new_cache(1, 16)
        model(ids, pos, cache)  # prefill (eager), then one step
        cache.advance([3])
        want[name] = model(torch.tensor([[7]]), torch.tensor([[3]]), cache).logits
    assert not torch.allclose(want["dense"], want["int8"], atol=1e-6)  # the two really differ
    for model in (dense, int8):
        model.compile_steps("full")
    for _ in range(2):
        for name, model in (("dense", dense), ("int8", int8)):
            cache = model.new_cache(1, 16)
            model(ids, pos, cache)
            cache.advance([3])
            got = model(torch.tensor([[7]]), torch.tensor([[3]]), cache).logits
            torch.testing.assert_close(got, want[name], atol=1e-4, rtol=1e-4)


def test_warm_up_compiles_every_step_shape_the_policy_runs(tiny_hf_folder: Path) -> None:
    """After LLM.warm_up at batch sizes 1 and 2, generations of every arm of the adaptive policy
    (plain steps, one-token steps with capture, chains, the tree) at batch sizes 1-3 compile
    nothing more: a compiled user pays for compiling before the first request, not in it."""
    tree = TINY_TREE
    llm = tiny_adaptive_llm(tiny_hf_folder, compile="full")
    llm.warm_up("Once upon a time", batch_sizes=(1, 2))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = ["Once upon a time", "The cat", "A"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for b in (1, 2, 3):
            llm.generate(prompts[:b], params, policy=None)
            for shape in (DraftChoice(0), DraftChoice(1), DraftChoice(2), DraftChoice(2, tree)):
                llm.generate(prompts[:b], params, policy=FixedDraft(shape))
        llm.speculation = "off"
        llm.generate(prompts, params)
