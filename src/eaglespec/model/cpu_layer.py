"""A whole decoder layer of an eager CPU step in one call (csrc/layer.cpp), for layers whose four
matrices are w4a8: the commands' default on a CPU with the w4a8 kernel.

Why: with the matmuls, norms, rotation and attention in eaglespec's own kernels, what remained of
an eager SmolLM2 decode step beyond its operators was Python: module calls, the quantized
layers' reshapes, the kernels' checks, views, about 1.5 ms of a 7.6 ms step (torch profiler, 2
threads, 2026-11-25). The C++ op runs the same ops in the same order (eaglespec's kernels through
the dispatcher, ATen for the residual adds, SiLU and product), so a layer's output is bitwise the
Python forward's (tests/test_cpu_layer.py); only the Python goes. Measured (SmolLM2 bf16 w4a8,
100-token prefix, six interleaved runs of 30 forwards in one process, medians): one token 7.20 ->
5.66 ms, two tokens 8.43 -> 6.58 ms.

Taken where every piece would be taken anyway: eager (compiled forwards are one graph already), no
gradients, fp32 or bf16, any number of new tokens onto a cache (a CPU prefill carries its causal
mask: cache.KVCache.plan), no q/k norm (Qwen3 keeps the Python forward), the four matrices
`W4A8Linear`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from eaglespec.cache import CachePlan
from eaglespec.model import cpu_attention, cpu_rowops, w4a8
from eaglespec.model.extension import build
from eaglespec.model.layers import kernel_takes

if TYPE_CHECKING:
    from eaglespec.model.llama import Block


@functools.cache
def _load() -> str | None:
    """Build and load the op once per process (after the kernels it calls); None if it runs."""
    missing: list[str | None] = [
        cpu_attention.available(),
        cpu_rowops.available(),
        w4a8.available(),
    ]
    for reason in missing:
        if reason is not None:
            return reason
    return build("layer", needs="the kernels it calls")


def available() -> str | None:
    """None when the fused layer runs on this machine, else the reason it does not."""
    return _load()


def fits(block: Block, x: torch.Tensor, k_cache: torch.Tensor, plan: CachePlan) -> bool:
    """Whether the fused op takes this layer's forward (module doc)."""
    return block.attn.q_norm is None and _takes(block.attn, block.mlp, x, k_cache, plan)


def fits_draft(layer: nn.Module, h: torch.Tensor, k_cache: torch.Tensor, plan: CachePlan) -> bool:
    """Whether `forward_from` takes an EAGLE-3 head layer (draft/eagle3.py's MidLayer or
    DecoderLayer) from its attention input h (B, T, Cin) on."""
    return _takes(layer.attn, layer.mlp, h, k_cache, plan)


def _takes(
    attn: nn.Module, mlp: nn.Module, x: torch.Tensor, k_cache: torch.Tensor, plan: CachePlan
) -> bool:
    return (
        cpu_rowops.eager_cpu(x, k_cache)
        and k_cache.dtype == x.dtype
        and kernel_takes(plan, x.shape[1])
        and k_cache.shape[-1] % 32 == 0
        and k_cache.shape[-1] in cpu_attention.HEAD_DIMS
        and isinstance(attn.wqkv, w4a8.W4A8Linear)
        and isinstance(attn.wo, w4a8.W4A8Linear)
        and isinstance(mlp.w13, w4a8.W4A8Linear)
        and isinstance(mlp.w2, w4a8.W4A8Linear)
        and _load() is None
    )


def forward(
    block: Block,
    x: torch.Tensor,  # (B, T, C)
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin (B, T, 1, D)
    k_cache: torch.Tensor,  # (B, Hkv, S, D) this layer's cache, written
    v_cache: torch.Tensor,
    plan: CachePlan,
) -> torch.Tensor:
    """Block.forward in one call -> (B, T, C). Call only where `fits`."""
    attn, mlp = block.attn, block.mlp
    out: torch.Tensor = torch.ops.eaglespec_layer.forward(
        x,
        block.attn_norm.weight,
        block.mlp_norm.weight,
        block.attn_norm.eps,
        *_rest(attn, mlp, rope, k_cache, v_cache, plan),
    )
    return out


def forward_draft(
    layer: nn.Module,  # an EAGLE-3 head layer: attn, post_attention_layernorm, mlp
    h: torch.Tensor,  # (B, T, Cin) the normed attention input
    residual: torch.Tensor,  # (B, T, C) what attention's output is added to
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin (B, T, 1, D)
    k_cache: torch.Tensor,  # (B, Hkv, S, D) the head cache's layer, written
    v_cache: torch.Tensor,
    plan: CachePlan,
) -> torch.Tensor:
    """The head layer from its attention input on, in one call -> (B, T, C): the ops of
    DraftAttention, the residual add and the MLP block, in their order. Call only where
    `fits_draft`."""
    attn, mlp, norm = layer.attn, layer.mlp, layer.post_attention_layernorm
    out: torch.Tensor = torch.ops.eaglespec_layer.forward_from(
        residual,
        h,
        norm.weight,
        norm.eps,
        *_rest(attn, mlp, rope, k_cache, v_cache, plan),
    )
    return out


def _rest(
    attn: nn.Module,
    mlp: nn.Module,
    rope: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: CachePlan,
) -> tuple[object, ...]:
    """What both ops take after the norms, in their order: the packed matrices with biases and
    output sizes, RoPE, the caches, the plan's slots, key count and mask, the head count."""
    return (
        attn.wqkv.weight,
        attn.wqkv.bias,
        attn.wqkv.out_features,
        attn.wo.weight,
        attn.wo.bias,
        mlp.w13.weight,
        mlp.w13.bias,
        mlp.w13.out_features,
        mlp.w2.weight,
        mlp.w2.bias,
        *rope,
        k_cache,
        v_cache,
        plan.slots,
        plan.num_keys,
        plan.mask,
        attn.cfg.num_heads,
    )
