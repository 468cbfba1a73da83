"""`eaglespec export`: rewrite any EAGLE-3 draft `load_eagle3` reads (native or speculators
layout, safetensors or .bin) as a native `LlamaForCausalLMEagle3` folder, the layout vLLM, SGLang
and llama.cpp's converter read (docs/training.md, "Export format", lists what each one needs).

The draft is loaded against its target, so every check the loader makes (shapes, d2t, capture
against the target's depth, fc's in-dim) runs before anything is written; then `save_eagle3`
writes it through a temporary sibling folder renamed into place, so OUT never holds half a head.
What carries over: the architecture flags (`norm_before_residual`, `fc_norm`, ... see
`DraftConfig.to_native_dict`), the capture boundaries (written only when not the default), the
draft's own RoPE base, and the bookkeeping keys of a transformers config.json (`bos_token_id`,
`eos_token_id`, `pad_token_id`, `initializer_range`, `use_cache`: the source's values, else the
target tokenizer's ids, else null). What is dropped: an `embed_tokens` equal to the target's, and
training-only `verifier_*` tensors. What is added: a head whose output layer is the target's rows
of its draft vocabulary (trained frozen, stored without them) gets those rows as its
`lm_head.weight`, since the other readers take a reduced-vocabulary lm_head only from the file.
A speculators draft whose `norm_output: true` feeds the post-norm state back has no native form
(native readers take `norm_output` as "final norm before lm_head"), so it is refused rather than
written with a different meaning.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eaglespec.cliargs import int_list
from eaglespec.draft.config import DraftConfig
from eaglespec.draft.loader import load_eagle3, save_eagle3
from eaglespec.errors import (
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from eaglespec.model.checkpoint import read_json_object
from eaglespec.model.llama import Transformer
from eaglespec.model.loader import load_model, parse_dtype
from eaglespec.registry import resolve_model
from eaglespec.tokenizer import Tokenizer

SAVE_DTYPES = ("bfloat16", "float16", "float32")
_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
_FLAG_KEYS = ("norm_before_residual", "norm_before_fc", "fc_norm", "bias", "norm_output")
# (source key, default): the transformers bookkeeping keys the real LLaMA-3.1-8B draft config has
# and `to_native_dict` does not write. `transformers_version` is left out on purpose: it names
# the library that wrote the file, and transformers did not write this one.
_HF_KEYS: tuple[tuple[str, Any], ...] = (
    ("bos_token_id", None),
    ("eos_token_id", None),
    ("pad_token_id", None),
    ("initializer_range", 0.02),
    ("use_cache", True),
)


@dataclass(slots=True)
class ExportReport:
    draft: Path
    out: Path
    format: str  # the source layout: "native" or "speculators"
    dtype: torch.dtype  # of the floating-point tensors written
    tensors: int  # tensors in out/model.safetensors
    bytes: int  # size of out/model.safetensors
    capture: tuple[int, ...]  # boundaries the head reads, in fc input order
    capture_origin: str  # how the loader resolved them
    capture_written: bool  # ids in config.json; False: the default (2, N//2, N-3), implied
    shared: tuple[str, ...]  # the target's modules the head uses, not written
    flags: tuple[str, ...]  # non-default architecture keys kept in config.json
    notes: tuple[str, ...]  # reader-specific caveats (docs/training.md, "Export format")
    seconds: float

    def line(self) -> str:
        written = "written to config.json" if self.capture_written else "default, not written"
        shared = f"; {', '.join(self.shared)} shared with the target" if self.shared else ""
        flags = f"; flags {', '.join(self.flags)}" if self.flags else ""
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"exported {self.format} draft {self.draft} -> {self.out} (native): {self.tensors} "
            f"tensors, {self.bytes:,} bytes {dtype}; capture {list(self.capture)} ({written})"
            f"{shared}{flags}; {self.seconds:.1f} s"
        )


def export_head(
    draft: str | Path,
    target: str | Path,
    out: str | Path,
    *,
    dtype: str = "bfloat16",
    capture: Sequence[int] | None = None,
) -> ExportReport:
    """Export `draft` for `target` (registry name, GGUF file or HF folder) into `out`.
    The target is loaded in the export dtype (it only serves shape checks and sharing)."""
    want = parse_dtype(dtype)
    _read_source(Path(draft))  # a bad draft fails before the (slow) target load
    _check_out(Path(draft), Path(out))
    loaded = load_model(resolve_model(str(target)), dtype=want)
    return export_for_target(
        draft, loaded.model, out, dtype=want, capture=capture, tokenizer=loaded.tokenizer
    )


def export_for_target(
    draft: str | Path,
    target: Transformer,
    out: str | Path,
    *,
    dtype: str | torch.dtype = torch.bfloat16,
    capture: Sequence[int] | None = None,
    tokenizer: Tokenizer | None = None,
) -> ExportReport:
    """`export_head` with the target already loaded (its dtype is the load dtype; tensors are
    cast to `dtype` as they are written). `capture` overrides the draft's boundaries."""
    start = time.perf_counter()
    folder, out = Path(draft), Path(out)
    want = parse_dtype(dtype)  # one of SAVE_DTYPES, else an InvalidRequestError
    source = _read_source(folder)
    _check_out(folder, out)
    loaded = load_eagle3(folder, target, capture=capture)
    loaded.head.lm_head_is_target_rows = False  # the rows go into the file (module doc)
    shared = tuple(n for n in loaded.report.shared if n != "lm_head rows")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        save_eagle3(
            loaded.head, tmp, loaded.capture, num_target_layers=target.cfg.num_layers, dtype=want
        )
        config = _complete_config(tmp / "config.json", source, tokenizer)
        if out.is_dir():
            out.rmdir()  # empty (checked): rename will not replace a non-empty folder
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    weights = out / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        count = len(list(f.keys()))
    return ExportReport(
        draft=folder,
        out=out,
        format=loaded.format,
        dtype=want,
        tensors=count,
        bytes=weights.stat().st_size,
        capture=loaded.capture,
        capture_origin=loaded.report.capture_origin,
        capture_written=_IDS_KEY in config or _IDS_KEY in config.get("eagle_config", {}),
        shared=shared,
        flags=tuple(k for k in _FLAG_KEYS if k in config),
        notes=_reader_notes(loaded.config, config, len(loaded.capture), shared),
        seconds=time.perf_counter() - start,
    )


