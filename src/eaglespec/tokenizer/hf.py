"""Reading a Hugging Face tokenizer folder: its JSON files, special-token texts, EOS ids and
chat template (as transformers reads them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eaglespec.errors import ModelLoadError


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else chat_template.json, else tokenizer_config's (a string or a list
    of named templates, of which "default" is used)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = read_json(folder / "chat_template.json").get("chat_template")
    template = template or config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None
