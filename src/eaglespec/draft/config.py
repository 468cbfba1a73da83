"""EAGLE-3 draft configuration: read from (and written back to) a draft checkpoint's config.json,
and the resolution of the target layers the draft reads (capture boundaries).

Two published layouts, told apart by content, never by file name:
  native       `LlamaForCausalLMEagle3` (SpecForge, SGLang, AngelSlim; EAGLE's own training config
               says `LlamaForCausalLM`): a flat Llama config plus `draft_vocab_size` and
               optional EAGLE-3 keys. Anything without `transformer_layer_config` reads as native.
  speculators  `Eagle3Speculator` (vLLM's speculators): the draft layer's Llama config nested under
               `transformer_layer_config`, merged up here; top-level keys win.

Capture boundary b in [0, N] (N target layers) is the target's pre-norm residual stream after b
decoder layers, what `Transformer.forward(capture=...)` returns: 0 the embedding output, N the final
pre-norm state. Config ids come in two conventions (spec section 1.1):

  config form                                          convention        boundary
  no ids                                               default           (2, N//2, N-3)
  eagle_config.eagle_aux_hidden_state_layer_ids [1,..] output of layer i i + 1 (SpecForge)
  eagle_config.eagle_aux_hidden_state_layer_ids [2,..] boundary          i     (Kimi-K2.5 draft)
  top-level eagle_aux_hidden_state_layer_ids           boundary          i     (speculators, vLLM)

Only a first id of exactly 1 marks SpecForge's output-of-layer ids (SGLang PR #25454 applies the
same rule); any other first id under `eagle_config` is read as a boundary. When both keys are
present the top-level one wins (our choice: no published config has both).

`norm_output` means two different things depending on who wrote the config (spec section 1.3), so
it is resolved by provenance into two unambiguous flags:
  native (SpecForge wrote it): `norm_output` (default true) = apply the final norm before lm_head;
      the pre-norm state always feeds the next draft step.  -> final_norm = norm_output
  speculators (vLLM semantics): the final norm is always applied; `norm_output: true` feeds the
      post-norm state to the next draft step.               -> feed_normed = norm_output
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eaglespec.config import ModelConfig, RopeScaling, parse_rope_scaling
from eaglespec.errors import InvalidRequestError, ModelLoadError, UnsupportedArchitectureError

NATIVE = "native"
SPECULATORS = "speculators"
DEFAULT_ROPE_THETA = 10000.0  # EAGLE's base when the draft config names none (spec section 1.6)
_IDS_KEY = "eagle_aux_hidden_state_layer_ids"


@dataclass(frozen=True, slots=True)
class DraftConfig:
    hidden_size: int  # C, the draft's width
    target_hidden_size: int  # Ct, width of each captured target state (fc in = A * Ct)
    num_heads: int  # H
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    intermediate_size: int  # MLP width
    rms_norm_eps: float
    vocab_size: int  # V, the TARGET vocabulary: embedding rows, the range of d2t
    draft_vocab_size: int  # Vd, lm_head rows
    rope_theta: float = DEFAULT_ROPE_THETA  # the draft's own base, never the target's
    rope_scaling: RopeScaling | None = None
    num_layers: int = 1  # decoder layers: the 2C-input midlayer, then plain C-input layers
    norm_before_residual: bool = False  # residual = hidden_norm(g) instead of raw g
    norm_before_fc: bool = False  # one RMSNorm (`input_norm`) over the concatenated A*Ct features
    fc_norm: bool = False  # one RMSNorm per captured state (`fc_norm.{i}`) before fc
    fc_bias: bool = False  # `bias` key (SGLang)
    use_aux_hidden_state: bool = True  # false: one feature, the last layer's state, and no fc
    tie_word_embeddings: bool = False  # lm_head is the embedding matrix
    final_norm: bool = True  # apply `norm` before lm_head (native `norm_output`)
    feed_normed: bool = False  # the post-norm state feeds the next step (speculators `norm_output`)
    aux_layer_ids: tuple[int, ...] | None = None  # capture ids as written in the config
    aux_layer_convention: str = "default"  # "default", "output-of-layer" or "boundary"
    aux_layer_key: str = ""  # the config key the ids came from
    format: str = NATIVE  # NATIVE or SPECULATORS
    max_position: int = 2048  # training context; acceptance degrades past it
    source: str = "config.json"  # for error messages

    def __post_init__(self) -> None:
        checks = [
            (self.num_layers >= 1, f"num_hidden_layers must be >= 1, got {self.num_layers}"),
            (
                self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}",
            ),
            (
                0 < self.draft_vocab_size <= self.vocab_size,
                f"draft_vocab_size {self.draft_vocab_size} must be in [1, vocab_size "
                f"{self.vocab_size}]",
            ),
            (
                not self.tie_word_embeddings or self.draft_vocab_size == self.vocab_size,
                f"tie_word_embeddings needs draft_vocab_size == vocab_size {self.vocab_size}",
            ),
            (
                min(self.hidden_size, self.target_hidden_size, self.head_dim) > 0,
                "hidden_size, target_hidden_size and head_dim must be positive",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ModelLoadError(f"{self.source}: {msg}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], *, source: str = "config.json") -> DraftConfig:
        """Either layout, recognised by its content (`transformer_layer_config`)."""
        if "transformer_layer_config" in cfg or "Eagle3Speculator" in (
            cfg.get("architectures") or []
        ):
            return cls.from_speculators_dict(cfg, source=source)
        return cls.from_native_dict(cfg, source=source)

    @classmethod
    def from_native_dict(cls, cfg: dict[str, Any], *, source: str = "config.json") -> DraftConfig:
        return _parse(cfg, NATIVE, source)

    @classmethod
    def from_speculators_dict(
        cls, cfg: dict[str, Any], *, source: str = "config.json"
    ) -> DraftConfig:
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ModelLoadError(f"{source}: speculators config has no transformer_layer_config")
        kind = layer.get("model_type", "llama")
        if kind != "llama":
            raise UnsupportedArchitectureError(
                f"{source}: draft layer type '{kind}' is not supported (only llama-style layers)"
            )
        top = {k: v for k, v in cfg.items() if k != "transformer_layer_config" and v is not None}
        return _parse({**layer, **top}, SPECULATORS, source)

    @classmethod
    def like_target(
        cls,
        target: ModelConfig,
        *,
        draft_vocab_size: int | None = None,
        num_layers: int = 1,
        intermediate_size: int | None = None,
    ) -> DraftConfig:
        """A native-default draft shaped like `target` (its MLP `intermediate_size` wide where
        given): random heads for tests and benchmarks, fresh heads for training."""
        return cls(
            hidden_size=target.hidden_size,
            target_hidden_size=target.hidden_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            intermediate_size=intermediate_size or target.intermediate_size,
            rms_norm_eps=target.rms_norm_eps,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size or target.vocab_size,
            num_layers=num_layers,
            max_position=target.max_position,
            source=f"random draft for {target.name or 'target'}",
        )

    def to_native_dict(
        self,
        capture: Sequence[int],
        num_target_layers: int | None = None,
        *,
        torch_dtype: torch.dtype = torch.float32,
    ) -> dict[str, Any]:
        """This config as a native `LlamaForCausalLMEagle3` config.json, `from_native_dict`'s
        inverse for the fields it reads.

        Capture ids are written as boundaries under `eagle_config.eagle_aux_hidden_state_layer_ids`,
        and only when they differ from the default (2, N//2, N-3) for `num_target_layers` (always
        when it is not given). A first boundary of 1 would read as SpecForge's output-of-layer ids
        under that key (+1 each, here and in SGLang), so such a list goes to the top-level key,
        which vLLM and `resolve_capture_layers` read as boundaries (SGLang ignores it).
        `target_hidden_size` is written only when it differs from `hidden_size`: EAGLE's reference
        takes the target's embedding only when the key is absent.
        """
        if self.feed_normed:
            raise ValueError(
                "post-norm feedback (speculators norm_output: true) has no native form"
            )
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": str(torch_dtype).removeprefix("torch."),
        }
        if self.target_hidden_size != self.hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        if self.rope_scaling is not None:
            out["rope_scaling"] = _rope_dict(self.rope_scaling)
        flags = {
            "norm_before_residual": self.norm_before_residual,
            "norm_before_fc": self.norm_before_fc,
            "fc_norm": self.fc_norm,
            "bias": self.fc_bias,
        }
        out.update({k: v for k, v in flags.items() if v})
        if not self.final_norm:
            out["norm_output"] = False  # SpecForge's meaning: no final norm before lm_head
        capture = tuple(capture)
        eagle: dict[str, Any] = {}
        if not self.use_aux_hidden_state:
            eagle["use_aux_hidden_state"] = False
        elif num_target_layers is None or capture != default_capture(num_target_layers):
            (out if capture[0] == 1 else eagle)[_IDS_KEY] = list(capture)
        if eagle:
            out["eagle_config"] = eagle
        return out


def _rope_dict(s: RopeScaling) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": s.kind, "factor": s.factor}
    if s.kind == "llama3":
        out.update(
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position,
        )
    return out


def _parse(cfg: dict[str, Any], fmt: str, source: str) -> DraftConfig:
    act = cfg.get("hidden_act") or "silu"
    if act != "silu":
        raise UnsupportedArchitectureError(f"{source}: draft activation '{act}' (only silu)")
    layers = int(cfg.get("num_hidden_layers") or 1)
    if "sliding_attention" in (cfg.get("layer_types") or [])[:layers]:
        raise UnsupportedArchitectureError(f"{source}: sliding-window draft attention")
    eagle = cfg.get("eagle_config") or {}
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        vocab = int(cfg["vocab_size"])
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.get("rope_theta") or cfg.get("rope_theta") or DEFAULT_ROPE_THETA
        draft_vocab = cfg.get("draft_vocab_size")
        norm_output = cfg.get("norm_output")
        ids, key, convention = _capture_ids(cfg, eagle, source)
        return DraftConfig(
            hidden_size=hidden,
            target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            vocab_size=vocab,
            draft_vocab_size=vocab if draft_vocab is None else int(draft_vocab),
            rope_theta=float(theta),
            rope_scaling=parse_rope_scaling(rope, source=source),
            num_layers=layers,
            # vLLM's speculators adapter defaults this to true; native drafts never set it.
            norm_before_residual=bool(cfg.get("norm_before_residual", fmt == SPECULATORS)),
            norm_before_fc=bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))),
            fc_norm=bool(cfg.get("fc_norm", False)),
            fc_bias=bool(cfg.get("bias", False)),
            use_aux_hidden_state=bool(eagle.get("use_aux_hidden_state", True)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            final_norm=fmt == SPECULATORS or norm_output is None or bool(norm_output),
            feed_normed=fmt == SPECULATORS and bool(norm_output),
            aux_layer_ids=ids,
            aux_layer_convention=convention,
            aux_layer_key=key,
            format=fmt,
            max_position=int(cfg.get("max_position_embeddings") or 2048),
            source=source,
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: missing required key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: malformed value ({e})") from None


def _capture_ids(
    cfg: dict[str, Any], eagle: dict[str, Any], source: str
) -> tuple[tuple[int, ...] | None, str, str]:
    """(ids, config key, convention) per the table in the module docstring."""
    for key, raw in (
        (_IDS_KEY, cfg.get(_IDS_KEY)),
        (f"eagle_config.{_IDS_KEY}", eagle.get(_IDS_KEY)),
    ):
        if not raw:  # absent, null or empty: fall through to the next key or the default
            continue
        if not isinstance(raw, list) or not all(type(i) is int for i in raw):
            raise ModelLoadError(f"{source}: {key} must be a list of integers, got {raw!r}")
        ids = tuple(raw)
        nested_output_of_layer = key.startswith("eagle_config.") and ids[0] == 1
        return ids, key, "output-of-layer" if nested_output_of_layer else "boundary"
    return None, "", "default"


def default_capture(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE's low/mid/high boundaries: the inputs of layers 2, N//2 and N-3. Targets shallower
    than 5 layers (test models) get those clamped into [0, N] and sorted: N = 2 -> (0, 1, 2)."""
    n = num_target_layers
    low, mid, high = sorted(min(max(b, 0), n) for b in (2, n // 2, n - 3))
    return (low, mid, high)


def resolve_capture_layers(
    cfg: DraftConfig, num_target_layers: int, override: Sequence[int] | None = None
) -> tuple[int, ...]:
    """Boundary indices in [0, N] of the target states the draft reads, in fc input order.

    `override` is taken as boundaries, as given (an `InvalidRequestError` if out of range); ids
    from the config are converted per their convention (a `ModelLoadError` naming the config if
    one lands past the target). Example, N = 36: no ids -> (2, 18, 33); eagle_config [1, 17, 33]
    -> (2, 18, 34); eagle_config [2, 18, 33] -> as is; top-level [1, 18, 35] -> as is.
    """
    n = num_target_layers
    if override is not None:
        bounds = tuple(int(b) for b in override)
        wanted = 1 if not cfg.use_aux_hidden_state else len(bounds)
        bad = [b for b in bounds if not 0 <= b <= n]
        if bad or not bounds or len(bounds) != wanted:
            need = "one boundary" if wanted == 1 else "boundaries"
            raise InvalidRequestError(
                f"capture override {list(bounds)}: need {need} in [0, {n}] for a {n}-layer target"
            )
        return bounds
    if not cfg.use_aux_hidden_state:
        return (n,)  # the last layer's pre-norm state, fed without fc
    if cfg.aux_layer_ids is None:
        bounds = default_capture(n)
    elif cfg.aux_layer_convention == "output-of-layer":
        bounds = tuple(i + 1 for i in cfg.aux_layer_ids)
    else:
        bounds = cfg.aux_layer_ids
    for raw, b in zip(cfg.aux_layer_ids or bounds, bounds, strict=True):
        if not 0 <= b <= n:
            via = (
                f"{cfg.aux_layer_key} id {raw} ({cfg.aux_layer_convention})"
                if cfg.aux_layer_ids is not None
                else "the default (2, N//2, N-3)"
            )
            raise ModelLoadError(
                f"{cfg.source}: capture boundary {b} from {via} is outside [0, {n}] "
                f"for a {n}-layer target"
            )
    return bounds


def capture_origin(cfg: DraftConfig, override: Sequence[int] | None = None) -> str:
    """How `resolve_capture_layers` chose its answer, for load reports."""
    if override is not None:
        return "override (boundaries, as given)"
    if not cfg.use_aux_hidden_state:
        return "use_aux_hidden_state false: the last layer's pre-norm state"
    if cfg.aux_layer_ids is None:
        return "default (2, N//2, N-3)"
    shift = " (+1 each)" if cfg.aux_layer_convention == "output-of-layer" else " (as is)"
    ids = list(cfg.aux_layer_ids)
    return f"{cfg.aux_layer_key} {ids}: {cfg.aux_layer_convention} ids{shift}"
