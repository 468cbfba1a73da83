"""Build a `Transformer` from a checkpoint: config from the checkpoint itself, the module on the
meta device, then each parameter read once (dequantized, fused, cast) and assigned without copies.
Weight-only quantization (`quant`, see model/quant.py) is applied last, whatever the source,
but for a GGUF's linears under w4a8, which are made from its blocks as they load
(`stored_layers`).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from eaglespec.config import ModelConfig
from eaglespec.errors import InvalidRequestError, ModelLoadError
from eaglespec.model import cpu_attention, cpu_layer, cpu_rowops, w4a8
from eaglespec.model.checkpoint import Checkpoint, GGUFCheckpoint, open_checkpoint
from eaglespec.model.dequant import FIELD_BITS, BlockFields
from eaglespec.model.layers import rope_inv_freq
from eaglespec.model.llama import Transformer
from eaglespec.model.precision import AUTO, FOUR_BIT, Precision, choose
from eaglespec.model.quant import check_quant_mode, quantize_model, w4a8_bits
from eaglespec.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    seconds: float  # wall time of the whole load
    precision: Precision  # the dtype and quantization it runs at ("auto" resolved)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    key = aliases.get(name, name)
    if key not in DTYPES:
        raise InvalidRequestError(f"unknown dtype '{name}' (choose from {', '.join(DTYPES)})")
    return DTYPES[key]


def dtype_name(name: str | torch.dtype) -> str:
    """A dtype argument's canonical name ("float32", "bfloat16", "float16"), or "auto"."""
    return AUTO if name == AUTO else str(parse_dtype(name)).removeprefix("torch.")


def check_quant(quant: str) -> str:
    """A quant argument: "auto" or a supported mode (else an error naming the modes)."""
    return quant if quant == AUTO else check_quant_mode(quant)


def load_model(
    path: str | Path,
    *,
    dtype: str | torch.dtype = torch.float32,
    device: str = "cpu",
    quant: str = "none",
) -> LoadedModel:
    """`quant` "int8" quantizes the linear layers after loading (from the weights in `dtype`);
    the int8 kernel runs bf16 activations inside each layer whatever `dtype` is. `dtype` and
    `quant` "auto" run a 4-bit GGUF at its own precision on a CPU (model/precision.py)."""
    start = time.perf_counter()
    path = Path(path)
    check_quant(quant)  # before the (slow) load, not after
    ckpt = open_checkpoint(path)
    storage = None
    if isinstance(ckpt, GGUFCheckpoint):
        storage = {name: info.qtype.name for name, info in ckpt.file.tensors.items()}
    precision = choose(
        dtype_name(dtype),
        quant,
        device=torch.device(device).type,
        storage=storage,
        w4a8_missing=w4a8.available,
    )
    cfg = ModelConfig.from_hf_dict(ckpt.config, source=str(path))
    wide = wide_matrices(ckpt, cfg) if precision.quant == "w4a8-mixed" else frozenset()
    # (the w4a8 kernels are CPU only: elsewhere quantize_model refuses the mode by name)
    on_cpu = torch.device(device).type == "cpu"
    stored = stored_layers(ckpt, cfg, precision.quant, wide) if on_cpu else {}
    model = build_model(ckpt, cfg, parse_dtype(precision.dtype), torch.device(device), stored)
    quantize_model(model, precision.quant, wide)  # the linears `stored` did not make
    if on_cpu:
        # eaglespec's CPU kernels are built on first use (seconds, once per machine; loaded
        # from torch's extension cache after): here, not inside the first chat turn or request
        cpu_attention.available()
        cpu_rowops.available()
        if precision.quant.startswith("w4a8"):
            cpu_layer.available()
    if isinstance(ckpt, GGUFCheckpoint):
        tokenizer = Tokenizer.from_gguf_metadata(ckpt.file.metadata)
    else:
        tokenizer = Tokenizer.from_hf_folder(path)
    return LoadedModel(model, tokenizer, cfg, path, time.perf_counter() - start, precision)


