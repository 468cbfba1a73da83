"""Speculation methods by name: build the proposer the engine drives for `--method`."""

from __future__ import annotations

from collections.abc import Sequence

from eaglespec.draft.base import Proposer
from eaglespec.draft.config import default_capture
from eaglespec.draft.draft_model import DraftModelProposer
from eaglespec.draft.loader import load_eagle3, random_eagle3
from eaglespec.draft.lookup import PromptLookupProposer
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.errors import InvalidRequestError
from eaglespec.model.loader import LoadedModel, load_model
from eaglespec.registry import resolve_model

METHODS = ("eagle3", "draft-model", "lookup", "none")


def make_proposer(
    method: str,
    draft: str | None,
    target: LoadedModel,
    *,
    capture: Sequence[int] | None = None,
    progress: bool = True,
) -> Proposer | None:
    """None for plain decoding. `draft` is an EAGLE-3 folder (or "random") for eagle3, a model
    name or path for draft-model, unused for lookup."""
    if method not in METHODS:
        raise InvalidRequestError(f"unknown method '{method}' (choose from {', '.join(METHODS)})")
    if method == "none":
        return None
    if method == "lookup":
        return PromptLookupProposer()
    if not draft or draft == "none":
        raise InvalidRequestError(
            f"method '{method}' needs a draft: "
            + ("--draft PATH to an EAGLE-3 head" if method == "eagle3" else "--draft MODEL")
        )
    model = target.model
    if method == "draft-model":
        small = load_model(resolve_model(draft, progress=progress), dtype=model.dtype)
        return DraftModelProposer(small.model, target_vocab_size=model.cfg.vocab_size)
    if draft == "random":
        layers = tuple(capture) if capture else default_capture(model.cfg.num_layers)
        return Eagle3Proposer(random_eagle3(model, seed=0, capture=layers), layers)
    loaded = load_eagle3(draft, model, capture=capture)
    return Eagle3Proposer(loaded.head, loaded.capture)
