"""Tiny EAGLE-3 draft checkpoints in the published layouts, and an independent reference forward.

The native layout copies the key set of the real LLaMA-3.1-8B draft's config.json
(research/eagle3-llama31-8b-draft-config.json) and its tensor names and dtypes (fp16 weights, int64
d2t, bool t2d), scaled down: C 4096 -> 64, I 14336 -> 224, V 128256 -> 256, Vd 32000 -> 96.
The speculators layout nests the layer config under `transformer_layer_config` and names the
layer `layers.0.*`.

`reference_draft` follows spec section 1.2 literally in plain torch over the HF tensor names (no
cache, explicit (T, T) mask, rotate_half RoPE, repeated KV heads), so it shares no code with the
engine: cat(input_layernorm(e), hidden_norm(g)), residual g, post_attention_layernorm, SwiGLU,
final norm, lm_head.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eaglespec.config import ModelConfig
from eaglespec.model.llama import Transformer

V, C, HEADS, KV_HEADS, HEAD_DIM, INTER, VD, N_LAYERS = 256, 64, 4, 2, 16, 224, 96, 6
EPS = 1e-5


def tiny_target(seed: int = 0, rope_theta: float = 100000.0) -> Transformer:
    """A 6-layer random Llama target, fp32 on CPU, RoPE base 100000 (not the draft's 10000)."""
    cfg = ModelConfig(
        family="llama",
        vocab_size=V,
        hidden_size=C,
        intermediate_size=128,
        num_layers=N_LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=EPS,
        rope_theta=rope_theta,
        max_position=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model.eval().requires_grad_(False)


def native_config(arch: str = "LlamaForCausalLMEagle3", **changes: Any) -> dict[str, Any]:
    """The real 8B draft's config.json keys, scaled down."""
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": C,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": EPS,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": V,
        "draft_vocab_size": VD,
    }
    cfg.update(changes)
    return cfg


def speculators_config(**top: Any) -> dict[str, Any]:
    """An `Eagle3Speculator` config as vLLM's speculators writes it, scaled down."""
    layer = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": C,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 1,
        "rms_norm_eps": EPS,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 2048,
        "vocab_size": V,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    cfg: dict[str, Any] = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.2.0",
        "draft_vocab_size": VD,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": None,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
            "verifier": {"name_or_path": "tiny-target", "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": "bfloat16",
    }
    cfg.update(top)
    return cfg


@dataclass
class DraftSpec:
    """What a test checkpoint holds (mirrors the config flags it is written with)."""

    num_aux: int = 3
    num_layers: int = 1
    layer_prefix: str = "midlayer"  # "midlayer" (native) or "layers" (speculators / TensorRT)
    extra_prefix: str = "midlayers"  # extra layers i >= 1: "midlayers" or "layers"
    draft_vocab: int | None = VD  # None: no lm_head, d2t or t2d (inherit the target's)
    kv_heads: int = KV_HEADS
    embed: bool = False  # ship embed_tokens.weight
    fc_norm: bool = False
    norm_before_fc: bool = False
    fc_bias: bool = False
    dtype: torch.dtype = torch.float16
    seed: int = 1
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


def draft_tensors(spec: DraftSpec) -> dict[str, torch.Tensor]:
    """HF-named tensors of a draft in the published layout (weights in spec.dtype)."""
    g = torch.Generator().manual_seed(spec.seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).to(spec.dtype)

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, generator=g)).to(spec.dtype)

    q, kv = HEADS * HEAD_DIM, spec.kv_heads * HEAD_DIM
    t: dict[str, torch.Tensor] = {"fc.weight": w(C, spec.num_aux * C)}
    if spec.fc_bias:
        t["fc.bias"] = norm(C) - 1
    if spec.norm_before_fc:
        t["input_norm.weight"] = norm(spec.num_aux * C)
    if spec.fc_norm:
        for i in range(spec.num_aux):
            t[f"fc_norm.{i}.weight"] = norm(C)
    for i in range(spec.num_layers):
        first = "layers.0" if spec.layer_prefix == "layers" else "midlayer"
        p = first if i == 0 else f"{spec.extra_prefix}.{i}"
        in_dim = 2 * C if i == 0 else C
        t[f"{p}.input_layernorm.weight"] = norm(C)
        if i == 0:
            t[f"{p}.hidden_norm.weight"] = norm(C)
        t[f"{p}.post_attention_layernorm.weight"] = norm(C)
        t[f"{p}.self_attn.q_proj.weight"] = w(q, in_dim)
        t[f"{p}.self_attn.k_proj.weight"] = w(kv, in_dim)
        t[f"{p}.self_attn.v_proj.weight"] = w(kv, in_dim)
        t[f"{p}.self_attn.o_proj.weight"] = w(C, q)
        t[f"{p}.mlp.gate_proj.weight"] = w(INTER, C)
        t[f"{p}.mlp.up_proj.weight"] = w(INTER, C)
        t[f"{p}.mlp.down_proj.weight"] = w(C, INTER)
    t["norm.weight"] = norm(C)
    if spec.draft_vocab is not None:
        vd = spec.draft_vocab
        t["lm_head.weight"] = w(vd, C)
        used = torch.randperm(V, generator=g)[:vd].sort().values  # ascending, as EAGLE builds it
        t["d2t"] = used - torch.arange(vd)  # int64 offsets
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[used] = True
        t["t2d"] = t2d
    if spec.embed:
        t["embed_tokens.weight"] = w(V, C)
    t.update(spec.extra)
    return t


