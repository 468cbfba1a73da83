"""Weight-only quantization of a model's linear layers (int8 per channel, int4 per group), for
weight-bandwidth-bound CPU decode.

## int8

Dims: M rows (B * T flattened), K in features, N out features.

Per-output-channel symmetric int8, with the scale rounded to bf16 first (the kernel's scale dtype)
and the codes taken against that rounded scale, so the weight the kernel multiplies by is exactly

    s[o] = bf16(absmax_o / 127),  absmax_o = max_i |w[o, i]|
    q[o, i] = clamp(round(w[o, i] / s[o]), -127, 127)      (int8; -128 is never used)
    w[o, i] ≈ s[o] * q[o, i],  |error| <= s[o] / 2

The clamp costs nothing extra: bf16 rounding moves s by at most 2^-9 relative, so |w| / s <= 127.25
and a clamped absmax element is within s / 4 of 127 * s.

The matmul is `torch._weight_int8pack_mm`, and the layer is CPU only: upstream's CUDA version of
the op is a plain per-output loop (aten/src/ATen/native/cuda/int8mm.cu), not measured here.
Its x86 requirements, checked here because a violation is a crash or silent garbage, not an
error: x 2-D, contiguous and 32-byte aligned (the AVX-512 kernel uses aligned loads: a misaligned
view segfaults); K a multiple of 16 (the AVX-512 loop steps K by 16 with no tail: other K read
past the row and return NaN); scales 1-D (N,) in the dtype of x.

Activations: the kernel is vectorised only for bf16 activations. With fp32 or fp16 activations
torch falls back to a scalar loop (measured on this project's AVX-512 VM for SmolLM2's 121 decode
matmuls: 100-104 ms fp32 and 140-158 ms fp16, against 13-14 ms bf16 and 29-33 ms dense fp32).
So `Int8Linear` always runs the kernel in bf16: fp32/fp16 inputs are cast to bf16 and the output is
cast back (14.5-15 ms for the same matmuls, still 2x faster than dense fp32). In an fp32 model the
norms, attention and residual stream stay fp32; only the matmul inputs are rounded to bf16.

Rows: the kernel's time grows about linearly with M (measured: about 2.7 ms more per row for
SmolLM2's 120 decoder matmuls; 170 ms at M = 64) while a dense fp32 GEMM barely grows (100 ms).
Above `KERNEL_MAX_ROWS` rows (long prefills, big verify trees) the layer dequantizes the weight to
fp32 and runs a dense fp32 matmul instead (same weight values, fp32 activations).

## int4
Group-wise asymmetric 4-bit codes, G = 32 consecutive input features per group (the block of
GGUF's Q4_0/Q4_1/Q4_K formats), min-max per group, scale and zero rounded to bf16 first:

    s[o, g] = bf16((max - min) / 15)           over w[o, g*G : (g+1)*G]   (1 where max == min)
    q[o, i] = clamp(round((w[o, i] - min) / s[o, g]), 0, 15)
    z[o, g] = bf16(min + 8 * s[o, g])
    w[o, i] ≈ (q[o, i] - 8) * s[o, g] + z[o, g]   (the kernel's formula)

A GGUF Q4_1 block stores w = d * q + m with q spanning 0..15, so min-max recovers d and m and the
codes exactly; the only change from the file's weights is rounding d and m + 8d from fp16 to bf16.
A group that lies exactly on a coarser grid (a Q4_K sub-block whose codes do not reach both 0 and
15) gets its own span n < 15 instead of 15, s = (max - min) / n, so its codes come back exactly
too (`code_spans`).

The matmul is `torch._weight_int4pack_mm_for_cpu` on codes packed by
`torch._convert_weight_to_int4pack_for_cpu` ((N, K) int32 -> (N, K/2) uint8). Its requirements,
checked here: N a multiple of 16, K a multiple of G, scales-and-zeros (K/G, N, 2) in the dtype
of x. Like int8 it is vectorised for bf16 activations only (measured for SmolLM2's 121 decode
matmuls: 5.3 ms with bf16 x, 122 ms with fp32 x), so the layer always runs it in bf16. Its cost
grows with the rows M (SmolLM2, all 121 matmuls, weights cold in cache: 5.3 / 6.7 / 7.9 / 13.9 /
27.8 ms at M = 1 / 2 / 4 / 8 / 16; int8 16.0 / 15.1 / 15.2 / 26.9 / 54.3; dense bf16 28.5 / 20.5
/ 36.1 / 25.2 / 33.9), and it stays the faster choice up to M = 16, so there is no dense path.

## int4-all
int4 for the output head as well. The head is the largest single matrix of small models with big
vocabularies (Qwen2.5-0.5B: 151,936 x 896, 136 MB at int8, a third of a decode step's weight
bytes), so int4 there buys speed where int8 costs most. Measured (docs/benchmark-history.md,
2026-11-24): Qwen2.5-Coder-0.5B decode 31.4 -> 37.7 tok/s with the same accuracy as int4 (mean NLL
+0.028 vs +0.030 over fp32; the 4-bit decoder dominates the error), SmolLM2 64 -> 70 tok/s but its
NLL rises from -0.002 to +0.034 (its Q8_0 head is re-rounded onto 4 bits, while its Q4_1 decoder is
exact).

Every kernel here computes each row of x on its own: row b of a forward over M rows is bitwise
equal to the same row alone (checked in tests), which keeps speculative verification of M tokens
consistent with one-token decode steps.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from eaglespec.errors import InvalidRequestError

QUANT_MODES = ("none", "int8", "int4", "int4-all", "w4a8", "w4a8-all", "w4a8-mixed")
KERNEL_DTYPE = torch.bfloat16  # the one activation dtype the CPU int8 kernel vectorises
KERNEL_MAX_ROWS = 64  # above this many rows, dequantize + dense fp32 is faster (measured, M=64)
K_MULTIPLE = 16  # the AVX-512 kernel's step over K
INT4_GROUP = 32  # input features per int4 group (GGUF's Q4 block size)
INT4_N_MULTIPLE = 16  # the int4 packing's block of output features
_ALIGN = 32  # bytes: the AVX-512 kernel's aligned loads of x and the weight rows


def check_quant_mode(mode: str) -> str:
    """Return `mode` if it is supported, else raise naming the supported modes."""
    if mode not in QUANT_MODES:
        raise InvalidRequestError(
            f"unknown quantization mode '{mode}' (supported: {', '.join(QUANT_MODES)})"
        )
    return mode


def _check_cpu(mode: str, weight: torch.Tensor) -> None:
    if weight.device.type != "cpu":
        raise InvalidRequestError(
            f"{mode} quantization runs on CPU only, the weights are on "
            f"'{weight.device.type}'; use --quant none on this device"
        )


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous with a 32-byte aligned start (a fresh allocation is 64-byte aligned).

    Under torch.compile the address is not known while tracing: the copy is unconditional there
    (one (M, K) activation copy, a few microseconds)."""
    if torch.compiler.is_compiling():
        return t.clone(memory_format=torch.contiguous_format)
    t = t.contiguous()
    return t if t.data_ptr() % _ALIGN == 0 else t.clone()


