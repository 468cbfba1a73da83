"""eaglespec's own int4 x int8 and int8 x int8 CPU kernels (model/w4a8.py, csrc/w4a8.cpp): against
the plain-torch reference of their math, row independence, which layers the modes replace,
refused shapes.
Speculation over a w4a8 target is checked for greedy identity in tests/test_compile.py.
Skipped where the kernel cannot run (no AVX-512 VNNI, no C++ compiler)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from tests.helpers import tiny_target
from torch import nn

from eaglespec.errors import InvalidRequestError
from eaglespec.model import w4a8
from eaglespec.model.quant import Int4Linear, Int8Linear, dense_rows, quantize_model

pytestmark = pytest.mark.skipif(
    w4a8.available() is not None, reason=f"w4a8 kernel unavailable: {w4a8.available()}"
)

# (N, K): full 512-feature windows, a partial last window (K = 576: 16 + 2 groups, SmolLM2's
# hidden size; 8960: 17.5 windows, Qwen2.5-1.5B's MLP), a single small window.
SHAPES = [(64, 1536), (960, 576), (8, 8960), (12, 64)]


def _layer(n: int, k: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    nn.init.normal_(layer.weight, std=0.05)
    if bias:
        nn.init.normal_(layer.bias, std=0.1)
    return layer.requires_grad_(False)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_computes_the_documented_math(shape: tuple[int, int], dtype: torch.dtype) -> None:
    n, k = shape
    layer = _layer(n, k, bias=True).to(dtype)  # the bias is added in the model's dtype
    q, s, lo = w4a8.int4_group_codes(layer.weight)
    mod = w4a8.W4A8Linear.from_linear(layer)
    torch.manual_seed(1)
    x = torch.randn(5, k).to(dtype)  # (M, K)
    y = mod(x)
    assert y.dtype == dtype and y.shape == (5, n)
    # fp16 scales and minimums, as stored; the reference quantizes x the same way.
    ref = w4a8.reference(x, q, s.half(), lo.half()) + layer.bias.float()  # (M, N) fp32
    # fp32: only the order of float sums differs; bf16: plus one rounding of the output and one
    # of the bias sum.
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2**-7, 1e-2)
    torch.testing.assert_close(y.float(), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_kernel_computes_the_documented_math(
    shape: tuple[int, int], dtype: torch.dtype
) -> None:
    n, k = shape
    layer = _layer(n, k, bias=True).to(dtype)
    q, s = w4a8.int8_group_codes(layer.weight)
    mod = w4a8.W8A8Linear.from_linear(layer)
    torch.manual_seed(1)
    x = torch.randn(5, k).to(dtype)  # (M, K)
    y = mod(x)
    assert y.dtype == dtype and y.shape == (5, n)
    ref = w4a8.reference8(x, q, s) + layer.bias.float()  # (M, N) fp32
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2**-7, 1e-2)
    torch.testing.assert_close(y.float(), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("shape", [*SHAPES, (50, 96)])
def test_dequantize_reads_back_the_packed_weight(shape: tuple[int, int]) -> None:
    """The dense weight the kernels multiply by, read back from their blocked bytes (training
    reads the target's output rows this way): the codes and fp16 scales exactly."""
    n, k = shape
    layer = _layer(n, k, bias=False)
    q, s, lo = w4a8.int4_group_codes(layer.weight)
    G = w4a8.GROUP
    want4 = q.float() * s.half().float().repeat_interleave(G, 1)
    want4 += lo.half().float().repeat_interleave(G, 1)
    assert torch.equal(w4a8.W4A8Linear.from_linear(layer).dequantize(), want4)
    q8, s8 = w4a8.int8_group_codes(layer.weight)
    want8 = q8.float() * s8.float().repeat_interleave(G, 1)
    assert torch.equal(w4a8.W8A8Linear.from_linear(layer).dequantize(), want8)
    # and the kernel's output is the dequantized weight's up to the int8 activation codes
    x = torch.randn(3, k)
    y = w4a8.W8A8Linear.from_linear(layer)(x)
    torch.testing.assert_close(y, x @ want8.T, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("kind", [w4a8.W4A8Linear, w4a8.W8A8Linear])
def test_rows_of_a_large_head_are_unpacked_alone(kind: type[w4a8.W4A8Linear]) -> None:
    """`quant.dense_rows` reads chosen rows (a draft vocabulary's, in any order, repeated) from
    the blocked bytes a chunk of blocks at a time, exactly as the whole dequantized weight has
    them: over several chunks, the last one partial and its last block padded (N = 2,100)."""
    layer = _layer(2100, 64, bias=False)
    mod = kind.from_linear(layer)
    whole = mod.dequantize()
    gen = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randperm(2100, generator=gen)[:300], torch.tensor([2099, 0, 5, 5])])
    assert torch.equal(dense_rows(mod, ids), whole[ids])
    assert dense_rows(mod, ids[:0]).shape == (0, 64)
    with pytest.raises(IndexError, match="0, 2100"):
        dense_rows(mod, torch.tensor([2100]))