def write_draft(
    folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], fmt: str = "st"
) -> Path:
    """config.json plus model.safetensors (fmt "st") or pytorch_model.bin (fmt "bin")."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if fmt == "st":
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors")
        )
    else:
        torch.save(tensors, folder / "pytorch_model.bin")
    return folder


# ---------------------------------------------------------------- reference forward (spec 1.2)


@dataclass
class RefFlags:
    rope_theta: float = 10000.0
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    use_fc: bool = True
    final_norm: bool = True
    feed_normed: bool = False
    num_layers: int = 1
    prefix: str = "midlayer"  # layer 0's name; extra layers are `midlayers.{i}`
    extra_prefix: str = "midlayers"
    kv_heads: int = KV_HEADS


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x (B, heads, T, D), HF rotate_half convention."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    ang = pos[..., None].float() * inv  # (B, T, D/2)
    emb = torch.cat((ang, ang), dim=-1)[:, None]  # (B, 1, T, D)
    rotated = torch.cat((-x[..., D // 2 :], x[..., : D // 2]), dim=-1)
    return x * emb.cos() + rotated * emb.sin()


def _attention(
    sd: dict[str, torch.Tensor],
    p: str,
    x: torch.Tensor,
    pos: torch.Tensor,
    mask: torch.Tensor,
    theta: float,
    kv_heads: int,
) -> torch.Tensor:
    B, T, _ = x.shape

    def proj(name: str, heads: int) -> torch.Tensor:
        return (x @ sd[f"{p}.self_attn.{name}_proj.weight"].T).view(B, T, heads, HEAD_DIM)

    q = _rope(proj("q", HEADS).transpose(1, 2), pos, theta)
    k = _rope(proj("k", kv_heads).transpose(1, 2), pos, theta)
    v = proj("v", kv_heads).transpose(1, 2)
    k = k.repeat_interleave(HEADS // kv_heads, dim=1)
    v = v.repeat_interleave(HEADS // kv_heads, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    out = (probs @ v).transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM)
    return out @ sd[f"{p}.self_attn.o_proj.weight"].T


def _mlp(sd: dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    gate = x @ sd[f"{p}.mlp.gate_proj.weight"].T
    up = x @ sd[f"{p}.mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ sd[f"{p}.mlp.down_proj.weight"].T


def reference_draft(
    tensors: dict[str, torch.Tensor],
    target: Transformer,
    flags: RefFlags,
    input_ids: torch.Tensor,  # (B, T) target ids
    aux: list[torch.Tensor],  # each (B, T, C) target states, or [g] when not flags.use_fc
    positions: torch.Tensor,  # (B, T)
    mask: torch.Tensor | None = None,  # (B, T, T) bool; None = causal
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (B, T, Vd), state fed to the next step (B, T, C)), all fp32."""
    sd = {k: v.float() for k, v in tensors.items() if v.is_floating_point()}
    sd.setdefault("embed_tokens.weight", target.embed.weight.float())
    sd.setdefault("lm_head.weight", target.lm_head.weight.float())
    B, T = input_ids.shape
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    if flags.use_fc:
        feats = torch.cat(aux, dim=-1)
        if flags.norm_before_fc:
            feats = _rms(feats, sd["input_norm.weight"])
        if flags.fc_norm:
            chunks = torch.split(feats, C, dim=-1)
            feats = torch.cat(
                [_rms(c, sd[f"fc_norm.{i}.weight"]) for i, c in enumerate(chunks)], -1
            )
        g = feats @ sd["fc.weight"].T + sd.get("fc.bias", torch.zeros(C))
    else:
        g = aux[0]
    p = flags.prefix
    e = sd["embed_tokens.weight"][input_ids]
    normed_g = _rms(g, sd[f"{p}.hidden_norm.weight"])
    residual = normed_g if flags.norm_before_residual else g
    h_in = torch.cat((_rms(e, sd[f"{p}.input_layernorm.weight"]), normed_g), dim=-1)
    x = residual + _attention(sd, p, h_in, positions, mask, flags.rope_theta, flags.kv_heads)
    x = x + _mlp(sd, p, _rms(x, sd[f"{p}.post_attention_layernorm.weight"]))
    for i in range(1, flags.num_layers):
        p = f"{flags.extra_prefix}.{i}"
        a_in = _rms(x, sd[f"{p}.input_layernorm.weight"])
        x = x + _attention(sd, p, a_in, positions, mask, flags.rope_theta, flags.kv_heads)
        x = x + _mlp(sd, p, _rms(x, sd[f"{p}.post_attention_layernorm.weight"]))
    if flags.feed_normed:
        x = _rms(x, sd["norm.weight"])
        return x @ sd["lm_head.weight"].T, x
    out = _rms(x, sd["norm.weight"]) if flags.final_norm else x
    return out @ sd["lm_head.weight"].T, x