def parameter_sources(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our parameter name -> the HF tensors concatenated (along dim 0) to make it."""
    src: dict[str, list[str]] = {
        "embed.weight": ["model.embed_tokens.weight"],
        "norm.weight": ["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        src["lm_head.weight"] = ["lm_head.weight"]
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        attn, mlp = f"{hf}.self_attn", f"{hf}.mlp"
        src[f"{ours}.attn_norm.weight"] = [f"{hf}.input_layernorm.weight"]
        if cfg.sandwich_norms:  # Gemma 3: post_attention_layernorm norms attention's output
            src[f"{ours}.post_attn_norm.weight"] = [f"{hf}.post_attention_layernorm.weight"]
            src[f"{ours}.mlp_norm.weight"] = [f"{hf}.pre_feedforward_layernorm.weight"]
            src[f"{ours}.post_mlp_norm.weight"] = [f"{hf}.post_feedforward_layernorm.weight"]
        else:
            src[f"{ours}.mlp_norm.weight"] = [f"{hf}.post_attention_layernorm.weight"]
        src[f"{ours}.attn.wqkv.weight"] = [f"{attn}.{p}_proj.weight" for p in "qkv"]
        src[f"{ours}.attn.wo.weight"] = [f"{attn}.o_proj.weight"]
        src[f"{ours}.mlp.w13.weight"] = [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"]
        src[f"{ours}.mlp.w2.weight"] = [f"{mlp}.down_proj.weight"]
        if cfg.qkv_bias:
            src[f"{ours}.attn.wqkv.bias"] = [f"{attn}.{p}_proj.bias" for p in "qkv"]
        if cfg.o_bias:
            src[f"{ours}.attn.wo.bias"] = [f"{attn}.o_proj.bias"]
        if cfg.mlp_bias:
            src[f"{ours}.mlp.w13.bias"] = [f"{mlp}.gate_proj.bias", f"{mlp}.up_proj.bias"]
            src[f"{ours}.mlp.w2.bias"] = [f"{mlp}.down_proj.bias"]
        if cfg.qk_norm:
            src[f"{ours}.attn.q_norm.weight"] = [f"{attn}.q_norm.weight"]
            src[f"{ours}.attn.k_norm.weight"] = [f"{attn}.k_norm.weight"]
    return src


def build_model(
    ckpt: Checkpoint,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    stored: Mapping[str, StoredLayer] | None = None,
) -> Transformer:
    """The model with every parameter read from `ckpt` in `dtype`, except the linears in `stored`
    (`stored_layers`), which are made as w4a8 layers source by source (`source_fields`): their
    dense weights are never made whole."""
    stored = stored or {}
    factors = ckpt.rope_freq_factors if isinstance(ckpt, GGUFCheckpoint) else None
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, factors)
    with torch.device("meta"):
        model = Transformer(cfg, inv_freq=inv_freq)
    expected = dict(model.named_parameters())  # tied lm_head appears once, as embed.weight
    available = ckpt.names()
    state: dict[str, torch.Tensor] = {}
    for ours, sources in parameter_sources(cfg).items():
        check_sources(ckpt, cfg, available, ours, sources, tuple(expected[ours].shape))
        if ours.removesuffix(".weight") not in stored:
            state[ours] = read_parameter(ckpt, cfg, ours, sources, dtype, device)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight  # assign=True replaced the shared Parameter
    assert isinstance(ckpt, GGUFCheckpoint) or not stored, "stored layers come from a GGUF"
    for path, layer in stored.items():
        parent, _, name = path.rpartition(".")
        bias = model.get_submodule(path).bias
        fields = [source_fields(ckpt, s, layer.bits, dtype) for s in layer.sources]
        made = w4a8.from_fields(
            BlockFields.stack_rows(fields), None if bias is None else bias.detach()
        )
        setattr(model.get_submodule(parent), name, made)
    model.inv_freq = inv_freq.to(device)
    if cfg.rope_local_theta is not None:  # made on the meta device with the module
        model.inv_freq_local = rope_inv_freq(cfg.head_dim, cfg.rope_local_theta, None).to(device)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    assert not left, f"parameters with no checkpoint source: {left}"
    return model.eval().requires_grad_(False)


def check_sources(
    ckpt: Checkpoint,
    cfg: ModelConfig,
    available: Collection[str],  # ckpt.names()
    ours: str,
    sources: list[str],
    want: tuple[int, ...],
) -> None:
    """Every source tensor of parameter `ours` (shape `want`) present, of the rows it gives."""
    for name, rows in zip(sources, split_rows(ours, want[0], cfg), strict=True):
        if name not in available:
            raise ModelLoadError(f"{ckpt.path}: missing tensor '{name}'")
        if tuple(ckpt.shape(name)) != (rows, *want[1:]):
            raise ModelLoadError(
                f"{ckpt.path}: tensor '{name}' has shape {tuple(ckpt.shape(name))}, "
                f"the config implies {(rows, *want[1:])}"
            )


def read_parameter(
    ckpt: Checkpoint,
    cfg: ModelConfig,
    ours: str,
    sources: list[str],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Parameter `ours` in `dtype` on `device`: its sources dequantized and concatenated."""
    offset = norm_offset(ckpt, cfg)
    parts = []
    for name in sources:
        if offset and ours.endswith("norm.weight"):  # in fp32, then to the dtype
            parts.append((ckpt.load(name, torch.float32) + offset).to(dtype))
        else:
            parts.append(ckpt.load(name, dtype))
    tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return column_major(ours, tensor.to(device), device)


@dataclass(frozen=True)
class StoredLayer:
    """A linear that a w4a8 quant makes from a GGUF source by source (`stored_layers`)."""

    sources: list[str]  # HF names, rows in order
    bits: int  # the kernel width the quant runs it at (quant.w4a8_bits)


def source_fields(ckpt: GGUFCheckpoint, name: str, bits: int, dtype: torch.dtype) -> BlockFields:
    """Source tensor `name`'s rows of a `bits`-bit w4a8 layer. Where the file stores it as a type
    whose blocks are the kernel's form (dequant.FIELD_BITS: Q4_0, Q4_1 or Q4_K for 4 bits, Q8_0
    for 8), its blocks as they are (`GGUFCheckpoint.fields`); else fitted from its weights
    dequantized to `dtype`, as quant.py fits a whole layer (the same bytes: the fit is per
    group), without int4_codes' search for groups on a coarser grid, which only 4-bit blocks have
    (none of Qwen2.5-Coder-1.5B's 13.5M Q6_K groups is one; the search was 24 of its 44 s)."""
    qtype = ckpt.qtype(name)
    fields = ckpt.fields(name) if FIELD_BITS.get(qtype) == bits else None
    if fields is not None and not (bits == 8 and bool((fields.codes == -128).any())):  # host sync
        return fields  # (a Q8_0 code of -128 is outside the 8-bit kernel's codes: fitted)
    return w4a8.fit_fields(ckpt.load(name, dtype), bits, fit_spans=qtype.name in FOUR_BIT)


def stored_layers(
    ckpt: Checkpoint, cfg: ModelConfig, quant: str, wide: Collection[str] = ()
) -> dict[str, StoredLayer]:
    """Under a w4a8 `quant`, a GGUF's decoder linears and output head (module path -> sources
    and width), made source by source (`source_fields`) rather than from a dense model by
    quantize_model. Where a source is stored as the kernel's form its blocks go in as they are;
    the fitting path (quant.py) dequantizes to the model's dtype and re-derives codes and scales
    from the values: the same bytes for SmolLM2's Q4_1 and Q8_0 (its weights were bf16 to begin
    with), 4x further from a Q4_K file's weights than its blocks' own fp16-rounded scales (mean
    error, Qwen2.5-Coder-0.5B), and most of a load's time (SmolLM2 2.4 -> 0.9 s,
    Qwen2.5-Coder-1.5B 98 -> 12 s: BENCHMARKS.md). A tied output head reads the embedding's
    blocks; the embedding itself stays dense."""
    if not isinstance(ckpt, GGUFCheckpoint) or w4a8_bits(quant, "") is None:
        return {}
    linears = {
        ours.removesuffix(".weight"): sources
        for ours, sources in parameter_sources(cfg).items()
        if ours.endswith((*_DECODER_LINEARS, "lm_head.weight"))
    }
    if cfg.tie_word_embeddings:
        linears["lm_head"] = ["model.embed_tokens.weight"]
    return {
        path: StoredLayer(sources, w4a8_bits(quant, path, wide) or 0)
        for path, sources in linears.items()
    }


def wide_matrices(ckpt: Checkpoint, cfg: ModelConfig) -> frozenset[str]:
    """The decoder linears (module paths, "layers.0.attn.wqkv") any of whose source matrices a
    GGUF stores above 4 bits: w4a8-mixed runs them through the 8-bit kernel."""
    if not isinstance(ckpt, GGUFCheckpoint):
        return frozenset()
    return frozenset(
        ours.removesuffix(".weight")
        for ours, sources in parameter_sources(cfg).items()
        if ours.endswith(_DECODER_LINEARS)
        and any(ckpt.qtype(s).name not in FOUR_BIT for s in sources)
    )


def norm_offset(ckpt: Checkpoint, cfg: ModelConfig) -> float:
    """What to add to a checkpoint's RMSNorm weights to get the factor the model multiplies by.
    Gemma's norms multiply by (1 + weight) and its Hugging Face checkpoints store the weight;
    llama.cpp's converter stores 1 + weight in GGUF files (transformers' GGUF reader subtracts the
    1 again), so those are taken as they are."""
    if cfg.family == "gemma3" and not isinstance(ckpt, GGUFCheckpoint):
        return 1.0
    return 0.0


class FusedSizes(Protocol):
    """What splitting a fused parameter needs; ModelConfig and DraftConfig both provide it."""

    @property
    def q_size(self) -> int: ...
    @property
    def kv_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...


def split_rows(ours: str, rows: int, cfg: FusedSizes) -> list[int]:
    """Rows each source contributes to a fused parameter (dim 0 of weight or bias): q/k/v for
    `wqkv`, gate/up for `w13`, one source otherwise."""
    if ".wqkv." in ours:
        return [cfg.q_size, cfg.kv_size, cfg.kv_size]
    if ".w13." in ours:
        return [cfg.intermediate_size, cfg.intermediate_size]
    return [rows]


_DECODER_LINEARS = (".attn.wqkv.weight", ".attn.wo.weight", ".mlp.w13.weight", ".mlp.w2.weight")


def column_major(name: str, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """On CPU, a decoder layer's weight (out, in) is kept as the transpose of a contiguous
    (in, out) tensor: same values and shape, but F.linear then hands the kernel a row-major
    (in, out) matrix, which on CPU is 1.5-4x faster for the 4-16 rows of a verify forward than
    nn.Linear's usual layout (benchmarks/small_m_matmul.py; one row costs the same). The embedding
    and a tied lm_head keep the row-major layout the embedding lookup needs. Done per tensor at
    load: no second copy of the model is ever alive."""
    if device.type != "cpu" or not name.endswith(_DECODER_LINEARS):
        return tensor
    return tensor.t().contiguous().t()
