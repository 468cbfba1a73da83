"""int4 and int8 weights x int8 activations on CPU: eaglespec's own matmul kernels
(csrc/w4a8.cpp), the layers of `--quant w4a8` (4-bit decoder, 8-bit output head) and `w4a8-all`
(4-bit output head too).

Dims: M rows (B * T flattened), K in features, N out features, G = 32 features per group.

Weights are int4's codes (quant.int4_codes: per group of 32 inputs, codes q in 0..15 and a scale);
the scale s and the group minimum mn are stored as fp16, GGUF's own type for them, and the codes
are fitted against the fp16 scale (int4_group_codes), so w = q * s + mn. From a GGUF Q4_1 tensor
dequantized to fp32 that is the file's codes, d and m exactly (tests/test_w4a8.py, on blocks from
the gguf package's own quantizer). The loader, though, quantizes from weights already cast to
the model dtype (bf16 by default), so a Q4_1 group's s and mn come back within bf16 rounding of
the file's d and m (measured 2026-11-26 on SmolLM2, one layer's w2: up to 0.0073 off; quantizing
from fp32 instead moved the default precision's NLL of fp32's own text by 0.001 nats and its
top-1 not at all).

Activations are quantized per row and per group to int8 inside the kernel, as llama.cpp does
for its 4-bit formats (Q8_0 activations for Q4_0/Q4_1, Q8_K for the K-quants):

    dx[m, g] = absmax_g |x[m, :]| / 127,  xq[m, k] = round(x[m, k] / dx[m, g])   (int8)
    y[m, n]  = sum_g s[n, g] * dx[m, g] * sum_{k in g} q[n, k] * xq[m, k]
             + sum_g mn[n, g] * sum_{k in g} x[m, k]

The inner sums are exact int32 dot products of unsigned 4-bit and signed 8-bit codes, which
AVX-512 VNNI computes 64 at a time (vpdpbusd); one float multiply-add per group and row remains.
PyTorch's int4 kernel instead turns every weight into a float before its multiply-add, which
holds it to about 20 GB/s of weights on this project's 2-core VM; this kernel streams 29-39 GB/s
(cold weights, two threads, all of Qwen2.5-Coder-1.5B's decoder matrices;
docs/benchmark-history.md).

The output head of `w4a8` (`W8A8Linear`) runs 8-bit weights against the same int8 activations,
GGUF's Q8_0 (w = d * q per group of 32, q in -127..127, d fp16; SmolLM2's file stores its head
so) as llama.cpp computes it:

    y[m, n]  = sum_g s[n, g] * dx[m, g] * sum_{k in g} q[n, k] * xq[m, k]

It replaced torch's `_weight_int8pack_mm` (per-channel int8 weights, bf16 activations), which took
4.3 ms of a 12.5 ms eager SmolLM2 decode step for the 49,152 x 576 head, 6.6 GB/s of weights
(torch profiler, 2 threads, 2026-11-25).

Layout (`pack`): output rows in blocks of 16, one per int32 lane, each block one contiguous run
of group records (codes, scales, minimums), so each thread reads its share of a matrix as one
sequential stream; N is padded to a multiple of 16 with rows never stored.

Rows: each group's weights are loaded (4 bits: unpacked) once and serve a tile of up to 8
activation rows whose accumulators stay in registers, so extra rows cost their vpdpbusd and float
scaling while the weights stream once; rows go in chunks that stay in L2 (long prefills). One
kernel for every M: decode, verification, batched decoding and prefill (benchmarks/roofline.py
measures each M against this machine's bandwidth and VNNI peak; docs/benchmark-history.md).

AMX (Intel Sapphire Rapids on, where Linux grants the tile state): tiles of 16 rows take each
group's dot products from one tile multiply (TDPBSUD) instead of 8 vpdpbusd and 8 broadcasts per
row; the integer sums are exact, so they are the VNNI path's, and the float epilogue is shared,
so the bits are the same (tests/test_w4a8.py, every row count, on and off). What is left per
group and row is that epilogue and the tile store it reads. Measured (2026-11-27, 2 threads, a VM
whose two cores reached 5.7 G vpdpbusd/s that hour; both paths interleaved in one process):
Qwen2.5-1.5B's four decoder matrices 1.23-1.30x at 32-128 rows, a 16,384-row 8-bit head 1.4x;
SmolLM2 plain greedy decoding of 32 rows 562 against 472 tok/s, of 64 rows 586 against 462
(`python benchmarks/batched_decode.py --amx both`). A forward of 8 to 15 rows (a verification
of a long chain or a tree) takes the 8-bit head's dot products from one tile of its own height:
on SmolLM2's head 1.08x at 8 rows, 1.29x at 12, 1.35x at 15, and on Qwen2.5-1.5B's 0.98x at 8,
1.39x at 12 (`python benchmarks/roofline.py --amx both --amx-min-rows 1`, 2026-11-27); below 8
rows, and for the 4-bit decoder below 16 (0.58x at one row, 0.78x at 8: unpacking a block into
a buffer and the tile's store and read-back cost more than the vpdpbusd they save), VNNI is
faster. `torch.ops.eaglespec_w4a8.use_amx(False)` turns AMX off and `amx_min_rows(bits, rows)`
moves the crossover (benchmarks and tests compare the paths: the bits are the same).

Row independence: every (m, n) goes through the same instructions in the same order whatever M
is, whatever its tile and however the output rows are split among threads, so row b of a forward
over M rows is bitwise equal to the same row alone, as for the other kernels (tests/test_w4a8.py,
1 to 457 rows).

Speculation over a w4a8 target: run it in bfloat16, its intended dtype (and what `--quant auto`
picks for a 4-bit GGUF, model/precision.py). Greedy speculation reproduces plain decoding token for
token for certain when a verified token's logits are bitwise a one-token step's; int8 activation
codes are coarse (a step is 1/127 of the group's largest value), so a code sitting at .5 flips by a
whole step on the last bit of its input and can turn a near-tie. On AVX-512 CPUs every op of the
forward is computed row by row now: this kernel, the int8 head, eaglespec's attention kernel
(model/cpu_attention.py, whose sums also do not depend on where masked keys sit: a tree's
verification once differed from plain decoding 43 tokens in through that alone). The greedy-
identity tests run w4a8 in bf16 eager, block- and full-compiled (tests/test_compile.py; full needs
inductor's precision-cast emulation, llama.py), and on SmolLM2 with the shipped head in chains and
trees (tests/test_real_spec.py). Elsewhere (fp32 attention in other orders, other CPUs) it is
bitwise by test, not by construction.

AVX2 (x86-64-v3: AMD Zen 1-3, Intel client cores without AVX-512): the same packed weights
through 8-lane registers, a block's 16 output rows as two halves of 8, each group's dot products
from vpmaddubsw and vpmaddwd (exact integer sums, as vpdpbusd's) and the same float epilogue in
the same order, so the same bits as the AVX-512 path (tests/test_w4a8.py compares the two where
both run; `torch.ops.eaglespec_w4a8.use_avx2(True)` asks for it there). Measured on a 2-core AMD
EPYC (Zen 3) VM without AVX-512, 2026-11-28: SmolLM2 plain decoding at the default precision 125
tok/s against 36 with the 4-bit kernel alone (PyTorch's bf16 ops around it) and 18 in fp32, what
`--quant auto` chose there before (`python benchmarks/cpu_decode.py --no-llamacpp`).

The kernel is compiled on first use for the machine at hand (torch.utils.cpp_extension with
ninja and a C++ compiler, about 15 s, cached under torch's extension directory) and needs an x86
CPU with AVX-512 VNNI or AVX2 (with FMA and F16C); `available()` says why not where it cannot
run, and the modes then refuse with that reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from eaglespec.errors import InvalidRequestError
from eaglespec.model.dequant import BlockFields
from eaglespec.model.extension import build
from eaglespec.model.quant import INT4_GROUP, _check_cpu, _QuantLinear, int4_codes

GROUP = INT4_GROUP  # int4's groups: the codes are int4_codes'
ROWS = 16  # output rows per weight block: one per int32 lane of a 512-bit register
# Codes a fit or a packing takes at a time (loads fit and pack a matrix in row pieces, the same
# bytes as whole: both work per group and per block of ROWS rows).
FIT_VALUES = 1 << 22


@functools.cache
def _load() -> str | None:
    """Build and load the kernel once per process; None if it runs here, else why not."""
    reason = build("w4a8", needs="an x86 CPU with AVX2 (FMA, F16C) or AVX-512 VNNI")
    if reason is not None:
        return reason

    @torch.library.register_fake("eaglespec_w4a8::linear")  # type: ignore[untyped-decorator]
    def _(x: torch.Tensor, w: torch.Tensor, N: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], N)  # (M, N), x's dtype

    @torch.library.register_fake("eaglespec_w4a8::linear8")  # type: ignore[untyped-decorator]
    def _fake8(x: torch.Tensor, w: torch.Tensor, N: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], N)

    return None


def available() -> str | None:
    """None when the kernel runs on this machine, else the reason it does not."""
    return _load()


def require() -> None:
    reason = _load()
    if reason is not None:
        raise InvalidRequestError(f"--quant w4a8: {reason}; use --quant int4")


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """(N, ...) -> (ceil(N / ROWS) * ROWS, ...), zero rows appended (the kernel never stores
    their outputs)."""
    pad = -t.shape[0] % ROWS
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def pack(q: torch.Tensor, s: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in 0..15, (N, K/G) scales and minimums -> the kernel's blocked bytes, 1-D
    uint8 of ceil(N/16) * K/G * 320 (csrc/w4a8.cpp's header has the layout).

    Output rows go in blocks of ROWS = 16, one per int32 lane; each block is one contiguous run
    of group records, so a thread reads its share of the matrix as a single sequential stream.
    A group record: 4 loads of 64 bytes (lane i's 4 bytes of load L hold row i's features
    8L..8L+3 in the low nibbles and 8L+4..8L+7 in the high ones), the 16 rows' fp16 scales, then
    their fp16 minimums."""
    return _by_blocks(_pack_rows, q, s, mn)


