"""Speculation methods by name: build the proposer the engine drives for `--method`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from eaglespec.config import TreeConfig
from eaglespec.draft.base import GraftingProposer, Proposer
from eaglespec.draft.config import default_capture
from eaglespec.draft.draft_model import DraftModelProposer
from eaglespec.draft.hybrid import HybridProposer
from eaglespec.draft.loader import load_eagle3, random_eagle3
from eaglespec.draft.lookup import PromptLookupProposer
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.errors import InvalidRequestError
from eaglespec.heads import packaged_head
from eaglespec.model.loader import LoadedModel, load_model
from eaglespec.model.quant import quantize_model
from eaglespec.policy import DraftPolicy, make_policy
from eaglespec.registry import resolve_model

METHODS = ("eagle3", "draft-model", "lookup", "none")
# Prompt-lookup tokens the commands graft into an EAGLE-3 head's rounds (docs/benchmark-history.md,
# "Prompt lookup inside EAGLE-3's rounds")
DEFAULT_LOOKUP_TOKENS = 4


def resolve_method(
    model: str, method: str | None, draft: str | None, lookup_tokens: int | None
) -> tuple[str, str | None, int]:
    """(method, draft, lookup tokens) from what the user gave; None is the default. With neither
    a method nor a draft: EAGLE-3 with the head shipped for the model (heads/) where one ships,
    else plain decoding. `method` "eagle3" without a draft takes the shipped head too; `draft`
    "none" means no draft. Lookup tokens default to DEFAULT_LOOKUP_TOKENS with eagle3, else 0."""
    if draft == "none":
        method, draft = method or "none", None
    elif draft is None and method in (None, "eagle3"):
        head = packaged_head(model)
        if head is not None:
            method, draft = "eagle3", str(head)
    method = method or ("eagle3" if draft else "none")
    if lookup_tokens is None:
        lookup_tokens = DEFAULT_LOOKUP_TOKENS if method == "eagle3" else 0
    return method, draft, lookup_tokens


# Draft tokens a chain may have at most (the adaptive policy's longest arm), --draft-tokens, and
# where the head stops a chain on its own doubt (--draft-min-prob: the product of its picks'
# probabilities; 0 drafts every chain to its length). Chains of 0-4 stopped at 0.3 measured 1.04-
# 1.07x the ungated 0-2 on Qwen2.5-Coder-1.5B in two runs and level on SmolLM2; ungated, chains
# of 3-4 rarely paid on 2 cores (benchmarks/policy_ab.py, BENCHMARKS.md).
DEFAULT_DRAFT_TOKENS = 4
DEFAULT_DRAFT_MIN_PROB = 0.3


def resolve_min_prob(method: str, min_prob: float | None) -> float:
    """What the user gave, else DEFAULT_DRAFT_MIN_PROB with eagle3 (0 for the other methods,
    which have no head to doubt its chains)."""
    if min_prob is not None:
        return min_prob
    return DEFAULT_DRAFT_MIN_PROB if method == "eagle3" else 0.0


@dataclass(frozen=True, slots=True)
class Speculation:
    proposer: Proposer | None  # None: plain decoding
    report: str  # one line on what drafts, for the CLI's load report ("" for plain decoding)


def make_proposer(
    method: str,
    draft: str | None,
    target: LoadedModel,
    *,
    capture: Sequence[int] | None = None,
    quant: str = "none",
    progress: bool = True,
    lookup_tokens: int = 0,
    min_prob: float = 0.0,
) -> Speculation:
    """`draft` is an EAGLE-3 folder (or "random") for eagle3, a model name or path for
    draft-model, unused for lookup. `quant` applies to the draft's own linear layers (an EAGLE-3
    head's shared embedding and lm_head are the target's, quantized with it). `lookup_tokens` > 0
    grafts that many prompt-lookup tokens into each eagle3 round's drafts (draft/hybrid.py).
    `min_prob` > 0 stops an eagle3 chain where the head's probability of it falls below
    (Eagle3Proposer)."""
    if method not in METHODS:
        raise InvalidRequestError(f"unknown method '{method}' (choose from {', '.join(METHODS)})")
    if lookup_tokens < 0 or (lookup_tokens and method != "eagle3"):
        raise InvalidRequestError(
            f"lookup tokens ({lookup_tokens}) are grafted into an EAGLE-3 head's drafts: they "
            "need method eagle3 and a count >= 0 (method lookup drafts by prompt lookup alone)"
        )
    if min_prob and method != "eagle3":
        raise InvalidRequestError(
            f"a draft min prob ({min_prob}) stops an EAGLE-3 head's chains: it needs method eagle3"
        )
    if method == "none":
        return Speculation(None, "")
    if method == "lookup":
        return Speculation(PromptLookupProposer(), "prompt lookup (n-grams of the context)")
    if not draft or draft == "none":
        raise InvalidRequestError(
            f"method '{method}' needs a draft: "
            + ("--draft PATH to an EAGLE-3 head" if method == "eagle3" else "--draft MODEL")
        )
    model = target.model
    if method == "draft-model":
        small = load_model(resolve_model(draft, progress=progress), dtype=model.dtype, quant=quant)
        proposer = DraftModelProposer(small.model, target_vocab_size=model.cfg.vocab_size)
        params = sum(p.numel() for p in small.model.parameters())
        return Speculation(proposer, f"draft model {small.path.name} ({params / 1e6:.0f}M params)")
    if draft == "random":
        layers = tuple(capture) if capture else default_capture(model.cfg.num_layers)
        head = quantize_model(random_eagle3(model, seed=0, capture=layers), quant)
        return with_lookup(
            Eagle3Proposer(head, layers, min_prob),
            f"random EAGLE-3 head (seed 0), capture {layers}{_gate_note(min_prob)}",
            lookup_tokens,
        )
    loaded = load_eagle3(draft, model, capture=capture)
    quantize_model(loaded.head, quant)
    r = loaded.report
    shared = f", shares {' and '.join(r.shared)} ({r.shared_bytes / 1e6:.1f} MB saved)"
    line = (
        f"EAGLE-3 head {r.folder.name} ({r.format}, {r.own_bytes / 1e6:.1f} MB own"
        f"{shared if r.shared else ''}), capture {r.capture} ({r.capture_origin})"
        f"{_gate_note(min_prob)}"
    )
    head = Eagle3Proposer(loaded.head, loaded.capture, min_prob)
    return with_lookup(head, line, lookup_tokens)


def _gate_note(min_prob: float) -> str:
    return f"; chains stop below path probability {min_prob}" if min_prob else ""


def speculation_policy(
    mode: str, num_draft: int, tree: TreeConfig | None, proposer: Proposer | None
) -> DraftPolicy:
    """The draft policy the commands run for `proposer` (None: plain decoding): make_policy
    told whether the proposer grafts candidates into every round."""
    return make_policy(
        mode,
        num_draft,
        tree,
        has_draft=proposer is not None,
        grafts=isinstance(proposer, GraftingProposer),
    )


def with_lookup(head: Eagle3Proposer, report: str, lookup_tokens: int) -> Speculation:
    """The head with `lookup_tokens` prompt-lookup tokens grafted in (itself for 0), and the
    report line saying so."""
    if lookup_tokens < 1:
        return Speculation(head, report)
    hybrid = HybridProposer(head, lookup_tokens)
    return Speculation(hybrid, f"{report}; + up to {lookup_tokens} prompt-lookup tokens a round")


def compile_proposer(proposer: Proposer | None, mode: str) -> None:
    """torch.compile what a proposer runs per draft step: a draft model's decode steps, or an
    EAGLE-3 head's steps (its layers in "block" mode, its whole step in "full"; "none" leaves
    both eager). Prompt lookup has nothing to compile."""
    if isinstance(proposer, DraftModelProposer):
        proposer.model.compile_steps(mode)
    elif isinstance(proposer, Eagle3Proposer):
        proposer.head.compile_steps(mode)
    elif isinstance(proposer, HybridProposer):
        proposer.head.head.compile_steps(mode)
