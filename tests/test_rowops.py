"""eaglespec's CPU row-op kernels (model/cpu_rowops.py, csrc/rowops.cpp): RMSNorm against its
plain-torch math, RoPE + cache write bitwise against the PyTorch ops it replaces, argmax against
torch.max's indices, row independence, and where they step aside (compiling, gradients).
Skipped where the kernels cannot run (no AVX-512, no C++ compiler)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eaglespec.cache import KVCache, write_entries
from eaglespec.model import cpu_rowops
from eaglespec.model.layers import RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq
from eaglespec.sampling import greedy_tokens

pytestmark = pytest.mark.skipif(
    cpu_rowops.available() is not None,
    reason=f"row-op kernels unavailable: {cpu_rowops.available()}",
)
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 64, 100, 8])
def test_rms_norm_is_its_math_and_close_to_torch(dtype: torch.dtype, width: int) -> None:
    torch.manual_seed(0)
    x = (torch.randn(2, 5, width) * 3).to(dtype)
    w = (torch.rand(width) + 0.5).to(dtype)
    y = cpu_rowops.rms_norm(x, w, 1e-5)
    assert y.shape == x.shape and y.dtype == dtype
    ref = cpu_rowops.rms_norm_reference(x, w, 1e-5)
    # fp32: sums in another order; bf16: one rounding of the output at most
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-8, "atol": 0}
    torch.testing.assert_close(y, ref, **tol)
    torch.testing.assert_close(y, F.rms_norm(x, (width,), w, 1e-5), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_alone(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = torch.randn(9, 576).to(dtype)
    w = torch.rand(576).to(dtype)
    alone = torch.cat([cpu_rowops.rms_norm(x[i : i + 1], w, 1e-6) for i in range(9)])
    assert torch.equal(cpu_rowops.rms_norm(x, w, 1e-6), alone)


def test_the_layer_steps_aside_for_gradients_and_compiling() -> None:
    """Training backpropagates through RMSNorm: the kernel has no backward, PyTorch's op runs."""
    norm = RMSNorm(64, 1e-5)
    x = torch.randn(3, 64, requires_grad=True)
    assert not cpu_rowops.rms_norm_fits(x, norm.weight)
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    with torch.no_grad():
        assert cpu_rowops.rms_norm_fits(x, norm.weight.detach())
        torch.testing.assert_close(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 64, 100, 8])
