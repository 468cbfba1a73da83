"""cpu_attention: eaglespec's attention kernel for few queries onto a cache (csrc/attention.cpp).

Checked against the same math in fp32 torch (masks, GQA, ragged masks, strided views of a cache,
every head dim it is built for), for row independence (a T-token call is bitwise T one-token
calls, a batch bitwise its rows alone, any thread count the same bits, masked keys anywhere the
same bits as the attended keys packed), and for where
`layers.attend` sends attention: to the kernel eagerly and under torch.compile."""

from __future__ import annotations

import pytest
import torch

from eaglespec.model import cpu_attention
from eaglespec.model.layers import attend

pytestmark = pytest.mark.skipif(
    cpu_attention.available() is not None, reason=str(cpu_attention.available())
)


def _inputs(
    dtype: torch.dtype, B: int = 2, H: int = 9, Hkv: int = 3, T: int = 3, K: int = 37, D: int = 64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q as the model passes it (a transposed view), k and v as slices of a longer cache."""
    gen = torch.Generator().manual_seed(B * 1000 + T * 100 + K + D)
    q = torch.randn(B, T, H, D, generator=gen).to(dtype).transpose(1, 2)  # (B, H, T, D)
    cache = torch.randn(2, B, Hkv, K + 7, D, generator=gen).to(dtype)
    k, v = cache[0, :, :, :K], cache[1, :, :, :K]  # (B, Hkv, K, D) strided
    mask = torch.rand(B, 1, T, K, generator=gen) > 0.3
    mask[..., 0] = True  # every query sees at least one key, as in the engine
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", cpu_attention.HEAD_DIMS)
@pytest.mark.parametrize("masked", [False, True])
def test_kernel_matches_the_reference(dtype: torch.dtype, D: int, masked: bool) -> None:
    q, k, v, mask = _inputs(dtype, D=D)
    m = mask if masked else None
    out = cpu_attention.attend(q, k, v, m)
    assert out.shape == q.shape and out.dtype == dtype
    ref = cpu_attention.reference(q, k, v, m)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)
    else:  # one rounding to bf16 of nearly the same fp32 value: at most one bf16 step apart
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


def test_large_scores_and_one_key() -> None:
    """Scores far apart (exp underflows for most keys) and a single key (softmax of one)."""
    q, k, v, mask = _inputs(torch.float32, T=2, K=50)
    q = q * 40
    torch.testing.assert_close(
        cpu_attention.attend(q, k, v, mask),
        cpu_attention.reference(q, k, v, mask),
        atol=1e-5,
        rtol=1e-5,
    )
    q1, k1, v1, _ = _inputs(torch.float32, T=1, K=1)
    expected = v1.repeat_interleave(3, dim=1)  # every query head reads its KV head's one value
    assert torch.equal(cpu_attention.attend(q1, k1, v1, None), expected)


def test_a_fully_masked_row_is_zero() -> None:
    q, k, v, mask = _inputs(torch.float32, B=1, T=2)
    mask[0, 0, 1] = False
    out = cpu_attention.attend(q, k, v, mask)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    torch.testing.assert_close(out[:, :, 0], cpu_attention.reference(q, k, v, mask)[:, :, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_independent(dtype: torch.dtype) -> None:
    """Each query token and each batch row alone gives the bits it gets among the others."""
    q, k, v, mask = _inputs(dtype, B=3, T=5, K=120)
    out = cpu_attention.attend(q, k, v, mask)
    for t in range(5):
        alone = cpu_attention.attend(q[:, :, t : t + 1], k, v, mask[:, :, t : t + 1])
        assert torch.equal(alone, out[:, :, t : t + 1])
    for b in range(3):
        row = cpu_attention.attend(q[b : b + 1], k[b : b + 1], v[b : b + 1], mask[b : b + 1])
        assert torch.equal(row, out[b : b + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", cpu_attention.HEAD_DIMS)
def test_masked_keys_do_not_move_the_sums(dtype: torch.dtype, D: int) -> None:
    """A draft-tree node attends to the prefix and its ancestors, which sit among masked
    siblings; once accepted, those entries are moved to the front and the next one-token step
    reads them packed. Both must give the same bits, or a tree's verification can differ from
    plain decoding (it did: a w4a8 target in bf16, 43 tokens in). The packed rows are scored 16
    keys at a time, the masked ones key by key: the same reduction tree either way."""
    q, k, v, _ = _inputs(dtype, B=1, T=1, K=161, D=D)
    for attended in ([0, 3, 17, 40], list(range(0, 161, 7)), list(range(100)) + [130, 131, 160]):
        mask = torch.zeros(1, 1, 1, 161, dtype=torch.bool)
        mask[..., attended] = True
        scattered = cpu_attention.attend(q, k, v, mask)
        idx = torch.tensor(attended)
        packed = cpu_attention.attend(q, k[:, :, idx], v[:, :, idx], None)
        assert torch.equal(scattered, packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", cpu_attention.HEAD_DIMS)
def test_causal_rows_sharing_their_keys_keep_their_bits(dtype: torch.dtype, D: int) -> None:
    """A chain's verification: T causal rows over a cached prefix, so rows of one KV head read
    different numbers of keys (not multiples of 16) and are scored together, sharing the keys'
    widening (groups of up to 8 rows: 11 tokens x 3 heads cross the groups' edges). Each row must
    keep the bits of a one-token step over its own keys, here with a tree node's scattered mask
    among them, on one thread and on two."""
    T, K = 11, 157
    q, k, v, _ = _inputs(dtype, B=2, T=T, K=K, D=D)
    mask = torch.ones(2, 1, T, K, dtype=torch.bool).tril(K - T)  # row t: keys 0 .. K - T + t
    scattered = [0, 5, 17, 40, 99, 150]
    mask[1, 0, 4] = False
    mask[1, 0, 4, scattered] = True
    out = _on_one_and_two_threads(q, k, v, mask)
    for b in range(2):
        for t in range(T):
            keys = scattered if (b, t) == (1, 4) else list(range(K - T + t + 1))
            idx = torch.tensor(keys)
            qt = q[b : b + 1, :, t : t + 1]
            alone = cpu_attention.attend(qt, k[b : b + 1, :, idx], v[b : b + 1, :, idx], None)
            assert torch.equal(alone, out[b : b + 1, :, t : t + 1]), (b, t)


def test_thread_count_does_not_change_the_bits() -> None:
    _on_one_and_two_threads(*_inputs(torch.bfloat16, B=2, T=4, K=300))


def _on_one_and_two_threads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The kernel's output on one thread and on (at least) two, asserted bitwise equal."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.attend(q, k, v, mask)
        torch.set_num_threads(max(2, threads))
        many = cpu_attention.attend(q, k, v, mask)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    return many


def test_output_is_laid_out_for_the_callers_reshape() -> None:
    """(B, H, T, D) viewed over a (B, T, H, D) buffer: cached_attention's transpose and reshape
    to (B, T, H * D) then copy nothing."""
    q, k, v, mask = _inputs(torch.float32)
    out = cpu_attention.attend(q, k, v, mask)
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_takes_the_kernel_eagerly_and_compiled(dtype: torch.dtype) -> None:
    q, k, v, mask = _inputs(dtype)
    kernel = cpu_attention.attend(q, k, v, mask)
    assert torch.equal(attend(q, k, v, mask, causal=False), kernel)
    compiled = torch.compile(lambda *a: attend(*a, causal=False), backend="eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v, mask), kernel)


def test_attend_keeps_other_shapes_off_the_kernel() -> None:
    """Head dims it was not built for and fp16 take PyTorch's attention; any number of queries
    (a whole prefill's, with its causal mask: cache.KVCache.plan) takes the kernel."""
    q, k, v, _ = _inputs(torch.float32, D=64)
    assert cpu_attention.fits(q, k)
    q16, k16, _, _ = _inputs(torch.float32, D=16)
    assert not cpu_attention.fits(q16, k16)
    assert not cpu_attention.fits(q.half(), k.half())
    qlong, klong, _, _ = _inputs(torch.float32, T=300)
    assert cpu_attention.fits(qlong, klong)


def test_bad_arguments_raise() -> None:
    q, k, v, mask = _inputs(torch.float32)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_attention.attend(q, k.bfloat16(), v, mask)
    with pytest.raises(RuntimeError, match=r"mask must be \(B, 1, T, K\) bool"):
        cpu_attention.attend(q, k, v, mask[..., :-1])
    with pytest.raises(RuntimeError, match=r"mask must be \(B, 1, T, K\) bool"):
        cpu_attention.attend(q, k, v, mask.expand(-1, 9, -1, -1))  # one mask per head
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        cpu_attention.attend(q[:, :8], k, v, mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", cpu_attention.HEAD_DIMS)
def test_the_avx2_path_gives_the_avx512_bits(dtype: torch.dtype, D: int) -> None:
    """Where the CPU has AVX-512, the AVX2 path (what x86-64-v3 CPUs run) can be asked for: it
    gives every row the AVX-512 path's bits, unmasked, under a causal prefix mask (the shared
    rows' path there) and under a tree's mask."""
    ops = torch.ops.eaglespec_attention
    if ops.use_avx2(False):
        pytest.skip("no AVX-512 here: the AVX2 path is the only one")
    try:
        for T, K in ((1, 150), (3, 37), (17, 300)):
            q, k, v, mask = _inputs(dtype, T=T, K=K, D=D)
            causal = torch.ones(T, K, dtype=torch.bool).tril(K - T)[None, None].expand(2, 1, T, K)
            for m in (None, causal.contiguous(), mask):
                got = []
                for avx2 in (True, False):
                    assert ops.use_avx2(avx2) == avx2
                    got.append(cpu_attention.attend(q, k, v, m))
                assert torch.equal(got[0], got[1]), (T, K)
    finally:
        ops.use_avx2(False)
