"""EAGLE-3 draft checkpoints: load one against its target, save one, or make a random one.

A checkpoint is a folder with config.json and model.safetensors or pytorch_model.bin (read with
`weights_only=True`; safetensors wins when both exist). Tensor names (spec section 2):
  native       midlayer.*, extra layers midlayers.{i}.* (or layers.{i}.*, as TensorRT-LLM and
               speculators write them), fc, norm, lm_head, d2t (int64), t2d (bool, training only,
               ignored), optional embed_tokens, input_norm, fc_norm.{i}
  speculators  layers.{i}.* for the decoder layers, the rest as native; verifier_* ignored
Layer names are canonicalised to `layers.{i}.<suffix>`; messages quote the file's own names.

The head is built on the meta device and each parameter is read once (fused q/k/v and gate/up,
cast, moved) and assigned. Without `embed_tokens.weight` (or with one equal to the target's) the
head uses the target's embedding module; without `lm_head.weight` it inherits the target's lm_head:
the module itself where the draft vocabulary is the target's whole vocabulary in order, else a
copy of the target's output rows of the draft vocabulary (arange + d2t), as heads trained with a
frozen output layer are saved (`eaglespec train --lm-head target`).
Every problem is a one-line `ModelLoadError` naming the file: config.json for configuration
mismatches with the target, the weights file for tensor problems.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from eaglespec.draft.config import (
    NATIVE,
    DraftConfig,
    capture_origin,
    resolve_capture_layers,
)
from eaglespec.draft.eagle3 import Eagle3Head
from eaglespec.errors import InvalidRequestError, ModelLoadError
from eaglespec.model.checkpoint import read_json_object
from eaglespec.model.layers import rope_inv_freq
from eaglespec.model.llama import Transformer
from eaglespec.model.loader import parse_dtype, split_rows
from eaglespec.model.quant import dense_rows

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_LAYER_NAME = re.compile(r"^(?:midlayer|midlayers\.(\d+)|layers\.(\d+))\.(.+)$")
_IGNORED = re.compile(r"^(?:verifier_.*|t2d|.*rotary_emb\.inv_freq)$")
# Present in some checkpoints but unused under some configs (vLLM skips them the same way).
_TOLERATED = {"d2t", "embed_tokens.weight", "norm.weight", "fc.weight", "input_norm.weight"}
_FLAGS = (
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "use_aux_hidden_state",
    "tie_word_embeddings",
    "final_norm",
    "feed_normed",
)


@dataclass(slots=True)
class DraftLoadReport:
    folder: Path
    weights: Path  # the file the tensors came from
    format: str  # "native" or "speculators"
    dtype: torch.dtype
    capture: tuple[int, ...]  # boundary indices, in fc input order
    capture_origin: str  # how they were resolved (default, config ids and convention, override)
    own_bytes: int  # parameters and buffers the head holds itself
    shared_bytes: int  # the target's tensors it uses instead of its own copies (bytes saved)
    shared: tuple[str, ...]  # which: "embed_tokens", "lm_head"
    flags: dict[str, bool]
    seconds: float


@dataclass(slots=True)
class LoadedDraft:
    head: Eagle3Head
    capture: tuple[int, ...]  # pass to the target's forward(capture=...)
    format: str
    config: DraftConfig
    report: DraftLoadReport


def load_eagle3(
    path: str | Path,
    target: Transformer,
    *,
    capture: Sequence[int] | None = None,
    dtype: str | torch.dtype | None = None,
) -> LoadedDraft:
    """Load a draft for `target` (same device; dtype defaults to the target's). `capture`
    overrides the config's capture layers, as boundaries."""
    start = time.perf_counter()
    folder = Path(path)
    config_path = folder / "config.json"
    cfg = DraftConfig.from_dict(_read_json(config_path), source=str(config_path))
    tcfg = target.cfg
    if cfg.vocab_size != tcfg.vocab_size:
        raise ModelLoadError(
            f"{config_path}: vocab_size {cfg.vocab_size} != the target's vocabulary "
            f"{tcfg.vocab_size}"
        )
    if cfg.target_hidden_size != tcfg.hidden_size:
        raise ModelLoadError(
            f"{config_path}: target_hidden_size {cfg.target_hidden_size} (hidden_size when absent)"
            f" != the target's hidden size {tcfg.hidden_size}"
        )
    bounds = resolve_capture_layers(cfg, tcfg.num_layers, capture)
    file = _weights_file(folder)
    found = _canonical(_read_tensors(file), file)
    want = target.dtype if dtype is None else parse_dtype(dtype)
    head = _build(cfg, bounds, found, target, want, file)
    own, shared, names = _bytes(head, target)
    report = DraftLoadReport(
        folder=folder,
        weights=file,
        format=cfg.format,
        dtype=want,
        capture=bounds,
        capture_origin=capture_origin(cfg, capture),
        own_bytes=own,
        shared_bytes=shared,
        shared=names,
        flags={name: getattr(cfg, name) for name in _FLAGS},
        seconds=time.perf_counter() - start,
    )
    return LoadedDraft(head=head, capture=bounds, format=cfg.format, config=cfg, report=report)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path.parent}: no config.json (not an EAGLE-3 draft folder)")
    return read_json_object(path)


