"""Checkpoint readers: a GGUF file or a Hugging Face folder, seen through one interface.

Both present an HF-style config dict and tensors under HF names
(`model.layers.0.self_attn.q_proj.weight`), so `loader.py` maps one naming scheme onto the model.
GGUF names are translated here, llama.cpp's Q/K row permutation is undone here, and quantized
tensors are dequantized on read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from gguf import GGMLQuantizationType
from safetensors import SafetensorError, safe_open

from eaglespec.errors import ModelLoadError, UnsupportedArchitectureError
from eaglespec.gguf_file import GGUFFile
from eaglespec.model.dequant import BlockFields, block_fields

_GGUF_FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

# llama.cpp tensor name -> HF name; `{i}` is the layer index.
_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
    "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
}
# Gemma 3's four norms a layer, as llama.cpp names them (its ffn_norm is the MLP's input norm,
# which Gemma calls pre_feedforward_layernorm).
_GGUF_GEMMA3_NAMES = {
    **_GGUF_NAMES,
    "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.ffn_norm": "model.layers.{i}.pre_feedforward_layernorm",
    "blk.{i}.post_ffw_norm": "model.layers.{i}.post_feedforward_layernorm",
}
_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


class Checkpoint(Protocol):
    path: Path
    config: dict[str, Any]  # HF config.json semantics

    def names(self) -> set[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def load(self, name: str, dtype: torch.dtype) -> torch.Tensor: ...


def open_checkpoint(path: Path) -> Checkpoint:
    if path.is_dir():
        return HFCheckpoint.open(path)
    if path.is_file():
        return GGUFCheckpoint.open(path)
    raise ModelLoadError(f"{path}: no such file or folder")


@dataclass
class GGUFCheckpoint:
    path: Path
    file: GGUFFile
    config: dict[str, Any]
    hf_to_gguf: dict[str, str]
    rope_freq_factors: torch.Tensor | None = None  # llama3 scaling as stored by llama.cpp

    @classmethod
    def open(cls, path: Path) -> GGUFCheckpoint:
        f = GGUFFile.open(path)
        config = gguf_config(f)
        names = _GGUF_GEMMA3_NAMES if config["model_type"] == "gemma3" else _GGUF_NAMES
        hf_to_gguf = {}
        for name in f.tensors:
            hf = _hf_name(name, names)
            if hf is not None:
                hf_to_gguf[hf] = name
        factors = f.load("rope_freqs.weight") if "rope_freqs.weight" in f.tensors else None
        return cls(path, f, config, hf_to_gguf, factors)

    def names(self) -> set[str]:
        return set(self.hf_to_gguf)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file.tensors[self.hf_to_gguf[name]].shape

    def load(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        t = self.file.load(self.hf_to_gguf[name], torch.float32)
        return self._hf_rows(name, t).to(dtype)

    def qtype(self, name: str) -> GGMLQuantizationType:
        """How the file stores tensor `name` (HF name). Read before the loader's shape checks
        (which matrices w4a8-mixed widens), so a missing tensor is named here too."""
        gguf_name = self.hf_to_gguf.get(name)
        if gguf_name is None:
            raise ModelLoadError(f"{self.path}: missing tensor '{name}'")
        return self.file.tensors[gguf_name].qtype

    def fields(self, name: str) -> BlockFields | None:
        """Tensor `name`'s blocks as codes and scales (dequant.block_fields), rows in HF order as
        `load` gives them; None where its type is not one the w4a8 kernels take as stored."""
        gguf_name = self.hf_to_gguf[name]
        info = self.file.tensors[gguf_name]
        f = block_fields(self.file.raw(gguf_name), info.qtype, info.shape)
        return None if f is None else f.map_rows(lambda t: self._hf_rows(name, t))

    def _hf_rows(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Rows of tensor `name` (or of a field of it) as the HF checkpoint orders them."""
        if self.config["model_type"] == "llama" and re.search(r"\.(q|k)_proj\.", name):
            heads_key = "num_attention_heads" if ".q_proj." in name else "num_key_value_heads"
            t = unpermute_qk(t, self.config[heads_key])
        return t


def _hf_name(gguf_name: str, names: dict[str, str]) -> str | None:
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight / bias
    m = _GGUF_BLOCK.match(stem)
    key = f"blk.{{i}}.{m.group(2)}" if m else stem
    hf = names.get(key)
    if hf is None:
        return None
    return f"{hf.format(i=m.group(1)) if m else hf}.{suffix}"


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time row permutation of Q/K for `llama` files.

    llama.cpp interleaves each head's two rotary halves (rows 0, D/2, 1, D/2+1, ...); HF keeps them
    as two blocks. w (out, in) or a bias (out,), out = n_heads * D.
    """
    out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).transpose(1, 2).reshape(out, *rest)


def gguf_config(f: GGUFFile) -> dict[str, Any]:
    """GGUF metadata -> an HF-style config dict. Sizes come from the file, never from its name."""
    meta = f.metadata
    arch = meta.get("general.architecture", "<missing>")
    if arch not in _GGUF_FAMILIES:
        raise UnsupportedArchitectureError(
            f"{f.path}: unsupported architecture '{arch}' (supported: {', '.join(_GGUF_FAMILIES)})"
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{f.path}: missing GGUF metadata key '{arch}.{key}'")
        return value

    if "token_embd.weight" not in f.tensors:
        raise ModelLoadError(f"{f.path}: missing tensor 'token_embd.weight'")
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    cfg: dict[str, Any] = {
        "architectures": [_GGUF_FAMILIES[arch]],
        "model_type": arch,
        "vocab_size": f.tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
        "_name_or_path": str(meta.get("general.name", f.path.name)),
    }
    if arch == "gemma3":
        cfg.update(_gemma3_config(get, cfg))
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(get("rope.scaling.factor")),
            "original_max_position_embeddings": meta.get(
                f"{arch}.rope.scaling.original_context_length"
            ),
        }
    return cfg


def _gemma3_config(get: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """What a Gemma 3 GGUF leaves to the reader, as llama.cpp's own loader fills it in
    (src/llama-model.cpp): every sixth layer global, the sliding layers' RoPE base 10,000, the
    query scale 1/sqrt(head_dim) but 1/sqrt(hidden / heads) for the 62-layer 27B, GELU-tanh."""
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    scalar = hidden // cfg["num_attention_heads"] if layers == 62 else cfg["head_dim"]
    return {
        "sliding_window": int(get("attention.sliding_window")),
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": float(get("rope.freq_base", 1_000_000.0)),
    }


def read_json_object(path: Path) -> dict[str, Any]:
    """A config file that must hold one JSON object; anything else is a one-line ModelLoadError."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


@dataclass
class HFCheckpoint:
    path: Path
    config: dict[str, Any]
    files: dict[str, Path] = field(default_factory=dict)  # tensor name -> safetensors shard
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def open(cls, path: Path) -> HFCheckpoint:
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{path}: no config.json (not a Hugging Face model folder)")
        config = read_json_object(config_path)
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise ModelLoadError(f"{path}: no *.safetensors weights found")
        ckpt = cls(path, config)
        for shard in shards:
            try:
                with safe_open(str(shard), framework="pt") as st:
                    for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                        ckpt.files[name] = shard
                        ckpt.shapes[name] = tuple(st.get_slice(name).get_shape())
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(f"{shard}: unreadable safetensors file ({e})") from None
        return ckpt

    def names(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def load(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        shard = self.files[name]
        try:
            with safe_open(str(shard), framework="pt") as st:
                t: torch.Tensor = st.get_tensor(name)
                return t.to(dtype)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{shard}: cannot read tensor {name} ({e})") from None