def _read_source(folder: Path) -> dict[str, Any]:
    """The draft's config.json as one flat dict (speculators' layer config merged up), after
    refusing what the native format cannot express."""
    if not folder.is_dir():
        raise ModelNotFoundError(f"{folder}: no such draft folder")
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no config.json (not an EAGLE-3 draft folder)")
    raw = read_json_object(path)
    cfg = DraftConfig.from_dict(raw, source=str(path))
    if cfg.feed_normed:
        raise UnsupportedArchitectureError(
            f"{path}: norm_output true (the post-norm state feeds the next draft step) has no "
            "native form: native readers take norm_output as 'final norm before lm_head'; "
            "serve this draft in its speculators layout instead"
        )
    layer = raw.get("transformer_layer_config")
    return {**(layer if isinstance(layer, dict) else {}), **raw}


def _check_out(draft: Path, out: Path) -> None:
    if out.resolve() == draft.resolve():
        raise InvalidRequestError(f"--out {out} is the draft folder itself; choose a new folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidRequestError(f"--out {out} already exists and is not an empty folder")


def _complete_config(
    path: Path, source: dict[str, Any], tokenizer: Tokenizer | None
) -> dict[str, Any]:
    """Add the bookkeeping keys to the written config.json; returns the final config."""
    config: dict[str, Any] = json.loads(path.read_text())
    fallback: dict[str, Any] = {}
    if tokenizer is not None:
        eos = tokenizer.eos_ids[0] if tokenizer.eos_ids else None
        fallback = {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos}
    for key, default in _HF_KEYS:
        config.setdefault(key, source.get(key, fallback.get(key, default)))
    path.write_text(json.dumps(config, indent=2) + "\n")
    return config


def _reader_notes(
    cfg: DraftConfig, config: dict[str, Any], num_aux: int, shared: Sequence[str]
) -> tuple[str, ...]:
    """Where a reader would run this head differently from us (read from their loaders)."""
    notes = []
    if _IDS_KEY not in config.get("eagle_config", {}) and _IDS_KEY in config:
        notes.append(
            "capture starts at boundary 1, which has no eagle_config form: SGLang, which reads "
            "only eagle_config ids, will capture its default (2, N//2, N-3)"
        )
    if _IDS_KEY in config:
        notes.append(
            "capture is not the default: llama.cpp's converter always uses (2, N//2, N-3), and "
            "SGLang before PR #25454 adds 1 to every eagle_config id"
        )
    if num_aux != 3:
        notes.append(f"{num_aux} captured states: vLLM and SGLang build fc for exactly 3")
    if cfg.num_layers > 1:
        notes.append(
            "extra layers are written as midlayers.{i}: vLLM loads layers.{i}, SGLang and "
            "llama.cpp take single-layer drafts only"
        )
    if cfg.fc_bias:
        notes.append("`bias`: SGLang reads it as fc's bias, vLLM as an attention bias")
    if cfg.norm_before_fc or cfg.fc_norm:
        notes.append("input_norm / fc_norm tensors: llama.cpp's converter has no mapping for them")
    if cfg.norm_before_residual:
        notes.append("norm_before_residual: the SGLang llama_eagle3 versions read ignore it")
    if "lm_head" in shared:
        notes.append(
            "no lm_head (the target's): SGLang takes the target's only when "
            "draft_vocab_size is null"
        )
    return tuple(notes)


def add_export_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "export",
        help="rewrite an EAGLE-3 draft in the native LlamaForCausalLMEagle3 format",
        description="Loads DRAFT (native or speculators layout) against its target, checks it, "
        "and writes config.json + model.safetensors in the native layout to OUT (a new or "
        "empty folder).",
    )
    p.add_argument("draft", help="the draft checkpoint folder")
    p.add_argument("--target", required=True, help="registry name, GGUF file or HF folder")
    p.add_argument("--out", required=True, type=Path, help="output folder (new or empty)")
    p.add_argument("--dtype", choices=SAVE_DTYPES, default="bfloat16", help="of the weights")
    p.add_argument(
        "--capture",
        metavar="B1,B2,B3",
        help="override the target boundaries the head reads (written to config.json unless "
        "they are the default 2,N//2,N-3)",
    )


def cmd_export(args: argparse.Namespace) -> int:
    capture = int_list(args.capture, "--capture") if args.capture else None
    report = export_head(args.draft, args.target, args.out, dtype=args.dtype, capture=capture)
    print(report.line())
    for note in report.notes:
        print(f"eaglespec: note: {note}", file=sys.stderr)
    return 0