def _weights_file(folder: Path) -> Path:
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    raise ModelLoadError(f"{folder}: no {' or '.join(WEIGHT_FILES)}")


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            return load_file(str(file))
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, EOFError, ValueError, pickle.PickleError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelLoadError(f"{file}: unreadable weights file ({first})") from None
    if not isinstance(obj, dict) or not all(isinstance(t, torch.Tensor) for t in obj.values()):
        raise ModelLoadError(f"{file}: expected a flat dict of tensors")
    return obj


def _canonical(tensors: dict[str, torch.Tensor], file: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """Canonical name -> (name in the file, tensor); training-only tensors dropped."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if _IGNORED.match(name):
            continue
        m = _LAYER_NAME.match(name)
        canon = f"layers.{int(m.group(1) or m.group(2) or 0)}.{m.group(3)}" if m else name
        if canon in out:
            raise ModelLoadError(f"{file}: '{out[canon][0]}' and '{name}' are the same tensor")
        out[canon] = (name, t)
    return out


def _display(canon: str, fmt: str) -> str:
    """Canonical -> the name the format writes (native: midlayer.* / midlayers.{i}.*)."""
    m = _LAYER_NAME.match(canon)
    if fmt != NATIVE or m is None:
        return canon
    i = int(m.group(2))
    return f"midlayer.{m.group(3)}" if i == 0 else f"midlayers.{i}.{m.group(3)}"


def _sources(cfg: DraftConfig, num_aux: int, own_embed: bool, own_lm: bool) -> dict[str, list[str]]:
    """Our parameter name -> canonical checkpoint tensors concatenated (dim 0) to make it."""
    src: dict[str, list[str]] = {}
    if cfg.use_aux_hidden_state:
        if cfg.norm_before_fc:
            src["input_norm.weight"] = ["input_norm.weight"]
        for i in range(num_aux if cfg.fc_norm else 0):
            src[f"fc_norm.{i}.weight"] = [f"fc_norm.{i}.weight"]
        src["fc.weight"] = ["fc.weight"]
        if cfg.fc_bias:
            src["fc.bias"] = ["fc.bias"]
    if own_embed:
        src["embed.weight"] = ["embed_tokens.weight"]
    for i in range(cfg.num_layers):
        ours, ck = ("midlayer" if i == 0 else f"extra_layers.{i - 1}"), f"layers.{i}"
        src[f"{ours}.input_layernorm.weight"] = [f"{ck}.input_layernorm.weight"]
        if i == 0:
            src[f"{ours}.hidden_norm.weight"] = [f"{ck}.hidden_norm.weight"]
        src[f"{ours}.post_attention_layernorm.weight"] = [f"{ck}.post_attention_layernorm.weight"]
        src[f"{ours}.attn.wqkv.weight"] = [f"{ck}.self_attn.{p}_proj.weight" for p in "qkv"]
        src[f"{ours}.attn.wo.weight"] = [f"{ck}.self_attn.o_proj.weight"]
        src[f"{ours}.mlp.w13.weight"] = [f"{ck}.mlp.gate_proj.weight", f"{ck}.mlp.up_proj.weight"]
        src[f"{ours}.mlp.w2.weight"] = [f"{ck}.mlp.down_proj.weight"]
    if cfg.final_norm or cfg.feed_normed:
        src["norm.weight"] = ["norm.weight"]
    if own_lm:
        src["lm_head.weight"] = ["lm_head.weight"]
    return src


def _build(
    cfg: DraftConfig,
    capture: tuple[int, ...],
    found: dict[str, tuple[str, torch.Tensor]],
    target: Transformer,
    dtype: torch.dtype,
    file: Path,
) -> Eagle3Head:
    own_embed = _own_embedding(cfg, found, target, file)
    own_lm = "lm_head.weight" in found or cfg.tie_word_embeddings
    target_width = target.cfg.hidden_size  # what the target's output rows read
    if not own_lm and cfg.hidden_size != target_width:
        raise ModelLoadError(
            f"{file}: no lm_head.weight, and the target's output rows (width {target_width}) "
            f"cannot serve a draft of width {cfg.hidden_size}"
        )
    d2t = _vocab_map(cfg, found, file)
    # No lm_head of its own: the target's module where the draft vocabulary is all of it in
    # order, else a copy of the target's rows of the draft vocabulary.
    whole = cfg.draft_vocab_size == cfg.vocab_size and not bool(d2t.any())  # sync: once
    share_lm = not own_lm and whole
    if dtype != target.dtype and not (own_embed and not share_lm):
        raise InvalidRequestError(
            f"{file}: the draft shares the target's tensors, so it must use the target's dtype "
            f"{target.dtype}, not {dtype}"
        )
    sources = _sources(cfg, len(capture), own_embed, own_lm and not cfg.tie_word_embeddings)
    _check_layout(cfg, capture, found, sources, file)
    with torch.device("meta"):
        head = Eagle3Head(
            cfg,
            len(capture),
            embed=None if own_embed else target.embed,
            lm_head=target.lm_head if share_lm else None,
        )
    device = target.device
    state = _read_params(cfg, sources, dict(head.named_parameters()), found, dtype, file)
    state = {name: t.to(device) for name, t in state.items()} | {"d2t": d2t.to(device)}
    if not own_lm and not share_lm:
        ids = (torch.arange(cfg.draft_vocab_size) + d2t).to(device)  # (Vd,) target ids
        state["lm_head.weight"] = dense_rows(target.lm_head, ids).to(dtype)  # (Vd, C)
        head.lm_head_is_target_rows = True
    head.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        head.lm_head.weight = head.embed.weight  # assign=True replaced the shared Parameter
    head.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    left = [n for n, t in (*head.named_parameters(), *head.named_buffers()) if t.is_meta]
    assert not left, f"draft tensors with no checkpoint source: {left}"
    return _frozen(head, target)


def _check_layout(
    cfg: DraftConfig,
    capture: tuple[int, ...],
    found: dict[str, tuple[str, torch.Tensor]],
    sources: dict[str, list[str]],
    file: Path,
) -> None:
    """fc's in-dim against the capture, and no tensor this config does not explain."""
    A, Ct = len(capture), cfg.target_hidden_size
    fc = found.get("fc.weight")
    if cfg.use_aux_hidden_state and fc is not None and fc[1].ndim == 2 and fc[1].shape[1] != A * Ct:
        raise ModelLoadError(
            f"{file}: fc.weight has in-dim {fc[1].shape[1]}, but capture {list(capture)} gives "
            f"{A} states of width {Ct} ({A * Ct})"
        )
    used = {name for names in sources.values() for name in names} | _TOLERATED
    extra = [found[c][0] for c in found if c not in used and c != "lm_head.weight"]
    if extra:
        raise ModelLoadError(
            f"{file}: unexpected tensor '{extra[0]}' ({len(extra)} in all): a draft variant "
            "this config does not describe"
        )


def _read_params(
    cfg: DraftConfig,
    sources: dict[str, list[str]],
    expected: dict[str, torch.nn.Parameter],
    found: dict[str, tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    file: Path,
) -> dict[str, torch.Tensor]:
    """Each parameter from its sources: shape-checked, cast, fused along dim 0."""
    state: dict[str, torch.Tensor] = {}
    for ours, names in sources.items():
        want = tuple(expected[ours].shape)
        parts = []
        for name, rows in zip(names, split_rows(ours, want[0], cfg), strict=True):
            if name not in found:
                raise ModelLoadError(f"{file}: missing tensor '{_display(name, cfg.format)}'")
            in_file, t = found[name]
            if tuple(t.shape) != (rows, *want[1:]):
                raise ModelLoadError(
                    f"{file}: tensor '{in_file}' has shape {tuple(t.shape)}, "
                    f"expected {(rows, *want[1:])}"
                )
            if not t.is_floating_point():
                raise ModelLoadError(f"{file}: tensor '{in_file}' has dtype {t.dtype}, not float")
            parts.append(t.to(dtype))
        state[ours] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return state


def _own_embedding(
    cfg: DraftConfig, found: dict[str, tuple[str, torch.Tensor]], target: Transformer, file: Path
) -> bool:
    """Whether the head needs its own embedding: the file has one that differs from the target's
    (SpecForge exports copy the target's; sharing it saves V*C parameters)."""
    width, target_width = cfg.hidden_size, target.cfg.hidden_size
    if "embed_tokens.weight" in found:
        t = found["embed_tokens.weight"][1]
        tw = target.embed.weight
        same = tuple(t.shape) == tuple(tw.shape) and torch.equal(
            t.to(device=tw.device, dtype=tw.dtype), tw
        )
        return not same
    if width != target_width:
        raise ModelLoadError(
            f"{file}: no embed_tokens.weight, and the draft's hidden size {width} differs from "
            f"the target's {target_width}, so the target's embedding cannot be shared"
        )
    return False


def _vocab_map(
    cfg: DraftConfig, found: dict[str, tuple[str, torch.Tensor]], file: Path
) -> torch.Tensor:
    """The checked d2t offsets (Vd,) int64: arange + d2t must be distinct ids in [0, V)."""
    Vd, V = cfg.draft_vocab_size, cfg.vocab_size
    if "d2t" not in found:
        if Vd != V:
            raise ModelLoadError(
                f"{file}: missing tensor 'd2t' (draft_vocab_size {Vd} < vocab {V} needs the map)"
            )
        return torch.zeros(Vd, dtype=torch.int64)
    d2t = found["d2t"][1]
    if d2t.is_floating_point() or d2t.dtype == torch.bool or d2t.ndim != 1:
        raise ModelLoadError(
            f"{file}: d2t must be a 1-D integer tensor, found {d2t.dtype} {tuple(d2t.shape)}"
        )
    if d2t.numel() != Vd:
        raise ModelLoadError(f"{file}: d2t has {d2t.numel()} entries, draft_vocab_size is {Vd}")
    d2t = d2t.to(torch.int64)
    ids = torch.arange(Vd) + d2t  # (Vd,) target ids
    outside = ((ids < 0) | (ids >= V)).nonzero()  # sync: once, at load
    if outside.numel():
        i = int(outside[0, 0])
        raise ModelLoadError(
            f"{file}: d2t maps draft id {i} to target id {int(ids[i])}, outside the target "
            f"vocabulary [0, {V})"
        )
    ordered = ids.sort().values
    dup = (ordered[1:] == ordered[:-1]).nonzero()  # sync: once, at load
    if dup.numel():
        raise ModelLoadError(
            f"{file}: d2t maps several draft ids to target id {int(ordered[int(dup[0, 0])])} "
            "(arange + d2t must be unique)"
        )
    return d2t


def _frozen(head: Eagle3Head, target: Transformer) -> Eagle3Head:
    """Inference mode for the head's own parameters; the target's stay as the target has them."""
    shared = {id(p) for p in target.parameters()}
    for p in head.parameters():
        if id(p) not in shared:
            p.requires_grad_(False)
    return head.eval()


def _bytes(head: Eagle3Head, target: Transformer) -> tuple[int, int, tuple[str, ...]]:
    """(own bytes, shared bytes, shared module names); a tensor used twice counts once."""
    theirs = {id(t) for t in (*target.parameters(), *target.buffers())}
    own = shared = 0
    seen: set[int] = set()
    for t in (*head.parameters(), *head.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            size = t.numel() * t.element_size()
            shared, own = (shared + size, own) if id(t) in theirs else (shared, own + size)
    modules = (("embed_tokens", head.embed), ("lm_head", head.lm_head))
    names = [n for n, m in modules if any(id(t) in theirs for t in (*m.parameters(), *m.buffers()))]
    if head.lm_head_is_target_rows:  # a copy, but of the target's rows: not stored with the head
        rows = sum(t.numel() * t.element_size() for t in head.lm_head.parameters())
        own, shared = own - rows, shared + rows
        names.append("lm_head rows")
    return own, shared, tuple(names)


def save_eagle3(
    head: Eagle3Head,
    path: str | Path,
    capture: Sequence[int],
    *,
    num_target_layers: int | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `head` in the native layout: config.json (`LlamaForCausalLMEagle3`) and
    model.safetensors (midlayer.*, midlayers.{i}.*, fc, norm, lm_head, d2t, t2d; no embed_tokens
    or lm_head when they are the target's).

    `dtype` casts the floating-point tensors as they are written (d2t stays int64, t2d bool) and
    is the config's `torch_dtype`; None writes the head's own dtype. The head is never cast: its
    embedding or lm_head may be the target's modules.

    Capture ids are written as boundaries, only when they differ from the default for
    `num_target_layers` (see `DraftConfig.to_native_dict`). When they go under `eagle_config`
    (SGLang reads only that key), the same boundaries also go to the top-level key, the only one
    vLLM reads (`get_eagle3_aux_layers_from_config`); our loader prefers the top-level key.
    """
    cfg = head.cfg
    capture = tuple(int(b) for b in capture)
    if len(capture) != head.num_aux:
        raise ValueError(
            f"capture {list(capture)} has {len(capture)} ids, head takes {head.num_aux}"
        )
    want = head.dtype if dtype is None else dtype
    if not want.is_floating_point:
        raise ValueError(f"save dtype must be a floating-point dtype, got {want}")
    config = cfg.to_native_dict(capture, num_target_layers, torch_dtype=want)
    ids_key = "eagle_aux_hidden_state_layer_ids"
    nested = config.get("eagle_config", {}).get(ids_key)
    if nested is not None:
        config.setdefault(ids_key, list(nested))
    tensors = {
        name: t.to(want) if t.is_floating_point() else t
        for name, t in _native_tensors(head).items()
    }
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _native_tensors(head: Eagle3Head) -> dict[str, torch.Tensor]:
    cfg = head.cfg
    stored_lm = not head.shares_lm_head and not head.lm_head_is_target_rows
    own_lm = stored_lm and not cfg.tie_word_embeddings
    params = dict(head.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for ours, names in _sources(cfg, head.num_aux, not head.shares_embed, own_lm).items():
        t = params[ours].detach()
        for name, part in zip(
            names, torch.split(t, split_rows(ours, t.shape[0], cfg)), strict=True
        ):
            out[_display(name, NATIVE)] = part.contiguous().cpu().clone()
    if own_lm or head.lm_head_is_target_rows:  # the rows' map, read back at load
        d2t = head.d2t.detach().cpu().clone()
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + d2t] = True
        out["d2t"], out["t2d"] = d2t, t2d
    return out


def random_eagle3(
    target: Transformer,
    *,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    capture: Sequence[int] | None = None,
) -> Eagle3Head:
    """A seeded random head for `target` (its dims, its embedding shared, own lm_head over
    `draft_vocab_size` target ids drawn at random). Linear weights ~ N(0, 1/fan_in) keep
    activations O(1); norms are ones. `capture` only sets how many states fc takes (default 3)."""
    tcfg = target.cfg
    cfg = DraftConfig.like_target(tcfg, draft_vocab_size=draft_vocab_size)
    num_aux = 3 if capture is None else len(resolve_capture_layers(cfg, tcfg.num_layers, capture))
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        head = Eagle3Head(cfg, num_aux, embed=target.embed)
    state: dict[str, torch.Tensor] = {}
    for name, p in head.named_parameters():
        if p is target.embed.weight:
            continue
        if p.ndim == 1:
            state[name] = torch.ones(p.shape)
        else:
            state[name] = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])
    Vd = cfg.draft_vocab_size
    ids = torch.randperm(cfg.vocab_size, generator=gen)[:Vd].sort().values  # ascending, as EAGLE
    device, dtype = target.device, target.dtype
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    state["d2t"] = (ids - torch.arange(Vd)).to(device)
    head.load_state_dict(state, strict=False, assign=True)
    head.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    return _frozen(head, target)
