"""The fused decoder layer of eager CPU w4a8 steps (model/cpu_layer.py, csrc/layer.cpp): bitwise
the Python forward it replaces (logits, captured states, cache entries) through prefill, ragged
one-token steps and a masked tree; speculation over it is lossless; where it steps aside.
Skipped where the kernels cannot run."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import pytest
import torch

from eaglespec.config import ModelConfig, SamplingParams
from eaglespec.draft.loader import random_eagle3
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.engine import generate_speculative
from eaglespec.generate import generate_stream
from eaglespec.model import cpu_layer
from eaglespec.model.layers import rope_cos_sin
from eaglespec.model.llama import Transformer
from eaglespec.model.quant import quantize_model
from eaglespec.requests import collect_outputs
from helpers import (
    RAGGED_KEEP,
    RAGGED_PROMPTS,
    NullTokenizer,
    ragged_steps,
    step_positions,
    tiny_target,
)
from oracle import OracleProposer

pytestmark = pytest.mark.skipif(
    cpu_layer.available() is not None, reason=f"fused layer unavailable: {cpu_layer.available()}"
)
V = 96


# The matrices w4a8-mixed keeps at 8 bits in the tests' mixed models (as a Q4_K_M GGUF keeps some
# of its matrices at 6 or 8: Qwen2.5-Coder-0.5B's are mostly 8-bit), one of each kind.
MIXED_WIDE = {"layers.0.attn.wqkv", "layers.1.mlp.w2", "layers.2.mlp.w13", "layers.2.attn.wo"}


def _target(dtype: torch.dtype, bias: bool = False, mixed: bool = False) -> Transformer:
    """Head dim 32 (the smallest the kernels take), w4a8 (with `mixed`, w4a8-mixed: some
    matrices 8-bit), optionally with biases (Qwen2's q/k/v bias) on every matrix."""
    model = tiny_target(3, vocab=V, hidden=128, layers=3)
    if bias:
        for block in model.layers:
            for lin in (block.attn.wqkv, block.attn.wo, block.mlp.w13, block.mlp.w2):
                lin.bias = torch.nn.Parameter(torch.randn(lin.out_features) * 0.1, False)
    if mixed:
        return quantize_model(model.to(dtype), "w4a8-mixed", MIXED_WIDE)
    return quantize_model(model.to(dtype), "w4a8")


def _run(model: Transformer) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill two ragged rows, two one-token steps, a 3-token tree, one more step: every
    forward's logits and captured states, and the cache at the end."""
    cache = model.new_cache(2, 32)
    outs = [model(RAGGED_PROMPTS, torch.arange(6).expand(2, 6), cache).logits]
    cache.advance(RAGGED_KEEP)
    for ids, mask, keep in ragged_steps():
        pos = step_positions(cache.lengths, mask, ids.shape[1])
        out = model(ids, pos, cache, attn_mask=mask, capture=(1, 3))
        outs += [out.logits, *out.hidden]
        cache.advance(keep)
    return outs, torch.stack([cache.k, cache.v])


def _assert_fused_is_python(model: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    """_run on the model (fused where the op takes it) and on a copy through the Python forward
    (block_args and stack_args patched to refuse every layer): the same logits, states and cache
    bits."""
    fused, fused_cache = _run(model)
    monkeypatch.setattr(cpu_layer, "block_args", lambda *a: None)
    monkeypatch.setattr(cpu_layer, "stack_args", lambda *a: None)
    python, python_cache = _run(copy.deepcopy(model))
    for a, b in zip(fused, python, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fused_cache, python_cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("mixed", [False, True])
def test_the_fused_layer_has_the_python_forwards_bits(
    dtype: torch.dtype, bias: bool, mixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused layers (the whole decoder in one call) against the Python forward, with every
    matrix 4-bit or some 8-bit (w4a8-mixed: the op tells them by their packed size), with and
    without biases."""
    model = _target(dtype, bias, mixed)
    block, x = model.layers[0], torch.zeros(1, 1, 128, dtype=dtype)
    plan = model.new_cache(1, 4).plan(1)
    assert cpu_layer.fits(block, x, model.new_cache(1, 4).k_layers[0], plan)
    assert cpu_layer.stack_args(model).fused
    with torch.inference_mode():
        _assert_fused_is_python(model, monkeypatch)


def _wide_run(model: Transformer) -> list[torch.Tensor]:
    """A 2 x 30-token prefill (60 rows: in one team), two one-token steps and a 3-token chain:
    every forward's logits and captured states, then the caches."""
    cache = model.new_cache(2, 48)
    torch.manual_seed(4)
    ids = torch.randint(0, V, (2, 30))
    outs = [model(ids, torch.arange(30).expand(2, 30), cache, capture=(1, 2)).logits]
    cache.advance([30, 30])
    for t in (1, 1, 3):
        step = torch.randint(0, V, (2, t))
        pos = torch.tensor(cache.lengths)[:, None] + torch.arange(t)
        out = model(step, pos, cache, capture=(1, len(model.layers)))
        outs += [out.logits, *out.hidden]
        cache.advance([t, t])
    return [*outs, cache.k, cache.v]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("bias", "mixed"), [(False, False), (True, False), (False, True)])
def test_the_kernels_called_directly_in_one_team_give_the_ops_bits(
    dtype: torch.dtype, bias: bool, mixed: bool
) -> None:
    """The fused forward's kernels called directly (layer.cpp's native_layer, `use_native`, with
    Qwen2's q/k/v bias where `bias`; all layers in one pass over shared buffers, native_stack,
    `use_native_stack`, or layer by layer) and run in one team of threads (team.h,
    `use_team`: two threads, each matrix's and attention's chunks taken in pieces, the last
    ones by whichever thread is free) against each kernel called as an op in a parallel region
    of its own: the same logits, states and caches, bit for bit. Wide enough (hidden 512, 30
    keys) that the matrices and attention are shared between the threads; four layers, the
    output of the first and of the last captured, so native_stack's two spare buffers take
    layers 2 and 3 by turns. With `mixed`, some matrices 8-bit (w4a8-mixed)."""
    model = tiny_target(8, vocab=V, hidden=512, layers=4).to(dtype)
    wide = MIXED_WIDE if mixed else set()
    model = quantize_model(model, "w4a8-mixed" if mixed else "w4a8", wide)
    if bias:
        for block in model.layers:
            lin = block.attn.wqkv
            lin.bias = torch.nn.Parameter(torch.randn(lin.out_features).to(dtype) * 0.1, False)
    ops = torch.ops.eaglespec_layer
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    runs = {}
    try:
        with torch.inference_mode():
            for team in (False, True):
                for native, stack in ((False, False), (True, False), (True, True)):
                    ops.use_team(team)
                    ops.use_native(native)
                    ops.use_native_stack(stack)
                    before = ops.native_layers()
                    runs[team, native, stack] = _wide_run(model)
                    direct = ops.native_layers() - before  # 4 forwards of 4 layers
                    assert direct == (16 if native else 0), (team, native, stack)
    finally:
        ops.use_team(True)
        ops.use_native(True)
        ops.use_native_stack(True)
        torch.set_num_threads(threads)
    for key, outs in runs.items():
        for a, b in zip(outs, runs[False, False, False], strict=True):
            assert torch.equal(a, b), key


def test_an_error_inside_a_team_leaves_the_next_forward_whole() -> None:
    """A forward that fails inside its team (a cache slot past the end, refused by rope_write on
    the team's first thread) raises the kernel's error, and the next forward runs, with the bits
    of one that never failed."""
    model = _target(torch.bfloat16)
    ops = torch.ops.eaglespec_layer
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            cache = model.new_cache(1, 8)
            model(RAGGED_PROMPTS[:1], torch.arange(6)[None], cache)
            cache.advance([6])
            ids, pos = torch.tensor([[3]]), torch.tensor([[6]])
            want = model(ids, pos, copy.deepcopy(cache)).logits
            x = model.embed(ids)
            stack = cpu_layer.stack_args(model)
            assert stack is not None
            plan = cache.plan(1)
            rope = rope_cos_sin(pos, model.inv_freq, x.dtype)
            with pytest.raises(RuntimeError, match="slot 99 outside the cache"):
                ops.stack(
                    x, stack.layers, *rope, cache.k_layers, cache.v_layers,
                    torch.tensor([[99]]), plan.num_keys, plan.mask, [],
                )  # fmt: skip
            assert torch.equal(model(ids, pos, cache).logits, want)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("op", ["decoder", "stack"])
def test_the_stacked_layers_have_the_per_layer_bits(
    dtype: torch.dtype, bias: bool, op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All layers in one call against one fused op per layer: `decoder` (RoPE, the layers, the
    final norm and the output matrix) or, where that is refused, `stack` (the layers): the same
    logits, captured states and cache bits, and the op really ran."""
    model = _target(dtype, bias)
    if op == "stack":
        monkeypatch.setattr(cpu_layer, "logits_args", lambda *a: None)
    name = "forward_decoder" if op == "decoder" else "forward_stack"
    # the prefill, two steps, the tree, the last step
    _assert_op_is_its_fallback(_run, model, name, "stack_args", 5, monkeypatch)


def _assert_op_is_its_fallback(
    run: Callable[[Transformer], tuple[list[torch.Tensor], torch.Tensor]],
    model: Transformer,
    op: str,
    refuse: str,
    calls: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`run` on the model, cpu_layer's `op` counted, then on a copy with cpu_layer's `refuse`
    patched to refuse it: the op ran `calls` times, and every output and the cache are the same
    bits."""
    counted: list[int] = []
    real = getattr(cpu_layer, op)
    monkeypatch.setattr(cpu_layer, op, lambda *a: counted.append(1) or real(*a))
    with torch.inference_mode():
        taken, taken_cache = run(model)
        assert len(counted) == calls
        monkeypatch.setattr(cpu_layer, refuse, lambda *a: None)
        fallback, fallback_cache = run(copy.deepcopy(model))
    assert len(counted) == calls
    for a, b in zip(taken, fallback, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(taken_cache, fallback_cache)


def test_the_decoder_reads_an_output_matrix_replaced_after_a_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The `decoder` op's output-matrix arguments are kept on the model (cpu_layer.LogitsArgs):
    a dense lm_head put in after a forward is noticed, and the forward then ends in Python."""
    model = _target(torch.bfloat16)
    calls: list[int] = []
    real = cpu_layer.forward_decoder
    monkeypatch.setattr(cpu_layer, "forward_decoder", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        _run(model)
        assert len(calls) == 5
        dense = torch.nn.Linear(128, V, bias=False).to(torch.bfloat16)
        dense.weight.copy_(model.lm_head.dequantize())
        model.lm_head = dense
        _run(model)
    assert len(calls) == 5


def test_the_stack_reads_layers_replaced_after_a_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stack's arguments are kept on the model (cpu_layer.StackArgs): a whole layer
    replaced, a layer the op cannot take, or that layer made takeable again, must be noticed by
    the next forward."""
    model, donor = _target(torch.bfloat16), _target(torch.bfloat16, bias=True)
    with torch.inference_mode():
        _run(model)
        model.layers[1] = donor.layers[1]
        assert cpu_layer.stack_args(model) is not None
        assert cpu_layer.stack_args(model).matrices[1][1] is donor.layers[1].attn.wqkv.bias
        _assert_fused_is_python(model, monkeypatch)
        monkeypatch.undo()
        attn = model.layers[2].attn  # q/k norms of a kind the op does not take
        attn.q_norm, attn.k_norm = torch.nn.Identity(), torch.nn.Identity()  # type: ignore[assignment]
        assert cpu_layer.stack_args(model) is None  # layers 0 and 1 still fused, one by one
        _assert_fused_is_python(model, monkeypatch)
        monkeypatch.undo()
        attn.q_norm = attn.k_norm = None  # the op takes every layer again: stacked again
        assert cpu_layer.stack_args(model) is not None


def test_a_forward_with_nothing_registered_since_trusts_the_kept_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kept arguments' parameters, packed weights and submodules are looked up again only
    after some module registered one (cpu_layer.Checks): a forward with nothing registered
    since looks up the plain attributes and floating buffers alone, one after a registration
    anywhere looks up everything and, finding it current, keeps the arguments."""
    model = _target(torch.bfloat16)
    looked: list[int] = []
    real = cpu_layer._found
    monkeypatch.setattr(cpu_layer, "_found", lambda *c: looked.append(len(c[0])) or real(*c))
    with torch.inference_mode():
        _run(model)  # builds and keeps the arguments
        kept = cpu_layer.stack_args(model)
        assert kept is not None
        every, hooked = len(kept.sources.names), len(kept.sources.hooked[1])
        assert hooked > 3 * every  # what the epoch saves
        looked.clear()
        _run(model)
        assert hooked not in looked and every in looked
        torch.nn.Linear(2, 2)  # registers two parameters: the epoch moves
        looked.clear()
        _run(model)
        assert looked.count(hooked) == 1  # once, then current again
        assert cpu_layer.stack_args(model) is kept


def test_a_floating_buffer_converted_after_a_forward_is_noticed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Module.to and its kin write a converted floating-point buffer straight into `_buffers`,
    past the registration hooks: such buffers (the RoPE frequencies, biases) are looked up every
    forward, so the next forward uses the new one."""
    model = _target(torch.bfloat16)
    with torch.inference_mode():
        _run(model)
        model._buffers["inv_freq"] = model.inv_freq * 1.5  # as Module._apply writes it
        assert cpu_layer.logits_args(model, cpu_layer.stack_args(model)).inv_freq is model.inv_freq
        _assert_fused_is_python(model, monkeypatch)


def _assert_path_is_python(model: Transformer, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """_assert_fused_is_python with the fused forward taken one way: "decoder" (the whole forward
    in one call, the layers' kernels called directly), "layers" (the fused op layer by layer,
    kernels called directly) or "ops" (one call, every kernel called as an op). The decoder calls
    and the count of layers run directly say which way ran."""
    ops = torch.ops.eaglespec_layer
    if path == "layers":
        monkeypatch.setattr(cpu_layer, "stack_args", lambda *a: None)
    decoder = cpu_layer.forward_decoder
    calls: list[int] = []
    monkeypatch.setattr(cpu_layer, "forward_decoder", lambda *a: calls.append(1) or decoder(*a))
    ops.use_native(path != "ops")
    before = ops.native_layers()
    try:
        with torch.inference_mode():
            _assert_fused_is_python(model, monkeypatch)
    finally:
        ops.use_native(True)
    forwards = 1 + len(ragged_steps())  # _run's on the fused model
    assert len(calls) == (0 if path == "layers" else forwards)
    direct = ops.native_layers() - before
    assert direct == (0 if path == "ops" else forwards * len(model.layers))


def _gemma_target(dtype: torch.dtype) -> Transformer:
    """A tiny Gemma 3 (SandwichBlock layers, q/k norms, GELU-tanh, a query scale of its own, a
    window of 4 keys on two of three layers) in w4a8-mixed: some matrices 8-bit, the rest 4."""
    cfg = ModelConfig(
        family="gemma3",
        vocab_size=V,
        hidden_size=128,
        intermediate_size=256,
        num_layers=3,
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position=64,
        tie_word_embeddings=True,
        qk_norm=True,
        sliding_window=4,
        sliding_layers=(True, False, True),
        rope_local_theta=10_000.0,
        sandwich_norms=True,
        mlp_act="gelu_tanh",
        embed_scale=True,
        query_scale=0.2,
    )
    torch.manual_seed(4)
    model = Transformer(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    wide = {"layers.0.attn.wqkv", "layers.1.mlp.w2", "layers.2.mlp.w13", "layers.2.attn.wo"}
    return quantize_model(model.to(dtype), "w4a8-mixed", wide)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("path", ["decoder", "layers", "ops"])
def test_the_fused_gemma_layer_has_the_python_forwards_bits(
    dtype: torch.dtype, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma's SandwichBlocks, their sliding layers' masks and RoPE included, against the Python
    forward: the same logits, states and cache bits. Three ways: the whole forward in one call
    (`sandwich_decoder`, its layers' kernels called directly over shared buffers), layer by layer
    through the `sandwich` op with its kernels called directly, and the whole forward in one call
    with every layer's kernels called as ops (`use_native(False)`). The count of layers run
    directly says which way ran."""
    model = _gemma_target(dtype)
    args = cpu_layer.block_args(model.layers[0])
    assert args is not None and args.sandwich and args.q_ratio != 1.0
    assert args.matrices[1] == 8 and args.matrices[4] == 4  # wqkv 8-bit, wo 4-bit
    stack = cpu_layer.stack_args(model)
    assert stack is not None and stack.sandwich and stack.extra[1] == [True, False, True]
    _assert_path_is_python(model, path, monkeypatch)


def _qwen3_target(dtype: torch.dtype, mixed: bool) -> Transformer:
    """A tiny Qwen3 (q/k norms on every layer, no biases) in w4a8, or w4a8-mixed with some
    matrices 8-bit."""
    torch.manual_seed(6)
    cfg = dataclasses.replace(tiny_target(3, vocab=V, hidden=128, layers=3).cfg, qk_norm=True)
    model = Transformer(dataclasses.replace(cfg, family="qwen3")).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    if mixed:
        return quantize_model(model.to(dtype), "w4a8-mixed", MIXED_WIDE)
    return quantize_model(model.to(dtype), "w4a8")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("path", ["decoder", "layers", "ops"])
def test_the_fused_qwen3_layer_has_the_python_forwards_bits(
    dtype: torch.dtype, mixed: bool, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3's layers (each head's queries and keys normed before RoPE) against the Python
    forward: the same logits, states and cache bits, the whole forward in one call (`decoder`,
    its layers' kernels called directly), layer by layer with the kernels called directly, and
    in one call with every kernel called as an op; the count of layers run directly says which
    way ran."""
    model = _qwen3_target(dtype, mixed)
    args = cpu_layer.block_args(model.layers[0])
    assert args is not None and args.qk_norms[0] is model.layers[0].attn.q_norm.weight
    stack = cpu_layer.stack_args(model)
    assert stack is not None and stack.extra[1][2] is model.layers[2].attn.k_norm.weight
    _assert_path_is_python(model, path, monkeypatch)


def _greedy_run(model: Transformer) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Transformer.greedy over chains after a ragged prefill (ragged one-token steps and a
    3-token chain: the mask path) and on a one-row cache (a one-token step: no mask; a 4-token
    chain: the causal mask), committing part of each: every argmax and captured state, and
    both caches at the end."""
    outs: list[torch.Tensor] = []
    cache = model.new_cache(2, 32)
    model(RAGGED_PROMPTS, torch.arange(6).expand(2, 6), cache)
    cache.advance(RAGGED_KEEP)
    for ids, keep in [
        ([[7], [8]], [1, 1]),
        ([[11, 12, 13], [21, 22, 23]], [2, 1]),
        ([[3], [4]], [1, 1]),
    ]:
        argmax, hidden = model.greedy(torch.tensor(ids), cache, (1, 3))
        outs += [argmax, *hidden]
        cache.advance(keep)
    one = model.new_cache(1, 16)
    model(torch.tensor([[5, 6, 7]]), torch.arange(3)[None], one)
    one.advance([3])
    for ids, keep in [([[9]], [1]), ([[40, 41, 42, 43]], [3]), ([[50]], [1])]:
        argmax, hidden = model.greedy(torch.tensor(ids), one, (0, 2))
        outs += [argmax, *hidden]
        one.advance(keep)
    return outs, torch.cat(
        [torch.stack([cache.k, cache.v]).flatten(), torch.stack([one.k, one.v]).flatten()]
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mixed", [False, True])
def test_the_greedy_op_has_the_forwards_and_argmaxs_bits(
    dtype: torch.dtype, mixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Transformer.greedy in one C++ call (cpu_layer.greedy_chain: the plan, the embedding, the
    decoder and the argmax) against `forward` and sampling.greedy_tokens: the same argmax,
    captured states and cache bits, and the op really ran."""
    model = _target(dtype, mixed=mixed)
    _assert_op_is_its_fallback(_greedy_run, model, "greedy_chain", "greedy_args", 6, monkeypatch)


def test_the_greedy_op_steps_aside_and_refuses_what_forward_refuses() -> None:
    """Gradients wanted or a decoder of another kind: no op arguments (`forward`'s path);
    a chain past the cache's capacity and a capture boundary past the last layer: forward's
    errors."""
    model = _target(torch.float32)
    cache = model.new_cache(1, 4)
    assert cpu_layer.greedy_args(model, model.embed.weight, cache.k) is not None
    with torch.enable_grad():
        assert cpu_layer.greedy_args(model, model.embed.weight.requires_grad_(), cache.k) is None
    plain = tiny_target(3, vocab=V, hidden=128, layers=1)  # not quantized: no decoder op
    assert cpu_layer.greedy_args(plain, plain.embed.weight, plain.new_cache(1, 4).k) is None
    with torch.inference_mode():
        with pytest.raises(ValueError, match="KV cache overflow"):
            model.greedy(torch.tensor([[1, 2, 3, 4, 5]]), cache)
        with pytest.raises(ValueError, match="capture boundaries"):
            model.greedy(torch.tensor([[1]]), cache, (4,))


def test_plain_greedy_decoding_through_the_greedy_op_has_the_logits_paths_tokens() -> None:
    """generate_stream's greedy rows take each step's token from Transformer.greedy; a request
    asking for logprobs takes the logits path (forward, then the argmax): the same tokens."""
    target = _target(torch.bfloat16)
    prompts = [[5, 17, 33, 2, 8], [9, 1, 4], [70, 71, 72, 73, 74, 75, 76, 77, 78]]
    fast = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (14, 9, 20)]
    slow = [dataclasses.replace(p, logprobs=1) for p in fast]
    a = collect_outputs(generate_stream(target, NullTokenizer(), prompts, fast))
    b = collect_outputs(generate_stream(target, NullTokenizer(), prompts, slow))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


@pytest.mark.parametrize("draft", ["random-head", "oracle-noisy"])
def test_speculation_over_the_fused_layer_is_lossless(draft: str) -> None:
    """A random head (drafts rejected) and an oracle that drafts the plain continuation with
    every third token wrong, so accepted runs, bonus tokens and rejections all go through
    multi-token verification in the fused layer."""
    target = _target(torch.bfloat16)
    prompts = [[5, 17, 33, 2, 8], [9, 1, 4], [70, 71, 72, 73, 74, 75, 76, 77, 78]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (14, 9, 20)]
    plain = collect_outputs(generate_stream(target, NullTokenizer(), prompts, params))
    if draft == "random-head":
        proposer = Eagle3Proposer(random_eagle3(target, seed=1), (1, 2, 3))
    else:
        seqs = [p + o.token_ids + [0] * 8 for p, o in zip(prompts, plain, strict=True)]
        proposer = OracleProposer(seqs, V, wrong_every=3)
    spec = collect_outputs(
        generate_speculative(target, proposer, NullTokenizer(), prompts, params, num_draft=3)
    )
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    if draft == "oracle-noisy":
        assert sum(o.stats.accepted_tokens for o in spec) > 10  # the accept path ran


def test_the_fused_layer_steps_aside() -> None:
    """Gradients wanted, q/k norms of a kind the op does not take, or matrices of another kind: the
    Python forward."""
    model = _target(torch.float32)
    block, cache = model.layers[0], model.new_cache(1, 4)
    plan, x = cache.plan(1), torch.zeros(1, 1, 128)
    assert cpu_layer.fits(block, x, cache.k_layers[0], plan)
    assert not cpu_layer.fits(block, x.requires_grad_(), cache.k_layers[0], plan)
    plain = tiny_target(3, vocab=V, hidden=128, layers=1)
    assert not cpu_layer.fits(plain.layers[0], torch.zeros(1, 1, 128), cache.k_layers[0], plan)
    block.attn.q_norm = torch.nn.Identity()  # type: ignore[assignment]
    block.attn.k_norm = torch.nn.Identity()  # type: ignore[assignment]
    assert not cpu_layer.fits(block, torch.zeros(1, 1, 128), cache.k_layers[0], plan)


def test_the_fused_layer_reads_weights_replaced_after_a_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The op's arguments are read once per layer and kept (cpu_layer.LayerArgs): a matrix, a
    norm weight or a size replaced after a forward must be what the next forward uses."""
    model, donor = _target(torch.bfloat16), _target(torch.bfloat16, bias=True)
    block_args = cpu_layer.block_args  # the real one: _assert_fused_is_python patches it
    with torch.no_grad():
        donor.layers[1].mlp_norm.weight.mul_(1.5)
    with torch.inference_mode():
        _run(model)  # the arguments are kept now
        model.layers[0].mlp.w2 = donor.layers[0].mlp.w2  # another module (with a bias)
        model.layers[1].attn.wqkv.register_buffer("weight", donor.layers[1].attn.wqkv.weight)
        model.layers[1].mlp_norm.weight = donor.layers[1].mlp_norm.weight  # another parameter
        model.layers[2].attn_norm.eps = 1e-2  # another size
        model.layers[2].mlp_norm.eps = 1e-2
        _assert_fused_is_python(model, monkeypatch)
        # The op takes one eps for both norms: a layer whose norms differ takes the Python path
        # (the op once used the first norm's for both).
        assert block_args(model.layers[2]) is not None
        model.layers[2].mlp_norm.eps = 1e-5
        assert block_args(model.layers[2]) is None
        monkeypatch.undo()
        _assert_fused_is_python(model, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_prefill_leaves_the_bits_of_one_token_steps(dtype: torch.dtype) -> None:
    """A 90-token prompt (past the 64 queries the attention kernel once stopped at) prefilled in
    one forward, in chunks of 50 + 40 (the server's chunked prefill), two rows at once, or one
    token at a time: the same logits and cache, bit for bit. At bf16 over w4a8 a last bit can
    turn an int8 activation code, so this is what makes a prompt's answer independent of how
    the server split or batched it."""
    model = _target(dtype)
    torch.manual_seed(5)
    ids = torch.randint(0, V, (1, 90))
    pos = torch.arange(90)[None]

    def run(chunks: list[int], rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        cache = model.new_cache(rows, 96)
        logits, start = [], 0
        for n in chunks:
            sl = slice(start, start + n)
            out = model(ids[:, sl].expand(rows, n), pos[:, sl].expand(rows, n), cache)
            logits.append(out.logits[:1])
            cache.advance([n] * rows)
            start += n
        return torch.cat(logits, 1), torch.stack([cache.k[:, :1], cache.v[:, :1]])

    with torch.inference_mode():
        whole, whole_cache = run([90])
        for chunks, rows in (([50, 40], 1), ([90], 2), ([1] * 90, 1)):
            logits, kv = run(chunks, rows)
            assert torch.equal(logits, whole), (chunks, rows)
            assert torch.equal(kv, whole_cache), (chunks, rows)


def _head_run(head, feats: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A head prefill over 6 tokens fed three target states each (`feed`: fc, then the step;
    logits at the last, as a proposer's catch-up asks), two one-token steps and a 3-token masked
    level (as a tree draft grows): every step's logits and next state, and the head cache at the
    end. feats (1, 6, 3 C): the three states side by side."""
    cache = head.new_cache(1, 32)
    ids = torch.arange(5, 11)[None]
    aux = list(feats.chunk(3, dim=-1))
    out = head.feed(ids, aux, torch.arange(6)[None], cache, logit_index=torch.tensor([[5]]))
    outs = [out.logits, out.prenorm]
    cache.advance([6])
    state = out.prenorm[:, -1:]
    for step in range(2):
        out = head(ids[:, :1] + step, state, torch.tensor([[6 + step]]), cache)
        outs += [out.logits, out.prenorm]
        cache.advance([1])
        state = out.prenorm
    tree = torch.tensor([[[True, False, False], [True, True, False], [True, False, True]]])
    out = head(
        ids[:, :3],
        state.expand(1, 3, -1).contiguous(),
        torch.tensor([[8, 9, 9]]),
        cache,
        attn_mask=tree,
    )
    outs += [out.logits, out.prenorm]
    return outs, torch.stack([cache.k, cache.v])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("op", ["head", "layer"])
@pytest.mark.parametrize("variant", ["default", "norm_before_residual", "feed_normed"])
def test_the_fused_head_has_the_python_forwards_bits(
    dtype: torch.dtype, op: str, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An EAGLE-3 head quantized as the commands quantize it takes the whole step in one op
    (`head`), or, where that is refused, its layer from the attention input on (`forward_from`:
    the first layer's input is [norm(embedding), norm(g)], 2C wide): either way the same logits,
    next states and cache bits as its Python forward, with each config flag the op reads, its
    kernels called directly (the default) or every step through ATen and the ops
    (`use_native(False)`)."""
    target = _target(dtype)
    head = quantize_model(random_eagle3(target, seed=2), "w4a8")
    gen = torch.Generator().manual_seed(3)
    for name, p in head.named_parameters():  # norms of ones would hide a swapped weight
        if name.endswith("norm.weight"):
            p.data = (1 + 0.5 * torch.randn(p.shape, generator=gen)).to(p.dtype)
    if variant == "norm_before_residual":
        head.midlayer.norm_before_residual = True
    if variant == "feed_normed":
        head.cfg = dataclasses.replace(head.cfg, feed_normed=True)
    taken = []
    name = "forward_head" if op == "head" else "forward_draft"
    real = getattr(cpu_layer, name)
    monkeypatch.setattr(cpu_layer, name, lambda *a: taken.append(1) or real(*a))
    if op == "layer":
        monkeypatch.setattr(cpu_layer, "head_args", lambda *a: None)
    torch.manual_seed(6)
    feats = torch.randn(1, 6, 3 * 128).to(dtype)
    ops = torch.ops.eaglespec_layer
    with torch.inference_mode():
        fused, fused_cache = _head_run(head, feats)
        assert len(taken) == 4, f"the fused {op} op was taken {len(taken)} times, not 4"
        ops.use_native(False)  # the op's inputs, layer and logits through ATen and the ops
        try:
            through_ops, ops_cache = _head_run(copy.deepcopy(head), feats)
        finally:
            ops.use_native(True)
        monkeypatch.setattr(cpu_layer, "head_args", lambda *a: None)
        monkeypatch.setattr(cpu_layer, "draft_args", lambda *a: None)
        python, python_cache = _head_run(copy.deepcopy(head), feats)
    for a, b, c in zip(fused, through_ops, python, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)
    assert torch.equal(fused_cache, python_cache) and torch.equal(ops_cache, python_cache)


def _head_chain_run(head, feats: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A proposer's head calls on two rows: a prompt feed per row onto its own cache row
    (`feed_last`, 6 and 4 tokens: the causal mask from an empty cache), a ragged catch-up of 3
    and 2 tokens (the ragged mask; logits at each row's last), and two one-token steps
    (`step_last`: ragged, no mask once level): every logits and state, and the cache at the end.
    feats (2, 6, 3 C): the three states side by side."""
    cache = head.new_cache(2, 32)
    aux = list(feats.chunk(3, dim=-1))
    outs: list[torch.Tensor] = []
    for b, n in enumerate([6, 4]):
        row = cache.row(b)
        ids = (torch.arange(5, 5 + n) + b)[None]
        outs += head.feed_last(ids, [a[b : b + 1, :n] for a in aux], row, [n - 1])
    cache.lengths = [6, 4]
    logits, state = head.feed_last(
        torch.tensor([[20, 21, 22], [30, 31, 31]]), [a[:, :3] for a in aux], cache, [2, 1]
    )
    outs += [logits, state]
    cache.advance([3, 2])
    for step in range(2):
        logits, state = head.step_last(torch.tensor([[40 + step], [50]]), state[:, None], cache)
        outs += [logits, state]
        cache.advance([1, 1])
    return outs, torch.stack([cache.k, cache.v])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_head_chain_op_has_the_heads_forward_bits(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eagle3Head.feed_last and step_last in one C++ call each (`head_chain`: the plan, the
    head's step and the picks of each row's last token) against the same through `_step`
    (positions, plan and picks in Python, then the `head` op) and through the Python forward:
    the same logits, states and cache bits, and the op really ran."""
    target = _target(dtype)
    head = quantize_model(random_eagle3(target, seed=2), "w4a8")
    taken: list[int] = []
    real = cpu_layer.head_chain
    monkeypatch.setattr(cpu_layer, "head_chain", lambda *a: taken.append(1) or real(*a))
    torch.manual_seed(7)
    feats = torch.randn(2, 6, 3 * 128).to(dtype)
    with torch.inference_mode():
        fused, fused_cache = _head_chain_run(head, feats)
        assert len(taken) == 5
        monkeypatch.setattr(cpu_layer, "head_chain_args", lambda *a: None)
        op, op_cache = _head_chain_run(copy.deepcopy(head), feats)
        monkeypatch.setattr(cpu_layer, "head_args", lambda *a: None)
        monkeypatch.setattr(cpu_layer, "draft_args", lambda *a: None)
        python, python_cache = _head_chain_run(copy.deepcopy(head), feats)
    assert len(taken) == 5
    for a, b, c in zip(fused, op, python, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)
    assert torch.equal(fused_cache, python_cache) and torch.equal(op_cache, python_cache)


def test_the_fused_head_steps_aside_for_a_head_it_does_not_take() -> None:
    """Two draft layers, or a dense lm_head: no `head` op (the Python body runs)."""
    target = _target(torch.bfloat16)
    head = quantize_model(random_eagle3(target, seed=2), "w4a8")
    cache = head.new_cache(1, 8)
    plan = cache.plan(1)
    x = torch.zeros(1, 1, 128, dtype=torch.bfloat16)
    assert cpu_layer.head_args(head, x, cache.k_layers[0], plan) is not None
    dense = copy.deepcopy(head)
    dense.lm_head = torch.nn.Linear(128, dense.cfg.draft_vocab_size, bias=False)
    assert cpu_layer.head_args(dense, x, cache.k_layers[0], plan) is None
    deeper = copy.deepcopy(head)
    deeper.extra_layers.append(copy.deepcopy(deeper.midlayer))
    assert cpu_layer.head_args(deeper, x, cache.k_layers[0], plan) is None