class _QuantLinear(nn.Module):
    """What the quantized layers share: (..., K) -> (M, K) rows for the kernel, then the model's
    dtype, the bias and the caller's shape back. Subclasses supply `_matmul`."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None  # (N,) in the model's dtype, added after the matmul

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, K) rows in the model's dtype -> (M, N) in any float dtype."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (..., K) -> (..., N) in x's dtype
        *lead, K = x.shape
        assert self.in_features == K, f"input has {K} features, layer expects {self.in_features}"
        y = self._matmul(x.reshape(-1, K)).to(x.dtype)  # (M, N): no-op for bf16 models
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


class Int8Linear(_QuantLinear):
    """y = x @ (s * q).T + b with int8 codes q (N, K), bf16 scales s (N,), optional bias b (N,)."""

    weight: torch.Tensor  # (N, K) int8 codes q
    scales: torch.Tensor  # (N,) bf16 per-output-channel scales s

    def __init__(
        self,
        # (N, K) int8, K a multiple of 16
        weight: torch.Tensor,
        # (N,) bf16
        scales: torch.Tensor,
        # (N,) or None
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        N, K = weight.shape
        assert weight.dtype == torch.int8, f"weight dtype {weight.dtype}, expected int8"
        assert scales.shape == (N,) and scales.dtype == KERNEL_DTYPE, (
            f"scales {tuple(scales.shape)} {scales.dtype}, expected ({N},) {KERNEL_DTYPE}"
        )
        assert bias is None or bias.shape == (N,), f"bias {tuple(bias.shape)} != ({N},)"
        if K % K_MULTIPLE:
            raise InvalidRequestError(
                f"int8 quantization needs in_features divisible by {K_MULTIPLE} "
                f"(the CPU kernel's step), got a ({N}, {K}) weight"
            )
        _check_cpu("int8", weight)
        self.in_features, self.out_features = K, N
        self.register_buffer("weight", _aligned(weight))
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Quantize a dense layer's weight (in whatever dtype it holds) as the module doc says."""
        w = linear.weight.detach().float()  # (N, K)
        absmax = w.abs().amax(dim=1)  # (N,)
        # An all-zero row gets scale 1: its codes are 0 whatever the scale.
        scales = torch.where(absmax > 0, absmax / 127, 1.0).to(KERNEL_DTYPE)  # (N,)
        q = (w / scales.float()[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # (N, K)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scales, bias)

    def dequantize(self) -> torch.Tensor:
        """(N, K) fp32: exactly the weight the kernel multiplies by (s and q widened to fp32)."""
        return self.weight.float() * self.scales.float()[:, None]

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(len(ids), K) fp32: rows `ids` of `dequantize()`."""
        return self.weight[ids].float() * self.scales[ids].float()[:, None]

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if x2.shape[0] > KERNEL_MAX_ROWS:
            return F.linear(x2.float(), self.dequantize())  # (M, N) fp32
        return torch._weight_int8pack_mm(_aligned(x2.to(KERNEL_DTYPE)), self.weight, self.scales)


class Int4Linear(_QuantLinear):
    """y = x @ w.T + b with w[o, i] = (q[o, i] - 8) * s[o, i // G] + z[o, i // G] (module doc)."""

    weight: torch.Tensor  # (N, K/2) uint8: the codes q, packed by the kernel's converter
    scales_zeros: torch.Tensor  # (K/G, N, 2) bf16: [..., 0] = s, [..., 1] = z

    def __init__(
        self,
        # (N, K) int32 codes in [0, 15]
        codes: torch.Tensor,
        # (K/G, N, 2) bf16
        scales_zeros: torch.Tensor,
        # (N,) or None
        bias: torch.Tensor | None = None,
        group_size: int = INT4_GROUP,
    ) -> None:
        super().__init__()
        N, K = codes.shape
        _check_int4_shape(N, K, group_size)
        _check_cpu("int4", codes)
        assert scales_zeros.shape == (K // group_size, N, 2), (
            f"scales_zeros {tuple(scales_zeros.shape)} != {(K // group_size, N, 2)}"
        )
        assert scales_zeros.dtype == KERNEL_DTYPE
        assert bias is None or bias.shape == (N,), f"bias {tuple(bias.shape)} != ({N},)"
        self.in_features, self.out_features, self.group_size = K, N, group_size
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        self.register_buffer("weight", packed)  # (N, K/2) uint8
        self.register_buffer("scales_zeros", scales_zeros.contiguous())
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group_size: int = INT4_GROUP, *, fit_spans: bool = True
    ) -> Int4Linear:
        """Quantize a dense layer's weight (in whatever dtype it holds) as the module doc says;
        `fit_spans=False` is plain min-max over 15 steps (for comparison, benchmarks/)."""
        w = linear.weight.detach().float()  # (N, K)
        N, K = w.shape
        _check_int4_shape(N, K, group_size)
        q, s, lo = int4_codes(w, group_size, fit_spans=fit_spans)
        z = lo + 8 * s  # (N, K/G)
        sz = torch.stack((s, z), -1).transpose(0, 1).to(KERNEL_DTYPE)  # (K/G, N, 2)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q.to(torch.int32), sz, bias, group_size)

    def codes(self) -> torch.Tensor:
        """(N, K) int64 codes q, read back through the kernel (the packed layout is its own)."""
        K, G = self.in_features, self.group_size
        eye = torch.eye(K, dtype=KERNEL_DTYPE)  # (K, K)
        # Row i of eye @ w.T is column i of w, rounded once to bf16: off by at most 2^-9 of
        # |w| <= 8 s + |z|, well inside half a step s / 2 for any group this class builds.
        cols = torch._weight_int4pack_mm_for_cpu(eye, self.weight, G, self.scales_zeros)  # (K, N)
        s, z = self._expanded()  # (N, K) each
        return ((cols.float().T - z) / s + 8).round().long()

    def _expanded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """s and z broadcast to (N, K) fp32."""
        sz = self.scales_zeros.float().transpose(0, 1)  # (N, K/G, 2)
        G = self.group_size
        return sz[..., 0].repeat_interleave(G, 1), sz[..., 1].repeat_interleave(G, 1)

    def dequantize(self) -> torch.Tensor:
        """(N, K) fp32: (q - 8) * s + z, the weight the kernel multiplies by."""
        s, z = self._expanded()
        return (self.codes() - 8).float() * s + z

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        xb = x2.to(KERNEL_DTYPE).contiguous()  # (M, K)
        G, sz = self.group_size, self.scales_zeros
        return torch._weight_int4pack_mm_for_cpu(xb, self.weight, G, sz)  # (M, N) bf16

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, bias={bias}"
        )


def dense_rows(layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(len(ids), K) rows `ids` of `dense_weight(layer)`, without a dense copy of the whole
    matrix where the layer can unpack just those rows (w4a8's: a draft vocabulary's rows of a
    large output head)."""
    if isinstance(layer, nn.Linear):
        return layer.weight.detach()[ids]
    rows = getattr(layer, "dequantize_rows", None)
    if rows is not None:
        out: torch.Tensor = rows(ids)
        return out
    return dense_weight(layer)[ids]


def dense_weight(layer: nn.Module) -> torch.Tensor:
    """(N, K) the weight a linear layer multiplies by: an `nn.Linear`'s own, a quantized layer's
    dequantized (fp32). Training reads the target's output rows through it at any precision."""
    if isinstance(layer, nn.Linear):
        return layer.weight.detach()
    dequantize = getattr(layer, "dequantize", None)
    if dequantize is None:
        raise TypeError(f"{type(layer).__name__} is not a linear layer")
    weight: torch.Tensor = dequantize()
    return weight


def int4_codes(
    w: torch.Tensor,  # (N, K) fp32
    group_size: int = INT4_GROUP,
    *,
    fit_spans: bool = True,
    scale_dtype: torch.dtype = KERNEL_DTYPE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise 4-bit codes of w as the module doc says: (q (N, K) fp32 codes in 0..15,
    s (N, K/G) fp32 scales already rounded to `scale_dtype` (the dtype they are stored in: bf16
    here, fp16 for w4a8 as GGUF stores them), lo (N, K/G) fp32 group minimums), with
    w ~= q * s + lo. `fit_spans=False` is plain min-max over 15 steps."""
    N, K = w.shape
    wg = w.view(N, K // group_size, group_size)  # (N, K/G, G)
    lo, hi = wg.amin(-1), wg.amax(-1)  # (N, K/G)
    span = code_spans(wg, lo, hi) if fit_spans else torch.full(lo.shape, 15)  # (N, K/G)
    s = torch.where(hi > lo, (hi - lo) / span, 1.0).to(scale_dtype).float()  # (N, K/G)
    q = ((wg - lo[..., None]) / s[..., None]).round_().clamp_(0, 15)  # (N, K/G, G)
    return q.view(N, K), s, lo


def code_spans(
    wg: torch.Tensor,  # (N, K/G, G) fp32 weights by group
    lo: torch.Tensor,  # (N, K/G) each group's min
    hi: torch.Tensor,  # (N, K/G) each group's max
    tol: float = 0.1,
) -> torch.Tensor:
    """(N, K/G) int64: the number of 4-bit steps n each group spans, 15 unless the group already
    lies on a coarser grid lo + s * j, j in 0..n, n in 8..14 (then the largest such n).

    A GGUF Q4_K sub-block stores w = d * sc * q - dmin * m with q in 0..15, but its fitted
    scale rarely uses both ends: in Qwen2.5-Coder-1.5B's Q4_K tensors about 21% of the groups
    span fewer than 15 steps, and min-max over 15 steps re-rounds every weight of those groups.
    With their own span the codes come back exactly (Q4_1 and Q4_0 blocks always span 15).
    `tol` (in steps) absorbs a bf16 model dtype's rounding of the dequantized weights (at most
    about 0.03 steps); weights off any grid (dense checkpoints, 5- and 6-bit GGUF types) keep 15."""
    span = torch.full(lo.shape, 15, dtype=torch.long)
    width = (hi - lo).clamp(min=torch.finfo(torch.float32).tiny)  # (N, K/G)
    off = ~_on_grid(wg, lo, width / 15, tol)  # (N, K/G) groups min-max would re-round
    for n in range(14, 7, -1):
        if not bool(off.any()):  # host sync, once per candidate at load
            break
        idx = off.nonzero(as_tuple=True)
        fits = _on_grid(wg[idx], lo[idx], width[idx] / n, tol)  # (M,)
        span[idx[0][fits], idx[1][fits]] = n
        off[idx[0][fits], idx[1][fits]] = False
    return span


def _on_grid(wg: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, tol: float) -> torch.Tensor:
    """(...) bool: every weight of the group is within `tol` steps of lo + step * j."""
    x = (wg - lo[..., None]) / step[..., None]  # (..., G)
    return (x - x.round()).abs().amax(-1) < tol


def _int4_fits(N: int, K: int, group_size: int = INT4_GROUP) -> bool:
    """The int4 kernel takes an (N, K) weight: whole groups along K, whole packing blocks of N."""
    return K % group_size == 0 and N % INT4_N_MULTIPLE == 0


def _check_int4_shape(N: int, K: int, group_size: int) -> None:
    if not _int4_fits(N, K, group_size):
        raise InvalidRequestError(
            f"int4 quantization needs in_features divisible by {group_size} (the group) and "
            f"out_features divisible by {INT4_N_MULTIPLE} (the kernel's packing), got a "
            f"({N}, {K}) weight; use --quant int8"
        )


def _int4_if_it_fits(linear: nn.Linear) -> nn.Module:
    """int4-all's output head: int4, or int8 for a vocabulary the int4 packing cannot take
    (not a multiple of 16 rows; real vocabularies are: 49,152, 151,936, 128,256)."""
    if _int4_fits(*linear.weight.shape):
        return Int4Linear.from_linear(linear)
    return Int8Linear.from_linear(linear)


def _w4a8(linear: nn.Linear) -> nn.Module:
    from eaglespec.model.w4a8 import W4A8Linear  # builds the kernel on first use

    return W4A8Linear.from_linear(linear)


def _w8a8(linear: nn.Linear) -> nn.Module:
    """w4a8's output head: 8-bit weights per group of 32 (GGUF's Q8_0) against int8
    activations, any number of rows."""
    from eaglespec.model.w4a8 import W8A8Linear

    return W8A8Linear.from_linear(linear)


# mode -> (body layers, output head). int4 keeps the head (the lm_head, named "lm_head" in the
# target and in EAGLE-3 heads) at int8: its logits decide every token, its rows are quantized more
# finely in GGUF files (SmolLM2's Q4_1 file stores it as Q8_0, which per-channel int8 all but
# reproduces), and int4 there changed SmolLM2's first greedy token on the story prompt. w4a8
# keeps it at 8 bits per group of 32, Q8_0's own grid, through the int8-activation kernel.
_LAYERS: dict[str, tuple[Callable[[nn.Linear], nn.Module], Callable[[nn.Linear], nn.Module]]] = {
    "int8": (Int8Linear.from_linear, Int8Linear.from_linear),
    "int4": (Int4Linear.from_linear, Int8Linear.from_linear),
    "int4-all": (Int4Linear.from_linear, _int4_if_it_fits),
    "w4a8": (_w4a8, _w8a8),
    "w4a8-all": (_w4a8, _w4a8),
    # each decoder matrix at its stored width (quantize_model's `wide`), the head at 8 bits
    "w4a8-mixed": (_w4a8, _w8a8),
}
HEAD_NAME = "lm_head"
# The w4a8 modes' widths: (body, output head and `wide` layers), as _LAYERS makes them.
_W4A8_BITS = {"w4a8": (4, 8), "w4a8-all": (4, 4), "w4a8-mixed": (4, 8)}


def _takes_head_kind(name: str, wide: Collection[str]) -> bool:
    """Whether the linear at module path `name` is made as the output head is (`_LAYERS`'s
    second entry): the head itself, or a layer named in w4a8-mixed's `wide`."""
    return name.rpartition(".")[2] == HEAD_NAME or name in wide


def w4a8_bits(mode: str, name: str, wide: Collection[str] = ()) -> int | None:
    """The bits a w4a8 mode stores the linear at module path `name` at (4 or 8; what
    quantize_model makes it), None for the other modes."""
    bits = _W4A8_BITS.get(mode)
    return None if bits is None else bits[_takes_head_kind(name, wide)]


M = TypeVar("M", bound=nn.Module)


def quantize_model(model: M, mode: str, wide: Collection[str] = ()) -> M:
    """Replace every `nn.Linear` of `model` in place by a quantized layer; return `model`.

    In a `Transformer` these are each layer's wqkv, wo, w13, w2 and the lm_head (121 layers for
    SmolLM2); the embedding is an `nn.Embedding` and stays as it is. A tied lm_head shares its
    weight with the embedding: the head gets quantized codes of its own and the embedding keeps
    the dense tensor, so token lookups are unchanged. A module reachable under several names is
    quantized once and shared again. mode "none" returns the model untouched; "int8" makes every
    layer int8; "int4" makes every layer int4 except the output head (`lm_head`), which is int8;
    "int4-all" makes the head int4 too (int8 if its vocabulary is not a multiple of 16).
    "w4a8-mixed" is w4a8 but for the layers named in `wide` (module paths such as
    "layers.0.attn.wqkv"), which go through the 8-bit kernel as the head does: a GGUF's matrices
    stored above 4 bits (loader.wide_matrices), so none runs at fewer bits than its file holds.
    """
    check_quant_mode(mode)
    if mode == "none":
        return model
    make_body, make_head = _LAYERS[mode]
    replaced: dict[int, nn.Module] = {}  # id(old Linear) -> its quantized layer
    # `_modules` rather than `named_children()`, which hides a second name for the same child.
    targets = [
        (parent, f"{path}.{child_name}".lstrip("."), child_name, child)
        for path, parent in model.named_modules()
        for child_name, child in parent._modules.items()
        if isinstance(child, nn.Linear)
    ]
    if mode != "w4a8-mixed" and wide:
        raise ValueError(f"quant {mode}: `wide` is w4a8-mixed's")
    for parent, name, child_name, child in targets:
        if id(child) not in replaced:
            make = make_head if _takes_head_kind(name, wide) else make_body
            replaced[id(child)] = make(child)
        setattr(parent, child_name, replaced[id(child)])
    return model