def _pack_rows(q: torch.Tensor, s: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    ng = q.shape[1] // GROUP
    b = _pad_rows(q.to(torch.uint8)).view(-1, ROWS, ng, 4, 2, 4)  # (block, row, g, L, nib, byte)
    b = b[:, :, :, :, 0] | (b[:, :, :, :, 1] << 4)  # (block, row, group, L, byte)
    codes = b.permute(0, 2, 3, 1, 4).reshape(-1, ng, 4 * ROWS * 4)  # (block, group, 256)
    return torch.cat([codes, _f16_bytes(s), _f16_bytes(mn)], 2).reshape(-1)


def _by_blocks(
    fn: Callable[..., torch.Tensor], q: torch.Tensor, *per_row: torch.Tensor
) -> torch.Tensor:
    """fn's packed bytes of (N, K) codes and their per-row fields, made a whole number of
    ROWS-row blocks at a time (about FIT_VALUES codes) and joined: each block's bytes are one
    contiguous run, so the pieces joined are the whole matrix packed at once, without its
    temporaries (several bytes a code) held whole."""
    step = max(ROWS, FIT_VALUES // q.shape[1] // ROWS * ROWS)
    parts = [
        fn(q[r : r + step], *(t[r : r + step] for t in per_row)) for r in range(0, q.shape[0], step)
    ]
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)


def _f16_bytes(t: torch.Tensor) -> torch.Tensor:
    """(N, K/G) scales or minimums -> (blocks, K/G, 32) bytes: per block and group, the 16 rows'
    values as fp16, as a group record holds them."""
    t16 = _pad_rows(t.to(torch.float16)).view(-1, ROWS, t.shape[1]).transpose(1, 2).contiguous()
    return t16.view(torch.uint8)


def pack8(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 codes in -127..127 and (N, K/G) scales -> the 8-bit kernel's blocked bytes,
    1-D uint8 of ceil(N/16) * K/G * 544 (csrc/w4a8.cpp's header has the layout): per block of
    ROWS output rows and group, 8 steps of 16 lanes x 4 bytes (lane i of step t: row i's
    features 4t..4t+3, stored as q + 128), then the 16 rows' fp16 scales."""
    return _by_blocks(_pack8_rows, q, s)


def _pack8_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    ng = q.shape[1] // GROUP
    u = (_pad_rows(q.to(torch.int16)) + 128).to(torch.uint8).view(-1, ROWS, ng, 8, 4)
    codes = u.permute(0, 2, 3, 1, 4).reshape(-1, ng, 8 * ROWS * 4)  # (block, group, 512)
    return torch.cat([codes, _f16_bytes(s)], 2).reshape(-1)


def unpack(w: torch.Tensor, N: int, K: int) -> tuple[torch.Tensor, ...]:
    """`pack`'s inverse: the blocked bytes -> (N, K) uint8 codes and (N, K/G) fp32 scales and
    minimums."""
    ng = K // GROUP
    rec = w.view(-1, ng, 320)  # (block, group, record)
    b = rec[..., :256].reshape(-1, ng, 4, ROWS, 4)  # (block, group, L, row, byte)
    b = b.permute(0, 3, 1, 2, 4)  # (block, row, group, L, byte)
    q = torch.stack([b & 15, b >> 4], 4)  # (block, row, group, L, nib, byte)
    return (
        q.reshape(-1, K)[:N],
        _f16_values(rec[..., 256:288], N),
        _f16_values(rec[..., 288:320], N),
    )


def unpack8(w: torch.Tensor, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack8`'s inverse: the blocked bytes -> (N, K) int8 codes and (N, K/G) fp32 scales."""
    ng = K // GROUP
    rec = w.view(-1, ng, 544)  # (block, group, record)
    u = rec[..., :512].reshape(-1, ng, 8, ROWS, 4).permute(0, 3, 1, 2, 4)  # (block, row, g, t, b)
    q = (u.to(torch.int16) - 128).to(torch.int8)
    return q.reshape(-1, K)[:N], _f16_values(rec[..., 512:544], N)


def _dense4(w: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """(N, K) fp32 weights of `pack`'s blocked bytes: q * s + mn."""
    q, s, mn = unpack(w, N, K)
    return q.float() * s.repeat_interleave(GROUP, 1) + mn.repeat_interleave(GROUP, 1)


def _dense8(w: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """(N, K) fp32 weights of `pack8`'s blocked bytes: q * s."""
    q, s = unpack8(w, N, K)
    return q.float() * s.repeat_interleave(GROUP, 1)


_GATHER_BLOCKS = 64  # weight blocks of ROWS rows that `_gather_rows` unpacks at once


def _gather_rows(
    w: torch.Tensor,  # blocked bytes of an (N, K) weight, `record` bytes per block and group
    N: int,
    K: int,
    ids: torch.Tensor,  # (R,) int64 row ids in [0, N)
    record: int,
    dense: Callable[[torch.Tensor, int, int], torch.Tensor],  # `_dense4` or `_dense8`
) -> torch.Tensor:
    """(R, K) fp32 rows `ids` of the weight. A block's ROWS rows are contiguous in `w`, so a
    chunk of blocks is a slice: it is unpacked alone, and only chunks holding a wanted row."""
    ids = ids.to(torch.int64).cpu()
    if len(ids) and not (int(ids.min()) >= 0 and int(ids.max()) < N):  # host sync: checks
        raise IndexError(f"row ids must be in [0, {N})")
    blocks = w.view(-1, (K // GROUP) * record)  # (N/ROWS, bytes per block)
    out = torch.empty(len(ids), K)
    span = _GATHER_BLOCKS * ROWS
    for r0 in range(0, N, span):
        here = ((ids >= r0) & (ids < r0 + span)).nonzero().flatten()  # (h,) positions in ids
        if len(here):
            chunk = blocks[r0 // ROWS : (r0 + span) // ROWS].reshape(-1)
            out[here] = dense(chunk, min(N - r0, span), K)[ids[here] - r0]
    return out


def _f16_values(b: torch.Tensor, N: int) -> torch.Tensor:
    """(blocks, K/G, 32) bytes of a group record's fp16 field -> (N, K/G) fp32 (`_f16_bytes`'s
    inverse)."""
    t16 = b.contiguous().view(torch.float16)  # (blocks, K/G, ROWS)
    return t16.transpose(1, 2).reshape(-1, b.shape[1])[:N].float()


def int4_group_codes(
    w: torch.Tensor, *, fit_spans: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) weights -> int4's codes (N, K), scales and group minimums (N, K/G), the scales
    rounded to fp16 as they are stored (quant.int4_codes, `fit_spans` its search for groups on a
    coarser grid). On a Q4_1 or Q4_0 tensor dequantized to fp32 this recovers the file's codes,
    scales and minimums exactly."""
    return int4_codes(w.float(), scale_dtype=torch.float16, fit_spans=fit_spans)


def int8_group_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) weights -> (N, K) int8 codes in -127..127 and (N, K/G) fp16 scales, symmetric per
    group of 32 (GGUF's Q8_0): s = fp16(absmax / 127), q = round(w / s), so w ≈ s * q exactly as
    the kernel multiplies. On a Q8_0 tensor this recovers the file's codes (the scale up to the
    model dtype's rounding of the dequantized weights)."""
    N, K = w.shape
    wg = w.float().view(N, K // GROUP, GROUP)
    s = (wg.abs().amax(-1) / 127).half()  # (N, ng)
    s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group: any scale, codes 0
    q = (wg / s.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q.view(N, K), s


def from_fields(fields: BlockFields, bias: torch.Tensor | None) -> nn.Module:
    """A layer multiplying by the weights `fields` hold (dequant.BlockFields): 4-bit ones as
    W4A8Linear, 8-bit ones (codes in -127..127) as W8A8Linear. From a GGUF's blocks as stored,
    no dequantizing and no re-fitting (loader.source_fields)."""
    if fields.bits == 4:
        assert fields.offsets is not None
        return W4A8Linear(fields.codes, fields.scales, fields.offsets, bias)
    return W8A8Linear(fields.codes, fields.scales, bias)


def fit_fields(w: torch.Tensor, bits: int, *, fit_spans: bool = True) -> BlockFields:
    """(N, K) weights -> the fields from_linear would pack for them at `bits`: 4 bits through
    int4_group_codes (`fit_spans`: quant.int4_codes' search for groups on a coarser grid, which
    only weights from 4-bit blocks have), 8 through int8_group_codes. Per group of 32, so rows
    fitted apart are the rows fitted together: fitted FIT_VALUES at a time, whose float32
    temporaries stay small (Qwen2.5-Coder-1.5B's 151,936 x 1,536 output head fitted whole held
    about 2 GB of them, the peak of its load)."""
    step = max(1, FIT_VALUES // w.shape[1])
    return BlockFields.stack_rows(
        [_fit_rows(w[r : r + step], bits, fit_spans) for r in range(0, w.shape[0], step)]
    )


def _fit_rows(w: torch.Tensor, bits: int, fit_spans: bool) -> BlockFields:
    if bits == 8:
        q8, s8 = int8_group_codes(w)
        return BlockFields(8, q8, s8, None)
    q, s, lo = int4_group_codes(w, fit_spans=fit_spans)
    return BlockFields(4, q.to(torch.uint8), s.half(), lo.half())


def _quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(M, K) -> fp32 groups (M, ng, G), int8 codes as floats (M, ng, G), scales dx (M, ng)."""
    M, K = x.shape
    xf = x.float().view(M, K // GROUP, GROUP)
    amax = xf.abs().amax(-1)  # (M, ng)
    # 127.0 / amax as the kernel divides; torch's `127 / amax` is reciprocal-then-multiply, which
    # can differ by an ulp and move a code that sits at .5 (found by the tests)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = (xf * inv[..., None]).round().clamp(-127, 127)  # (M, ng, G)
    return xf, xq, amax / 127


def reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """The 4-bit kernel's math in plain torch, fp32 (for tests): (M, K) x, (N, K) codes,
    (N, K/G) scales and minimums -> (M, N)."""
    xf, xq, dx = _quantize_activations(x)
    ng = xq.shape[1]
    dots = torch.einsum("mgk,ngk->mng", xq, q.float().view(-1, ng, GROUP))  # (M, N, ng)
    scaled = dots * s.float()[None] * dx[:, None, :]
    return scaled.sum(-1) + (mn.float()[None] * xf.sum(-1)[:, None, :]).sum(-1)


def reference8(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The 8-bit kernel's math in plain torch, fp32 (for tests): (M, K) x, (N, K) int8 codes,
    (N, K/G) scales -> (M, N)."""
    _, xq, dx = _quantize_activations(x)
    ng = xq.shape[1]
    dots = torch.einsum("mgk,ngk->mng", xq, q.float().view(-1, ng, GROUP))  # (M, N, ng)
    return (dots * s.float()[None] * dx[:, None, :]).sum(-1)


def _check_shape(N: int, K: int) -> None:
    if K % GROUP:
        raise InvalidRequestError(
            f"w4a8 quantization needs in_features divisible by {GROUP}, got a ({N}, {K}) weight"
        )


def _store(
    layer: _QuantLinear,
    codes: torch.Tensor,  # (N, K)
    packed: Callable[[], torch.Tensor],  # the kernel's bytes, made once the checks pass
    bias: torch.Tensor | None,  # (N,)
) -> None:
    """What both kernels' layers keep: the shape checks, the packed weight, the bias."""
    require()
    N, K = codes.shape
    _check_shape(N, K)
    _check_cpu("w4a8", codes)
    layer.in_features, layer.out_features = K, N
    layer.register_buffer("weight", packed())
    layer.register_buffer("bias", bias)


class W4A8Linear(_QuantLinear):
    """y = x @ w.T + b with w[o, i] = q[o, i] * s[o, i // G] + mn[o, i // G], activations
    quantized to int8 per group inside the kernel (module doc)."""

    weight: torch.Tensor  # (N/4 * K/G * 80,) uint8: codes, scales and minimums, blocked

    def __init__(
        self,
        codes: torch.Tensor,  # (N, K) integer codes in 0..15
        scales: torch.Tensor,  # (N, K/G)
        mins: torch.Tensor,  # (N, K/G)
        bias: torch.Tensor | None = None,  # (N,)
    ) -> None:
        super().__init__()
        _store(self, codes, lambda: pack(codes, scales, mins), bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> W4A8Linear:
        """int4's codes and scales (quant.int4_codes; see the module doc on exactness), with the
        group minimum itself as the offset."""
        _check_shape(*linear.weight.shape)
        fields = fit_fields(linear.weight.detach(), 4)  # in pieces: a large layer's temporaries
        assert fields.offsets is not None
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(fields.codes, fields.scales, fields.offsets, bias)

    def dequantize(self) -> torch.Tensor:
        """(N, K) fp32: q * s + mn, the weight the kernel multiplies activations by."""
        return _dense4(self.weight, self.out_features, self.in_features)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(len(ids), K) fp32: rows `ids` of `dequantize()`, a chunk of weight blocks at a time."""
        return _gather_rows(self.weight, self.out_features, self.in_features, ids, 320, _dense4)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        # (M, K) fp32 or bf16 -> (M, N) in x2's dtype
        y: torch.Tensor = torch.ops.eaglespec_w4a8.linear(x2, self.weight, self.out_features)
        return y


class W8A8Linear(_QuantLinear):
    """y = x @ w.T + b with w[o, i] = q[o, i] * s[o, i // G], q int8, activations quantized to
    int8 per group inside the kernel (module doc): `w4a8`'s output head."""

    weight: torch.Tensor  # (N/4 * K/G * 136,) uint8: codes and scales, blocked

    def __init__(
        self,
        codes: torch.Tensor,  # (N, K) integer codes in -127..127
        scales: torch.Tensor,  # (N, K/G)
        bias: torch.Tensor | None = None,  # (N,)
    ) -> None:
        super().__init__()
        _store(self, codes, lambda: pack8(codes, scales), bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> W8A8Linear:
        _check_shape(*linear.weight.shape)
        fields = fit_fields(linear.weight.detach(), 8)  # in pieces: a large head's temporaries
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(fields.codes, fields.scales, bias)

    def dequantize(self) -> torch.Tensor:
        """(N, K) fp32: q * s, the weight the kernel multiplies activations by."""
        return _dense8(self.weight, self.out_features, self.in_features)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(len(ids), K) fp32: rows `ids` of `dequantize()`, a chunk of weight blocks at a time
        (the draft vocabulary's rows of a 151,936-row output head without its 933 MB dense)."""
        return _gather_rows(self.weight, self.out_features, self.in_features, ids, 544, _dense8)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        # (M, K) fp32 or bf16 -> (M, N) in x2's dtype
        y: torch.Tensor = torch.ops.eaglespec_w4a8.linear8(x2, self.weight, self.out_features)
        return y
