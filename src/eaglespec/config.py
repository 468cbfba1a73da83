"""Frozen configuration dataclasses, built from checkpoints by explicit constructors, never from
file names.

`ModelConfig` describes one target decoder: the Llama family (Llama 2/3, SmolLM2, Mistral,
Qwen2/2.5, Qwen3) and Gemma 3's text models, which differ from it only in the fields below that
default to Llama's behaviour.
`SamplingParams` is per-request data; it never holds engine settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from eaglespec.errors import InvalidRequestError, ModelLoadError, UnsupportedArchitectureError

# HF `architectures[0]` / `model_type` / GGUF `general.architecture` -> our family name.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
# model_type -> family where the two differ (a Gemma 3 text checkpoint saves "gemma3_text")
_MODEL_TYPES = {"gemma3_text": "gemma3"}
# Relatives that share a name with a supported family but not its computation: refused by name.
_NOT_IMPLEMENTED = {
    "Gemma3ForConditionalGeneration": "Gemma 3's vision-language model (its text model, "
    "Gemma3ForCausalLM, is supported)",
    "Gemma3nForCausalLM": "Gemma 3n",
    "Gemma3nForConditionalGeneration": "Gemma 3n",
    "Gemma2ForCausalLM": "Gemma 2 (logit soft-capping)",
    "GemmaForCausalLM": "Gemma 1",
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    kind: str  # "linear" or "llama3"
    factor: float  # context extension factor
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only: the pre-extension context length


@dataclass(frozen=True, slots=True)
class ModelConfig:
    family: str  # one of SUPPORTED_FAMILIES
    vocab_size: int  # V
    hidden_size: int  # C
    intermediate_size: int  # MLP width
    num_layers: int  # L, decoder layers
    num_heads: int  # H, query heads
    num_kv_heads: int  # Hkv, key/value heads (GQA when < H)
    head_dim: int  # D
    rms_norm_eps: float
    rope_theta: float  # RoPE base
    max_position: int  # context length the model was trained for
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False  # Qwen2: biases on q/k/v projections
    o_bias: bool = False  # Llama `attention_bias`: bias on o_proj too
    mlp_bias: bool = False  # Llama `mlp_bias`
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    # Mistral (no sliding_layers): contexts are capped to this, as all its layers attend densely.
    # Gemma 3: the window of the layers marked in sliding_layers, applied as a mask.
    sliding_window: int | None = None
    name: str = ""  # human-readable model name from the checkpoint, for reports only
    # Gemma 3 (all default to the Llama family's computation):
    sliding_layers: tuple[bool, ...] = ()  # per layer: attends only the last sliding_window keys
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (unscaled)
    sandwich_norms: bool = False  # norms after attention and after the MLP too, before the adds
    mlp_act: str = "silu"  # the gate's activation: "silu" or "gelu_tanh"
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden), rounded to the dtype
    query_scale: float | None = None  # attention's score scale where not head_dim ** -0.5

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            supported = ", ".join(SUPPORTED_FAMILIES)
            raise UnsupportedArchitectureError(
                f"unsupported architecture '{self.family}' (supported: {supported})"
            )
        if self.mlp_act not in ("silu", "gelu_tanh"):
            raise UnsupportedArchitectureError(f"unsupported MLP activation '{self.mlp_act}'")
        if self.sliding_layers and (
            len(self.sliding_layers) != self.num_layers or self.sliding_window is None
        ):
            raise ModelLoadError(
                f"sliding_layers must give {self.num_layers} layers and come with a window"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def context_limit(self) -> int:
        """The longest sequence this engine will run: the trained context (or Mistral's window)."""
        if self.sliding_window is not None and not self.sliding_layers:
            return min(self.max_position, self.sliding_window)
        return self.max_position

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Build from a transformers `config.json` dict (transformers 4.x and 5.x rope layouts)."""
        archs = cfg.get("architectures") or []
        if archs and archs[0] in _NOT_IMPLEMENTED:
            raise UnsupportedArchitectureError(
                f"{source}: {archs[0]} is not implemented: {_NOT_IMPLEMENTED[archs[0]]} "
                f"(supported: {', '.join(_HF_ARCHITECTURES)})"
            )
        family = _HF_ARCHITECTURES.get(archs[0]) if archs else None
        if family is None:
            family = cfg.get("model_type", "")
            family = _MODEL_TYPES.get(family, family)
            if family not in SUPPORTED_FAMILIES:
                what = archs[0] if archs else family or "<none>"
                raise UnsupportedArchitectureError(
                    f"{source}: unsupported architecture '{what}' "
                    f"(supported: {', '.join(_HF_ARCHITECTURES)})"
                )
        if family == "gemma3":
            return _gemma3(cfg, source)
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            return cls(
                family=family,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                max_position=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                rope_scaling=parse_rope_scaling(rope, source=source),
                qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
                o_bias=family in ("llama", "mistral") and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=family == "qwen3",
                sliding_window=_sliding_window(cfg, family),
                name=str(cfg.get("_name_or_path", "")),
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing required key {e.args[0]!r}") from None


def _gemma3(cfg: dict[str, Any], source: str) -> ModelConfig:
    """Gemma 3's text model (transformers' Gemma3TextConfig, 4.x and 5.x layouts): Llama's layer
    with four norms, q/k norms, a GELU-tanh gate, scaled embeddings, a query scale of its own and
    sliding-window layers (every sixth layer global unless `layer_types` says) with a RoPE base
    of their own."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise UnsupportedArchitectureError(f"{source}: Gemma 3 with {key} is not implemented")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedArchitectureError(f"{source}: bidirectional Gemma 3 is not implemented")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedArchitectureError(f"{source}: unsupported Gemma 3 activation '{act}'")
    try:
        layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
        kinds = cfg.get("layer_types") or [
            "full_attention"
            if (i + 1) % int(cfg.get("sliding_window_pattern", 6)) == 0
            else "sliding_attention"
            for i in range(layers)
        ]
        if len(kinds) != layers or set(kinds) - {"sliding_attention", "full_attention"}:
            raise ModelLoadError(f"{source}: layer_types must name {layers} attention kinds")
        # rope_parameters (5.x) keys the two kinds; 4.x has rope_theta, rope_local_base_freq and
        # rope_scaling (the global layers')
        params = cfg.get("rope_parameters") or {}
        full = dict(params.get("full_attention") or cfg.get("rope_scaling") or {})
        local = dict(params.get("sliding_attention") or {})
        if parse_rope_scaling(local, source=source) is not None:
            raise UnsupportedArchitectureError(f"{source}: RoPE scaling on sliding layers")
        head_dim = int(cfg.get("head_dim") or 256)
        return ModelConfig(
            family="gemma3",
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
            max_position=int(cfg.get("max_position_embeddings", 131_072)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            rope_scaling=parse_rope_scaling(full, source=source),
            qkv_bias=bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=True,
            sliding_window=int(cfg.get("sliding_window") or 4096),
            name=str(cfg.get("_name_or_path", "")),
            sliding_layers=tuple(k == "sliding_attention" for k in kinds),
            rope_local_theta=float(
                local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
            ),
            sandwich_norms=True,
            mlp_act="gelu_tanh",
            embed_scale=True,
            query_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: missing required key {e.args[0]!r}") from None


def _sliding_window(cfg: dict[str, Any], family: str) -> int | None:
    # Qwen2/3 configs carry `sliding_window` but only use it with `use_sliding_window: true`.
    window = cfg.get("sliding_window")
    if window is None or (family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window")):
        return None
    return int(window)


def parse_rope_scaling(rope: dict[str, Any], *, source: str) -> RopeScaling | None:
    """Accepts HF `rope_scaling` (4.x) or `rope_parameters` (5.x); `default` means none."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(rope["factor"]),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position=int(rope.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedArchitectureError(f"{source}: unsupported RoPE scaling type '{kind}'")


@dataclass(frozen=True, slots=True)
class TreeConfig:
    """Shape of an EAGLE-2 dynamic draft tree. A chain of k tokens is depth k, top_k 1."""

    depth: int  # levels of candidates = longest draft path; draft forwards per round = depth - 1
    top_k: int  # children drawn per expanded node, and nodes expanded per level
    num_nodes: int  # draft tokens kept after the global rerank (root excluded)

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1:
            raise InvalidRequestError(
                f"tree depth {self.depth}, top_k {self.top_k}: both must be at least 1"
            )
        most = self.top_k + (self.depth - 1) * self.top_k**2
        if not 1 <= self.num_nodes <= most:
            raise InvalidRequestError(
                f"tree depth {self.depth}, top_k {self.top_k}: num_nodes must be in [1, {most}], "
                f"got {self.num_nodes}"
            )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request decoding parameters. temperature 0 means greedy."""

    max_tokens: int = 256  # new tokens to generate at most
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off; drop tokens with p < min_p * p_max
    repetition_penalty: float = 1.0  # 1 = off; HF semantics over prompt and generated tokens
    seed: int | None = None  # seeds this request's own torch.Generator
    stop: tuple[str, ...] = ()  # generation ends before the first occurrence of any of these
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    stop_token_ids: tuple[int, ...] = field(default=())  # extra ids that end generation
    logprobs: int | None = None  # None: none; n: each token's log-probability + the n best

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.temperature >= 0 and math.isfinite(self.temperature), "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                "logprobs must be between 0 and 20 (the most likely tokens reported per token)",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidRequestError(msg)
        if isinstance(self.stop, str):  # a lone string would silently mean its characters
            raise InvalidRequestError("stop must be a tuple of strings, e.g. stop=('\\n',)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
