"""Row-wise ops of an eager decode step on CPU as eaglespec's own kernels (csrc/rowops.cpp):
RMSNorm, RoPE with the KV-cache write, the gated MLP's SiLU and product, and the greedy token
choice (argmax over the logits).

Why: in an eager decode step the work of a norm over one 576-wide row is nanoseconds, and
PyTorch's CPU `rms_norm` is a composite of seven ops (upcast, pow, mean, add, rsqrt, two muls,
downcast): about 35-45 us a call under the profiler, 61 calls a SmolLM2 step, about 2 ms of a
10 ms bf16 w4a8 step (2 threads, 2026-11-25). The kernel is one call. Compiled forwards keep
PyTorch's op, which inductor fuses with its neighbours; so do forwards that need gradients
(training).

`rope_write` takes a layer's fused q/k/v projection to what attention reads: q and k rotated, k
and v written at each token's cache slot, q returned. The PyTorch form (`layers.cached_attention`)
is about a dozen ops a layer (slices, the rotation's products and roll, transposes, two
`index_put`s). It rounds as those eager ops do (each product and the sum to the model dtype), so
its bits are theirs (tested).

`argmax` is torch.max(x, -1).indices for fp32 rows (the first maximum; a NaN counts as the
maximum), in one call: over SmolLM2's 49,152 logits 9 against 57 us for one row, 13 against 84 us
for a verification's two (2 threads, session 27).

`silu_mul` is SwiGLU's silu(gate) * up over a fused gate/up projection's output in one call:
PyTorch's silu and mul took about 17 us a SmolLM2 layer from Python, 10 under the profiler from
C++ (a TensorIterator each for 1,536 values), about 0.3 ms of a 5.5 ms step. Numerics: fp32,
sigmoid from exp(-|g|) (Cephes, within 2 ulp of expf), rounded once to x's dtype; PyTorch rounds
silu(g) to bf16 before the product, so the two differ by a bf16 step at most.

RMSNorm numerics: the mean of squares in fp32 (lane-wise sums, then one reduction),
1 / sqrt(. + eps), the product with the weight in fp32, rounded once to x's dtype, as
`layers.RMSNorm` documents for its PyTorch form (which may sum in another order: equal to fp32
tolerance, not bitwise).
Each row alone through the same instructions, whatever the rows and threads (tests/test_rowops.py).
Needs AVX-512 (F, BW, VL) or AVX2 with FMA and F16C (x86-64-v3: the same ops lane for lane on
csrc/simd16_avx2.h's two 8-lane halves, so the same bits; `torch.ops.eaglespec_rowops.use_avx2`
asks for that path where AVX-512 runs); elsewhere `available()` says why and PyTorch's op runs.
"""

from __future__ import annotations

import functools

import torch

from eaglespec.model.extension import build, constant_to_dynamo


@functools.cache
def _load() -> str | None:
    """Build and load the kernels once per process; None if they run here, else why not."""
    reason = build("rowops", needs="an x86 CPU with AVX2 (FMA, F16C) or AVX-512")
    if reason is not None:
        return reason

    @torch.library.register_fake("eaglespec_rowops::rms_norm")  # type: ignore[untyped-decorator]
    def _(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x)

    return None


# Traced forwards ask too: a constant to dynamo, not a function to trace into.
@constant_to_dynamo
def available() -> str | None:
    """None when the kernels run on this machine, else the reason they do not."""
    return _load()


_DTYPES = (torch.float32, torch.bfloat16)


def eager_cpu(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Eager, CPU, fp32 or bf16, no gradients wanted: where these kernels run (they have no
    backward, and compiled forwards leave such ops to inductor); cpu_layer asks it too. Asked
    about 90 times a SmolLM2 step, so spelled for speed (`is_cpu`, no generators)."""
    return (
        not torch.compiler.is_compiling()
        and a.is_cpu
        and b.is_cpu
        and a.dtype in _DTYPES
        and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
        and _load() is None
    )


def rms_norm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this norm."""
    return weight.dtype in (x.dtype, torch.float32) and eager_cpu(x, weight)


def rope_write_fits(qkv: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes this rotation and cache write: a head dim divisible by 32 (the
    rotation's halves in whole 16-lane chunks), the cache in qkv's dtype."""
    return qkv.shape[-1] % 32 == 0 and k_cache.dtype == qkv.dtype and eager_cpu(qkv, k_cache)


def argmax_fits(x: torch.Tensor) -> bool:
    """Whether the kernel takes this argmax: fp32 rows on the CPU, eager."""
    return x.dtype == torch.float32 and x.dim() > 0 and x.shape[-1] > 0 and eager_cpu(x, x)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x (..., V) fp32 -> (...) int64, torch.max(x, -1).indices. Call only where `argmax_fits`."""
    out: torch.Tensor = torch.ops.eaglespec_rowops.argmax(x)
    return out


def silu_mul_fits(x: torch.Tensor) -> bool:
    """Whether the kernel takes this activation: an even last dim (gate and up halves)."""
    return x.dim() > 0 and x.shape[-1] % 2 == 0 and eager_cpu(x, x)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2I), gate then up -> silu(gate) * up, (..., I) in x's dtype. Call only where
    `silu_mul_fits`."""
    out: torch.Tensor = torch.ops.eaglespec_rowops.silu_mul(x)
    return out


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The kernel's math in plain torch, fp32, rounded once to x's dtype (for tests)."""
    g, u = x.float().chunk(2, dim=-1)
    return (g * torch.sigmoid(g) * u).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., C), weight (C,) -> (..., C) in x's dtype. Call only where `rms_norm_fits`."""
    out: torch.Tensor = torch.ops.eaglespec_rowops.rms_norm(x, weight, eps)
    return out


def rope_write(
    qkv: torch.Tensor,  # (B, T, H + 2 Hkv, D): q, k, v heads
    cos: torch.Tensor,  # (B, T, 1, D)
    signed_sin: torch.Tensor,  # (B, T, 1, D)
    k_cache: torch.Tensor,  # (B, Hkv, S, D), written
    v_cache: torch.Tensor,  # (B, Hkv, S, D), written
    slots: torch.Tensor,  # (B, T) int64: token (b, t) goes to slot slots[b, t] of row b
) -> torch.Tensor:
    """-> q rotated, (B, T, H, D) contiguous. Call only where `rope_write_fits`."""
    q: torch.Tensor = torch.ops.eaglespec_rowops.rope_write(
        qkv, cos, signed_sin, k_cache, v_cache, slots
    )
    return q


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's math in plain torch, fp32, rounded once to x's dtype (for tests)."""
    xf = x.float()
    r = 1.0 / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * r * weight.float()).to(x.dtype)
