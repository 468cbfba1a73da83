"""Building blocks of Llama-family decoders: RMSNorm, rotary embeddings, gated MLP, attention core.

Dims: B batch, T new tokens this step, S cache capacity, K attended keys (committed + new),
H / Hkv query and KV heads, D head dim, C hidden, I MLP width.
Numerics follow transformers' Llama exactly (fp32 norm statistics, fp32 RoPE angles), so logits match
to fp32 tolerance and bf16 runs round the same way.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from eaglespec.config import RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (..., C): statistics in fp32, weight applied after casting back (as transformers does)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None,
    freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse frequencies (D/2,) in fp32, with linear or llama3 scaling, or llama.cpp's per-frequency
    divisors (`rope_freqs.weight` in GGUF files, which is how llama3 scaling is stored there)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:
        return inv / freq_factors.float()
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
    """positions (B, T) int64 -> cos, sin of shape (B, 1, T, D), computed in fp32 then cast."""
    angles = positions[..., None].float() * inv_freq  # (B, T, D/2)
    emb = torch.cat((angles, angles), dim=-1)[:, None]  # (B, 1, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D), HF "rotate_half" layout (GGUF llama Q/K rows are un-permuted at load)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GatedMLP(nn.Module):
    """SwiGLU: w2(silu(gate(x)) * up(x)), with gate and up fused into one matmul (w13)."""

    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.hidden = hidden
        self.w13 = nn.Linear(dim, 2 * hidden, bias=bias)  # rows: [gate; up]
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.hidden, dim=-1)  # (B, T, I) each
        return self.w2(F.silu(gate) * up)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """q (B, H, T, D); k, v (B, Hkv, K, D); mask (B, 1, T, K) bool (True = attend) or None.

    `causal` is only valid when K == T (no cached prefix). GQA runs without repeating K/V.
    """
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]
    )
