"""EAGLE-3 heads that ship with the package, one folder per registry model they were trained for
(native `LlamaForCausalLMEagle3` format, with a model card README.md). `eaglespec generate
--method eagle3` without `--draft` drafts with the head of its target.
"""

from __future__ import annotations

from pathlib import Path

from eaglespec.registry import MODELS

_ROOT = Path(__file__).parent


def packaged_head(model: str) -> Path | None:
    """The shipped head for `model` (a registry name, or the path of a registry model's file as
    `resolve_model` returns it), or None when none ships."""
    name = model
    if name not in MODELS:
        by_file = {m.filename: n for n, m in MODELS.items()}
        name = by_file.get(Path(model).name, "")
    folder = _ROOT / name
    return folder if name and (folder / "model.safetensors").is_file() else None
