"""EAGLE-3 draft head: configuration, module, checkpoint loading."""

from eaglespec.draft.config import (
    DraftConfig,
    capture_origin,
    default_capture,
    resolve_capture_layers,
)
from eaglespec.draft.eagle3 import DraftOutput, Eagle3Head
from eaglespec.draft.loader import (
    DraftLoadReport,
    LoadedDraft,
    load_eagle3,
    random_eagle3,
    save_eagle3,
)

__all__ = [
    "DraftConfig",
    "DraftLoadReport",
    "DraftOutput",
    "Eagle3Head",
    "LoadedDraft",
    "capture_origin",
    "default_capture",
    "load_eagle3",
    "random_eagle3",
    "resolve_capture_layers",
    "save_eagle3",
]