def test_dense_rows_of_other_layers() -> None:
    layer = _layer(64, 32, bias=False)
    ids = torch.tensor([3, 63, 3])
    assert torch.equal(dense_rows(layer, ids), layer.weight[ids])
    q = Int8Linear.from_linear(layer)
    assert torch.equal(dense_rows(q, ids), q.dequantize()[ids])


def test_4bit_codes_are_a_q4_1_tensors_own() -> None:
    """Real Q4_1 blocks, made by the gguf package's own quantizer from random weights (so codes,
    d and m round as a converter rounds them), dequantized to fp32: the packed layer holds the
    file's weights exactly (its codes against fp16 scales; with bf16 scales, as int4 keeps them,
    up to 0.001 off)."""
    gguf = pytest.importorskip("gguf")
    values = (np.random.default_rng(0).standard_normal((48, 256)) * 0.05).astype(np.float32)
    stored = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_1)
    weights = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType.Q4_1).reshape(48, 256)
    layer = nn.Linear(256, 48, bias=False).requires_grad_(False)
    layer.weight.copy_(torch.from_numpy(weights.copy()))
    assert torch.equal(w4a8.W4A8Linear.from_linear(layer).dequantize(), layer.weight)
    assert not torch.equal(Int4Linear.from_linear(layer).dequantize(), layer.weight)


def test_8bit_codes_are_a_q8_0_tensors_own() -> None:
    """Weights on GGUF's Q8_0 grid (w = d * q per group of 32, d fp16, codes reaching 127 in
    every group) come back as the same codes and scales, so the head computes the file's
    weights."""
    torch.manual_seed(4)
    d = (torch.rand(16, 4) * 0.01 + 1e-3).half()  # (N, groups)
    q = torch.randint(-127, 128, (16, 4, 32))
    q[:, :, 0] = 127 * torch.where(torch.rand(16, 4) < 0.5, 1, -1)  # absmax 127 in each group
    w = (q.float() * d.float()[..., None]).view(16, 128)
    codes, scales = w4a8.int8_group_codes(w)
    assert torch.equal(codes.view(16, 4, 32).long(), q)
    assert torch.equal(scales, d)


