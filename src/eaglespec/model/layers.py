"""Building blocks of Llama-family decoders: RMSNorm, rotary embeddings, gated MLP, attention core.

Dims: B batch, T new tokens this step, S cache capacity, K attended keys (committed + new),
H / Hkv query and KV heads, D head dim, C hidden, I MLP width.
Numerics follow transformers' Llama (fp32 norm statistics, RoPE angles in fp32), so fp32 logits
match to fp32 tolerance. In bf16/fp16 the fused RMSNorm rounds once where transformers rounds twice,
so low-precision runs are close to transformers', not bitwise equal.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from eaglespec.cache import CachePlan, write_entries
from eaglespec.config import RopeScaling
from eaglespec.model import cpu_attention, cpu_rowops


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding(num, dim), drawn as torch draws it, except under the meta device (a model
    built to be loaded into, model/loader.py): nothing to draw there, and torch's normal draw on
    meta imports dynamo, 1.5 s of every start of a process that never compiles."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (..., C). Eager on CPU: eaglespec's one-call kernel (model/cpu_rowops.py), PyTorch's
        # composite costs more in dispatch than in work there. Else one fused op: bitwise equal
        # to transformers' formula in fp32; in bf16/fp16 it rounds once where transformers
        # rounds twice (before and after the weight). Both compute in fp32.
        if cpu_rowops.rms_norm_fits(x, self.weight):
            return cpu_rowops.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None,
    freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse frequencies (D/2,) in fp32, with linear or llama3 scaling, or llama.cpp's
    per-frequency divisors (`rope_freqs.weight` in GGUF files, which is how llama3 scaling is
    stored there), on the default device. A handful of numbers, computed on the CPU: under the
    meta device (a model built to be loaded into) torch's pow would import dynamo, 1.5 s."""
    inv = _inv_freq(head_dim, theta, scaling, freq_factors)
    return inv.to(torch.get_default_device())


def _inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None, freq_factors: torch.Tensor | None
) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv = 1.0 / (theta**exponents)
    if freq_factors is not None:
        return inv / freq_factors.float().cpu()
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_len = scaling.original_max_position
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, T) int64 -> cos and signed sin, each (B, T, 1, D), in fp32 then cast.

    The sin's first half is negated so that rotate_half(x) * sin == roll(x, D/2) * signed_sin:
    rotate_half(x) = [-x2, x1] and roll(x, D/2) = [x2, x1]."""
    angles = positions[..., None].float() * inv_freq  # (B, T, D/2)
    sin, cos = angles.sin(), angles.cos()
    cos = torch.cat((cos, cos), dim=-1)  # (B, T, D); `repeat` costs 8 us a call here, cat 1.4
    signed_sin = torch.cat((-sin, sin), dim=-1)
    return cos[:, :, None].to(dtype), signed_sin[:, :, None].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D) in HF "rotate_half" layout (GGUF llama Q/K rows are un-permuted at load).
    Four ops instead of seven: decode runs this on every layer."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class GatedMLP(nn.Module):
    """w2(act(gate(x)) * up(x)), with gate and up fused into one matmul (w13): SwiGLU (act
    "silu", the Llama family) or GeGLU with the tanh approximation ("gelu_tanh", Gemma 3)."""

    def __init__(self, dim: int, hidden: int, bias: bool, act: str = "silu") -> None:
        super().__init__()
        self.hidden = hidden
        self.act = act
        self.w13 = nn.Linear(dim, 2 * hidden, bias=bias)  # rows: [gate; up]
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.w13(x)  # (B, T, 2I): gate, up
        if self.act == "silu" and cpu_rowops.silu_mul_fits(gu):  # eager CPU: one kernel call
            fused: torch.Tensor = self.w2(cpu_rowops.silu_mul(gu))
            return fused
        gate, up = gu.split(self.hidden, dim=-1)  # (B, T, I) each
        g = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        out: torch.Tensor = self.w2(g * up)
        return out


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """q (B, H, T, D); k, v (B, Hkv, K, D); mask (B, 1, T, K) bool (True = attend) or None.

    `causal` is only valid when K == T (no cached prefix). GQA runs without repeating K/V.
    Attention onto a cache takes one of four forms:
    - on an AVX-512 CPU, fp32 or bf16, any number of queries, eager or compiled: eaglespec's
      kernel (`cpu_attention`), row-independent (a verified token's or a prompt token's row gets
      the bits of a one-token step; eager CPU prefills reach it with their causal mask, see
      `cached_attention`) and faster than the forms below for few queries
      (docs/benchmark-history.md, sessions 14 and 17).
    - compiled elsewhere (`attend_fused`): products and sums that inductor fuses into loops of
      its own. The matmul form compiles to two extern bmm calls per layer, which cost SmolLM2's
      bf16 w4a8 chain-2 round 3.75 ms of ~16 ms (2 threads). The fused form measured 18-34%
      faster plain decode and 8-45% faster chain-2 decode, end to end (docs/benchmark-history.md,
      sessions 11-12); each extra query token costs more than with matmuls (the verify-cost curve).
    - eager 16-bit on a CPU (`attend_math`): SDPA's kernel is slow for few queries. One query
      per row over 301 keys, 64 rows, bf16, one thread: SDPA 30.1 ms, `attend_math` 2.8 ms
      (fp32: 3.9 vs 5.8 ms, so fp32 keeps SDPA); benchmarks/attention_cpu.py measures it.
    - otherwise SDPA; on CUDA without its cuDNN backend (`CUDA_SDPA_BACKENDS`).
    """
    if not causal and cpu_attention.fits(q, k):
        return cpu_attention.attend(q, k, v, mask)
    if not causal and torch.compiler.is_compiling():
        return attend_fused(q, k, v, mask)
    if not causal and q.device.type == "cpu" and q.dtype != torch.float32:
        return attend_math(q, k, v, mask)
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cuda":
        with sdpa_kernel(CUDA_SDPA_BACKENDS):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa
            )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


# SDPA's backends on CUDA, in PyTorch's order of preference: all but cuDNN's. On an H100 (PyTorch
# 2.11, SmolLM2 bf16, 2026-11-25) SDPA picked cuDNN for decode steps, whose host time under the
# profiler was 1 ms a call, 69% of the host time of plain decoding; a step took 9.5 ms unprofiled
# for about 1.5 ms of GPU work, so host time is what a step costs there. Untimed since (no GPU).
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D), masked) v with fp32 scores, GQA by grouping the query heads.

    q (B, H, T, D); k, v (B, Hkv, K, D); mask (B, 1, T, K) or None -> (B, H, T, D)."""
    B, H, T, D = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * T, D)  # query heads h = kv * G + g share kv head kv
    scores = (qg @ k.transpose(2, 3)).float() * D**-0.5  # (B, Hkv, G*T, K)
    if mask is not None:
        scores = scores.view(B, Hkv, G, T, K).masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(B, Hkv, G * T, K)
    return (probs @ v).view(B, H, T, D)