def test_silu_mul_is_its_math_and_close_to_torch(dtype: torch.dtype, width: int) -> None:
    torch.manual_seed(2)
    x = (torch.randn(2, 5, 2 * width) * 4).to(dtype)
    x[0, 0, :12] = torch.tensor([0.0, -0.0, 90, -90, 1e-8, -1e-8, 200, -200, 87.5, -87.5, 3, -3])
    y = cpu_rowops.silu_mul(x)
    assert y.shape == (2, 5, width) and y.dtype == dtype
    ref = cpu_rowops.silu_mul_reference(x)
    g, u = x.chunk(2, dim=-1)
    # fp32: exp within 2 ulp; bf16: one rounding of the output (torch rounds silu(g) once more);
    # below -87 the kernel's exp is 0, where silu is under 1e-35
    tol = {"rtol": 2e-6, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-30}
    torch.testing.assert_close(y, ref, **tol)
    if dtype == torch.float32:
        torch.testing.assert_close(y, F.silu(g) * u, **tol)
    else:
        torch.testing.assert_close(y, F.silu(g) * u, rtol=2**-6, atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_rows_alone_and_views(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    # 33 rows: split between threads (from 8,192 values a task), unevenly
    x = torch.randn(33, 2 * 1536).to(dtype)
    alone = torch.cat([cpu_rowops.silu_mul(x[i : i + 1]) for i in range(33)])
    assert torch.equal(cpu_rowops.silu_mul(x), alone)
    wide = torch.randn(9, 4 * 1536).to(dtype)  # a row-strided view, as a slice of a wider output
    view = wide[:, : 2 * 1536]
    assert torch.equal(cpu_rowops.silu_mul(view), cpu_rowops.silu_mul(view.contiguous()))
    with pytest.raises(RuntimeError, match="gate and up"):
        cpu_rowops.silu_mul(torch.randn(2, 7))


def test_the_mlp_takes_silu_mul_and_steps_aside_for_gradients() -> None:
    from eaglespec.model.layers import GatedMLP

    torch.manual_seed(4)
    mlp = GatedMLP(64, 96, bias=False)
    x = torch.randn(3, 64, requires_grad=True)
    mlp(x).sum().backward()  # PyTorch's ops: the kernel has no backward
    assert x.grad is not None and mlp.w13.weight.grad is not None
    with torch.no_grad():
        kernel = mlp(x)
        assert torch.equal(kernel, mlp.w2(cpu_rowops.silu_mul(mlp.w13(x))))
        gate, up = mlp.w13(x).split(96, dim=-1)
        torch.testing.assert_close(kernel, mlp.w2(F.silu(gate) * up), rtol=1e-5, atol=1e-6)


def _cache(batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype) -> KVCache:
    return KVCache.allocate(
        num_layers=1,
        batch=batch,
        num_kv_heads=kv_heads,
        capacity=capacity,
        head_dim=head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )


def _torch_rope_write(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, H: int
) -> torch.Tensor:
    """layers.cached_attention's PyTorch form up to attention: -> q (B, H, T, D)."""
    B, T, heads, D = qkv.shape
    Hkv = (heads - H) // 2
    qk = apply_rope(qkv[:, :, : H + Hkv], cos, sin)
    k = qk[:, :, H:].transpose(1, 2)
    v = qkv[:, :, H + Hkv :].transpose(1, 2)
    write_entries(cache.k_layers[0], cache.v_layers[0], cache.plan(T).write_index, k, v)
    return qk[:, :, :H].transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("H", "Hkv", "D"), [(9, 3, 64), (4, 2, 128), (2, 1, 32)])
def test_rope_write_has_the_bits_of_the_torch_ops(
    dtype: torch.dtype, H: int, Hkv: int, D: int
) -> None:
    """Rows at different lengths (slots apart), several new tokens, and positions past the
    lengths (tree depths): q, the cache's k and v bitwise those of the PyTorch ops."""
    torch.manual_seed(2)
    B, T, S = 2, 3, 16
    caches = [_cache(B, Hkv, S, D, dtype) for _ in range(2)]
    for cache in caches:
        cache.lengths = [4, 7]
    qkv = torch.randn(B, T, H + 2 * Hkv, D).to(dtype)
    positions = torch.tensor([[4, 5, 5], [7, 8, 9]])
    cos, sin = rope_cos_sin(positions, rope_inv_freq(D, 10000.0, None), dtype)
    want_q = _torch_rope_write(qkv, cos, sin, caches[0], H)
    slots = caches[1].plan(T).slots
    q = cpu_rowops.rope_write(qkv, cos, sin, caches[1].k_layers[0], caches[1].v_layers[0], slots)
    assert torch.equal(q.transpose(1, 2), want_q)
    assert torch.equal(caches[1].k, caches[0].k) and torch.equal(caches[1].v, caches[0].v)


def test_rope_write_refuses_a_slot_outside_the_cache() -> None:
    cache = _cache(1, 1, 4, 32, torch.float32)
    qkv, trig = torch.randn(1, 1, 3, 32), torch.ones(1, 1, 1, 32)
    k, v = cache.k_layers[0], cache.v_layers[0]
    with pytest.raises(RuntimeError, match="slot 4 outside the cache"):
        cpu_rowops.rope_write(qkv, trig, trig, k, v, torch.tensor([[4]]))


@pytest.mark.parametrize("shape", [(1, 49152), (2, 3, 8192), (5, 17), (3, 1), (64, 33)])
def test_argmax_is_torch_max_indices(shape: tuple[int, ...]) -> None:
    """Random rows of every width (whole and partial 16-lane chunks), then rows full of ties:
    the first maximum, as torch.max gives it."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen)
    assert torch.equal(cpu_rowops.argmax(x), x.max(-1).indices)
    ties = torch.randint(0, 3, shape, generator=gen).float()
    assert torch.equal(cpu_rowops.argmax(ties), ties.max(-1).indices)


def test_argmax_edge_values() -> None:
    """NaN counts as the maximum (the first one wins), -inf everywhere is index 0, and -0.0
    ties +0.0 (the first of them wins), as in torch.max."""
    nan, inf = float("nan"), float("inf")
    x = torch.tensor(
        [
            [1.0, nan, 3.0, nan],
            [-inf, -inf, -inf, -inf],
            [-0.0, 0.0, -1.0, -2.0],
            [2.0, 5.0, 5.0, inf],
            [-1.0, -0.5, -0.5, -3.0],
        ]
    )
    assert torch.equal(cpu_rowops.argmax(x), x.max(-1).indices)
    assert cpu_rowops.argmax(x).tolist() == [1, 0, 0, 3, 1]


def test_greedy_tokens_take_the_kernel_where_it_fits() -> None:
    """fp32 on the CPU: the kernel; bf16 logits or gradients wanted: torch.max, same answer."""
    x = torch.randn(3, 500)
    assert cpu_rowops.argmax_fits(x)
    assert not cpu_rowops.argmax_fits(x.bfloat16())
    assert not cpu_rowops.argmax_fits(x.clone().requires_grad_())
    for logits in (x, x.bfloat16(), x.clone().requires_grad_()):
        assert torch.equal(greedy_tokens(logits), logits.max(-1).indices)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_avx2_path_gives_the_avx512_bits(dtype: torch.dtype) -> None:
    """Where the CPU has AVX-512, the AVX2 path (what x86-64-v3 CPUs run) can be asked for: each
    op gives the AVX-512 path's bits, widths with and without a tail of 16."""
    ops = torch.ops.eaglespec_rowops
    if ops.use_avx2(False):
        pytest.skip("no AVX-512 here: the AVX2 path is the only one")
    torch.manual_seed(6)
    try:
        for width in (576, 100, 8):
            x = (torch.randn(7, width) * 3).to(dtype)
            w = (torch.rand(width) + 0.5).to(dtype)
            g = (torch.randn(7, 2 * width) * 4).to(dtype)
            logits = torch.randn(3, width * 5)
            got = []
            for avx2 in (True, False):
                assert ops.use_avx2(avx2) == avx2
                got.append((ops.rms_norm(x, w, 1e-5), ops.silu_mul(g), ops.argmax(logits)))
            for a, b in zip(*got, strict=True):
                assert torch.equal(a, b), width
        B, T, H, Hkv, D = 2, 3, 9, 3, 64
        qkv = torch.randn(B, T, H + 2 * Hkv, D).to(dtype)
        cos, sin = torch.randn(2, B, T, 1, D).to(dtype)
        slots = torch.arange(T).repeat(B, 1)
        got = []
        for avx2 in (True, False):
            ops.use_avx2(avx2)
            kc, vc = torch.zeros(2, B, Hkv, 8, D, dtype=dtype)
            got.append((ops.rope_write(qkv, cos, sin, kc, vc, slots), kc, vc))
        for a, b in zip(*got, strict=True):
            assert torch.equal(a, b)
    finally:
        ops.use_avx2(False)