@pytest.mark.parametrize("bits", [4, 8])
def test_fitting_and_packing_in_row_pieces_give_the_whole_matrix_bytes(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loads fit and pack a large matrix FIT_VALUES codes at a time (their float32 temporaries
    stay small): the pieces joined are the bytes of the whole matrix done at once, whatever the
    piece size, for a row count that ends in a partial block."""
    w = torch.randn(16 * 9 + 5, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    whole = w4a8.fit_fields(w, bits)
    layer = w4a8.from_fields(whole, None)
    for values in (1, 96 * 16, 96 * 16 * 3 + 7):  # a block at a time (also below one), three
        monkeypatch.setattr(w4a8, "FIT_VALUES", values)
        pieces = w4a8.fit_fields(w, bits)
        assert torch.equal(pieces.codes, whole.codes) and torch.equal(pieces.scales, whole.scales)
        assert (pieces.offsets is None) == (bits == 8)
        if pieces.offsets is not None:
            assert torch.equal(pieces.offsets, whole.offsets)
        assert torch.equal(w4a8.from_fields(pieces, None).weight, layer.weight), values


def test_int8_activations_cost_about_nothing_next_to_the_int4_weights() -> None:
    """Against the dense layer, the error the int8 activation codes add (w4a8's output against
    its own 4-bit weights times the fp32 activations) is under a quarter of the weights' own
    (measured 0.009-0.015 against 0.075-0.081 of the output's norm): the weights' 4 bits
    dominate, not the activations' 8."""
    layer = _layer(256, 1536, bias=False)
    torch.manual_seed(3)
    x = torch.randn(3, 1536)
    dense = layer(x)
    mod = w4a8.W4A8Linear.from_linear(layer)

    def rel_err(y: torch.Tensor) -> float:
        return float((y.float() - dense).norm() / dense.norm())

    weights_only = x @ mod.dequantize().T  # (3, 256)
    activations = float((mod(x).float() - weights_only).norm() / dense.norm())
    assert 0.01 < rel_err(weights_only) < 0.2  # the 4-bit rounding is there to compare against
    assert 0 < activations < 0.25 * rel_err(weights_only), (activations, rel_err(weights_only))


# Row counts around the kernel's tiles of 8 rows and its L2 chunks (K = 576: 448 rows), odd and
# even, up to a long prefill's.
ROW_COUNTS = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 64, 65, 129, 300, 457]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", [w4a8.W4A8Linear, w4a8.W8A8Linear])
def test_each_row_is_computed_alone(kind: type[w4a8.W4A8Linear], dtype: torch.dtype) -> None:
    """Row b of a forward over M rows is bitwise the same row alone, for every M the kernel
    takes (tiles of 1-8 rows, several tiles, several L2 chunks), which keeps verification,
    batched decoding and prefill consistent with one-token steps."""
    mod = kind.from_linear(_layer(960, 576, bias=True))
    torch.manual_seed(2)
    x = torch.randn(max(ROW_COUNTS), 576).to(dtype)
    alone = torch.cat([mod(x[i : i + 1]) for i in range(len(x))])  # (M, N), one row at a time
    for m in ROW_COUNTS:
        batch = mod(x[:m])
        assert torch.equal(batch, alone[:m]), m
        # the same rows at another offset in the batch (another tile position)
        assert torch.equal(mod(x[m // 2 : m])[: m - m // 2], alone[m // 2 : m]), m


def _both_paths_agree(
    switch: Callable[[bool], bool], dtype: torch.dtype, k: int, seed: int
) -> None:
    """Every output (4-bit, 8-bit, with the residual add) is bitwise the same with `switch` on
    and off (it returns whether the path is on), at every row count, N a multiple of 16 or not."""
    ops = torch.ops.eaglespec_w4a8
    torch.manual_seed(seed)
    x = torch.randn(max(ROW_COUNTS), k).to(dtype)
    x[1, 32:64] = 0  # a group of zeros (dx = 0), one of a single value, one of large values
    x[2, 64:96] = 0.75
    x[3, 96:128] *= 1000
    for n in (160, 97):
        layer = _layer(n, k, bias=False)
        w4, w8 = w4a8.W4A8Linear.from_linear(layer), w4a8.W8A8Linear.from_linear(layer)
        r = torch.randn(max(ROW_COUNTS), n).to(dtype)
        for m in ROW_COUNTS:
            got = []
            for on in (True, False):
                assert switch(on) == on
                got.append(
                    (
                        ops.linear(x[:m], w4.weight, n),
                        ops.linear8(x[:m], w8.weight, n),
                        ops.linear_add(x[:m], w4.weight, n, r[:m]),
                    )
                )
            for a, b in zip(*got, strict=True):
                assert torch.equal(a, b), (n, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [576, 8960])
def test_amx_tiles_give_the_vnni_bits(dtype: torch.dtype, k: int) -> None:
    """Where the CPU has AMX, tiles of 16 rows take their dot products from it, and a forward
    of fewer rows one tile of its own height (every height here: `amx_min_rows(bits, 1)`); every
    output (4-bit, 8-bit, with the residual add) is bitwise the VNNI path's at every row count,
    N a multiple of 16 or not, K of one L2 chunk per 16 rows or many."""
    ops = torch.ops.eaglespec_w4a8
    if not ops.use_amx(True):
        pytest.skip("no AMX here (or the OS does not grant its tile state)")
    default = {bits: ops.amx_min_rows(bits, 1) for bits in (4, 8)}
    try:
        _both_paths_agree(ops.use_amx, dtype, k, seed=4)
    finally:
        ops.use_amx(True)
        for bits, rows in default.items():
            ops.amx_min_rows(bits, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [576, 8960])
def test_the_avx2_path_gives_the_avx512_bits(dtype: torch.dtype, k: int) -> None:
    """Where the CPU has AVX-512 VNNI, the AVX2 path (what x86-64-v3 CPUs run) can be asked
    for: every output (4-bit, 8-bit, with the residual add) is bitwise the AVX-512 path's at
    every row count, N a multiple of 16 or not, so the two kinds of machine decode alike."""
    ops = torch.ops.eaglespec_w4a8
    if ops.use_avx2(False):
        pytest.skip("no AVX-512 VNNI here: the AVX2 path is the only one")
    try:
        _both_paths_agree(ops.use_avx2, dtype, k, seed=5)
    finally:
        ops.use_avx2(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [576, 8960])
def test_the_avx2_orders_of_a_blocks_halves_give_the_same_bits(dtype: torch.dtype, k: int) -> None:
    """On the AVX2 path (forced where AVX-512 VNNI runs) tiles
    take a weight block's two halves together, group by group, or each over all groups in turn:
    every output (4-bit, 8-bit, with the residual add) is bitwise the same either way, at every
    row count, N a multiple of 16 or not (a block's two halves, or one)."""
    ops = torch.ops.eaglespec_w4a8
    assert ops.use_avx2(True)
    try:
        _both_paths_agree(ops.avx2_together, dtype, k, seed=6)
    finally:
        ops.avx2_together(True)
        ops.use_avx2(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [576, 97])
def test_the_residual_add_has_atens_bits(dtype: torch.dtype, n: int) -> None:
    """linear_add(x, w, N, r) is bitwise r + linear(x, w, N) (ATen's add of the rounded product),
    at every row count the kernel tiles, N a multiple of its 16-row blocks or not, and a
    residual of another shape or dtype is refused."""
    mod = w4a8.W4A8Linear.from_linear(_layer(n, 576, bias=False))
    torch.manual_seed(3)
    x = torch.randn(max(ROW_COUNTS), 576).to(dtype)
    r = torch.randn(max(ROW_COUNTS), n).to(dtype)
    for m in ROW_COUNTS:
        got = torch.ops.eaglespec_w4a8.linear_add(x[:m], mod.weight, n, r[:m])
        want = r[:m] + torch.ops.eaglespec_w4a8.linear(x[:m], mod.weight, n)
        assert got.dtype == dtype and torch.equal(got, want), m
    with pytest.raises(RuntimeError, match="residual must be"):
        torch.ops.eaglespec_w4a8.linear_add(x[:2], mod.weight, n, r[:3])
    with pytest.raises(RuntimeError, match="residual must be"):
        torch.ops.eaglespec_w4a8.linear_add(x[:2], mod.weight, n, r[:2].half())


@pytest.mark.parametrize("kind", [w4a8.W4A8Linear, w4a8.W8A8Linear])
@pytest.mark.parametrize("n", [4, 6, 50, 97])
def test_any_number_of_output_rows(kind: type[w4a8.W4A8Linear], n: int) -> None:
    """Output rows come in blocks of 16 lanes; a matrix whose N is not a multiple of 16 is
    padded with zero rows that are never stored (a vocabulary of any size)."""
    layer = _layer(n, 96, bias=True)
    mod = kind.from_linear(layer)
    x = torch.randn(3, 96)
    y = mod(x)
    assert y.shape == (3, n)
    if kind is w4a8.W4A8Linear:
        q, s, lo = w4a8.int4_group_codes(layer.weight)
        ref = w4a8.reference(x, q, s.half(), lo.half())
    else:
        q, s = w4a8.int8_group_codes(layer.weight)
        ref = w4a8.reference8(x, q, s)
    torch.testing.assert_close(y, ref + layer.bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [w4a8.W4A8Linear, w4a8.W8A8Linear])
def test_zero_and_constant_groups(kind: type[w4a8.W4A8Linear]) -> None:
    """An all-zero activation group (dx = 0), a constant weight group (one code value) and an
    all-zero weight group."""
    layer = _layer(8, 96, bias=False)
    layer.weight[:, :32] = 0.25
    layer.weight[:, 64:] = 0
    mod = kind.from_linear(layer)
    x = torch.randn(2, 96)
    x[:, 32:64] = 0
    torch.testing.assert_close(mod(x), layer(x), rtol=0.05, atol=0.02)


def test_modes_replace_the_body_and_choose_the_head() -> None:
    body = quantize_model(tiny_target(0, vocab=96), "w4a8")
    assert isinstance(body.layers[0].attn.wqkv, w4a8.W4A8Linear)
    assert isinstance(body.lm_head, w4a8.W8A8Linear)
    odd = quantize_model(tiny_target(0, vocab=97), "w4a8")  # 97 rows: padded to 7 blocks of 16
    assert isinstance(odd.lm_head, w4a8.W8A8Linear)
    both = quantize_model(tiny_target(0, vocab=96), "w4a8-all")
    assert isinstance(both.layers[0].mlp.w2, w4a8.W4A8Linear)
    assert isinstance(both.lm_head, w4a8.W4A8Linear)


def test_mixed_mode_puts_the_wide_layers_through_the_8bit_kernel() -> None:
    wide = {"layers.0.attn.wqkv", "layers.1.mlp.w2"}
    model = quantize_model(tiny_target(0, vocab=96), "w4a8-mixed", wide)
    for i, layer in enumerate(model.layers):
        for path, mod in [("attn.wqkv", layer.attn.wqkv), ("attn.wo", layer.attn.wo),
                          ("mlp.w13", layer.mlp.w13), ("mlp.w2", layer.mlp.w2)]:  # fmt: skip
            kind = w4a8.W8A8Linear if f"layers.{i}.{path}" in wide else w4a8.W4A8Linear
            assert type(mod) is kind, (i, path)
    assert isinstance(model.lm_head, w4a8.W8A8Linear)
    with pytest.raises(ValueError, match="w4a8-mixed's"):
        quantize_model(tiny_target(0, vocab=96), "w4a8", wide)


@pytest.mark.parametrize("kind", [w4a8.W4A8Linear, w4a8.W8A8Linear])
def test_shapes_the_kernel_cannot_take_are_refused(kind: type[w4a8.W4A8Linear]) -> None:
    with pytest.raises(InvalidRequestError, match=r"in_features divisible by 32, got a \(8, 48\)"):
        kind.from_linear(_layer(8, 48, bias=False))


def test_the_roofline_runs_each_matrix_through_the_kernel() -> None:
    """benchmarks/roofline.py times its passes through roofline.matrices, which calls the
    kernels from C++ in turn: every matrix goes through (a matrix whose rows do not fit its
    weight is refused by the kernel itself)."""
    from eaglespec.model.extension import build

    reason = build("roofline", needs="an x86 CPU with AVX2 or AVX-512 VNNI")
    if reason is not None:
        pytest.skip(reason)
    ops = torch.ops.eaglespec_roofline
    layer = _layer(32, 64, bias=False)
    w4, w8 = w4a8.W4A8Linear.from_linear(layer), w4a8.W8A8Linear.from_linear(layer)
    x = torch.randn(3, 64).bfloat16()
    assert ops.matrices([x, x], [w4.weight, w4.weight], [32, 32], 4) == 2
    assert ops.matrices([x], [w8.weight], [32], 8) == 1
    with pytest.raises(RuntimeError, match="4 or 8 bits"):
        ops.matrices([x], [w4.weight], [32], 5)
    with pytest.raises(RuntimeError):
        ops.matrices([torch.randn(3, 96).bfloat16()], [w4.weight], [32], 4)  # K 96, weight K 64
