"""Weight-only int8 quantization of a model's linear layers, for weight-bandwidth-bound CPU decode.

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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eaglespec.errors import InvalidRequestError

QUANT_MODES = ("none", "int8")
KERNEL_DTYPE = torch.bfloat16  # the one activation dtype the CPU int8 kernel vectorises
KERNEL_MAX_ROWS = 64  # above this many rows, dequantize + dense fp32 is faster (measured, M=64)
K_MULTIPLE = 16  # the AVX-512 kernel's step over K
_ALIGN = 32  # bytes: the AVX-512 kernel's aligned loads of x and the weight rows


def check_quant_mode(mode: str) -> str:
    """Return `mode` if it is supported, else raise naming the supported modes."""
    if mode not in QUANT_MODES:
        raise InvalidRequestError(
            f"unknown quantization mode '{mode}' (supported: {', '.join(QUANT_MODES)})"
        )
    return mode


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous with a 32-byte aligned start (a fresh allocation is 64-byte aligned)."""
    t = t.contiguous()
    return t if t.data_ptr() % _ALIGN == 0 else t.clone()


class Int8Linear(nn.Module):
    """y = x @ (s * q).T + b with int8 codes q (N, K), bf16 scales s (N,), optional bias b (N,)."""

    weight: torch.Tensor  # (N, K) int8 codes q
    scales: torch.Tensor  # (N,) bf16 per-output-channel scales s
    bias: torch.Tensor | None  # (N,) in the model's dtype, added after the matmul

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
        if weight.device.type != "cpu":
            raise InvalidRequestError(
                f"int8 quantization runs on CPU only, the weights are on "
                f"'{weight.device.type}'; use --quant none on this device"
            )
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (..., K) -> (..., N) in x's dtype
        *lead, K = x.shape
        assert self.in_features == K, f"input has {K} features, layer expects {self.in_features}"
        x2 = x.reshape(-1, K)  # (M, K)
        if x2.shape[0] > KERNEL_MAX_ROWS:
            y = F.linear(x2.float(), self.dequantize()).to(x.dtype)  # (M, N)
        else:
            y = torch._weight_int8pack_mm(_aligned(x2.to(KERNEL_DTYPE)), self.weight, self.scales)
            y = y.to(x.dtype)  # (M, N): no-op for bf16 models
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def quantize_model(model: nn.Module, mode: str) -> nn.Module:
    """Replace every `nn.Linear` of `model` in place by a quantized layer; return `model`.

    In a `Transformer` these are each layer's wqkv, wo, w13, w2 and the lm_head (121 layers for
    SmolLM2); the embedding is an `nn.Embedding` and stays as it is. A tied lm_head shares its
    weight with the embedding: the head gets quantized codes of its own and the embedding keeps
    the dense tensor, so token lookups are unchanged. A module reachable under several names is
    quantized once and shared again. mode "none" returns the model untouched.
    """
    check_quant_mode(mode)
    if mode == "none":
        return model
    replaced: dict[int, Int8Linear] = {}  # id(old Linear) -> its quantized layer
    # `_modules` rather than `named_children()`, which hides a second name for the same child.
    targets = [
        (parent, child_name, child)
        for parent in model.modules()
        for child_name, child in parent._modules.items()
        if isinstance(child, nn.Linear)
    ]
    for parent, child_name, child in targets:
        if id(child) not in replaced:
            replaced[id(child)] = Int8Linear.from_linear(child)
        setattr(parent, child_name, replaced[id(child)])
    return model