def attend_fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """`attend_math` as broadcast products and sums (fp32), for inductor to fuse; eagerly it
    would materialize a (B, Hkv, G, T, K, D) product, so only compiled forwards call it.

    q (B, H, T, D); k, v (B, Hkv, K, D); mask (B, 1, T, K) or None -> (B, H, T, D)."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    qg = q.unflatten(1, (Hkv, H // Hkv)).unsqueeze(-2)  # (B, Hkv, G, T, 1, D)
    kb = k[:, :, None, None]  # (B, Hkv, 1, 1, K, D)
    scores = (qg.float() * kb.float()).sum(-1) * D**-0.5  # (B, Hkv, G, T, K)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # mask (B, 1, 1, T, K)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)  # (B, Hkv, G, T, K)
    vb = v[:, :, None, None]  # (B, Hkv, 1, 1, K, D)
    out = (probs[..., None].float() * vb.float()).sum(-2)  # (B, Hkv, G, T, D)
    return out.to(v.dtype).reshape(B, H, T, D)


def kernel_takes(plan: CachePlan, T: int) -> bool:
    """Whether eaglespec's CPU attention path can take this forward: anything with a mask (a
    prefill on CPU carries its causal one, cache.KVCache.plan) or a single new token."""
    return plan.mask is not None or not (plan.prefix_free and T > 1)


def cached_attention(
    qkv: torch.Tensor,  # (B, T, H + 2 Hkv, D): q, k, v heads (q, k normed if the model does)
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin (B, T, 1, D)
    k_cache: torch.Tensor,  # (B, Hkv, S, D) this layer's cache
    v_cache: torch.Tensor,  # (B, Hkv, S, D)
    plan: CachePlan,
    num_heads: int,  # H
) -> torch.Tensor:
    """Rotate q and k (one pass over both), write k and v to the cache, attend. -> (B, T, H * D).

    The target's layers and the EAGLE-3 head's share this, so both follow one cache protocol."""
    B, T, heads, D = qkv.shape
    H = num_heads
    Hkv = (heads - H) // 2
    K = plan.num_keys
    if kernel_takes(plan, T) and cpu_rowops.rope_write_fits(qkv, k_cache):
        # eager CPU prefill, decode and verification: each row as a one-token step computes it
        q = cpu_rowops.rope_write(qkv, *rope, k_cache, v_cache, plan.slots).transpose(1, 2)
        out = attend(q, k_cache[:, :, :K], v_cache[:, :, :K], plan.mask, causal=False)
        return out.transpose(1, 2).reshape(B, T, H * D)
    qk = apply_rope(qkv[:, :, : H + Hkv], *rope)  # (B, T, H + Hkv, D)
    q = qk[:, :, :H].transpose(1, 2)  # (B, H, T, D)
    k = qk[:, :, H:].transpose(1, 2)  # (B, Hkv, T, D)
    v = qkv[:, :, H + Hkv :].transpose(1, 2)  # (B, Hkv, T, D)
    write_entries(k_cache, v_cache, plan.write_index, k, v)
    if plan.prefix_free and T > 1:
        out = attend(q, k, v, None, causal=True)  # no prefix: plain causal attention
    else:
        out = attend(q, k_cache[:, :, :K], v_cache[:, :, :K], plan.mask, causal=False)
    return out.transpose(1, 2).reshape(B, T, H * D)
