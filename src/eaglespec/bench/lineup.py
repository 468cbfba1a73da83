"""The methods a benchmark compares, all on one loaded target.

  plain         plain decoding: the baseline every speedup is measured against
  eagle3-chain  an EAGLE-3 head drafting a greedy chain of `num_draft` tokens per round
  eagle3-tree   the same head drafting an EAGLE-2 dynamic tree (`tree`: depth, top-k, nodes)
  eagle3-chain+lookup, eagle3-tree+lookup
                the same, with up to `lookup_tokens` prompt-lookup tokens grafted into each
                round's drafts where the context matches (draft/hybrid.py)
  eagle3-adaptive
                what `eaglespec generate` runs: the head with lookup grafted in, under adaptive
                speculation over chains of 0 .. DEFAULT_DRAFT_TOKENS (policy.py), one policy
                learning across the whole run (from no calibration)
  draft-model   a smaller model with the target's vocabulary drafting chains
  lookup        prompt lookup: n-grams of the context, no model
  llama.cpp     llama.cpp's plain decoding of the same GGUF file: a reference engine, opt-in
                (needs llama-cpp-python; llamacpp.py)

The chain and the tree share one head; a proposer keeps no state between generations (each
generation's state comes from `start`), so one object serves every question.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from eaglespec.bench.llamacpp import LLAMA_CPP, LlamaCppMethod, check_llama_cpp
from eaglespec.config import SamplingParams, TreeConfig
from eaglespec.draft.base import Proposer
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.engine import generate_speculative
from eaglespec.errors import InvalidRequestError
from eaglespec.generate import generate_stream
from eaglespec.heads import packaged_head
from eaglespec.methods import (
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_LOOKUP_TOKENS,
    Speculation,
    compile_proposer,
    make_proposer,
    resolve_min_prob,
    speculation_policy,
    with_lookup,
)
from eaglespec.model.loader import LoadedModel, load_model
from eaglespec.policy import DraftPolicy
from eaglespec.registry import resolve_model
from eaglespec.requests import RequestOutput, collect_outputs

PLAIN = "plain"
METHOD_NAMES = (
    PLAIN,
    "eagle3-chain",
    "eagle3-tree",
    "eagle3-chain+lookup",
    "eagle3-tree+lookup",
    "eagle3-adaptive",
    "draft-model",
    "lookup",
    LLAMA_CPP,
)
# Other engines: compared with plain decoding for speed, but not held to eaglespec's losslessness.
REFERENCE_ENGINES = frozenset({LLAMA_CPP})


@dataclass(frozen=True, slots=True)
class DraftSources:
    """What the drafting methods draft with; None where nothing was given or ships."""

    eagle3: str | None  # an EAGLE-3 head folder, or "random" (seeded random head)
    draft_model: str | None  # a registry name or path of a smaller model


class Method(Protocol):
    """What the runner needs of a method: BenchMethod (eaglespec) or LlamaCppMethod."""

    @property
    def name(self) -> str: ...  # one of METHOD_NAMES

    @property
    def description(self) -> str: ...  # one line for the report

    def generate(
        self, target: LoadedModel, prompt: Sequence[int], params: SamplingParams
    ) -> RequestOutput: ...


@dataclass(frozen=True, slots=True)
class BenchMethod:
    name: str  # one of METHOD_NAMES
    proposer: Proposer | None  # None: plain decoding
    num_draft: int  # draft tokens per round of a chain (unused by plain and the tree)
    tree: TreeConfig | None  # EAGLE-2 tree shape, or None for chains
    description: str  # one line: what drafts, and how much
    policy: DraftPolicy | None = None  # picks each round's shape (adaptive); None: the fixed one

    def generate(
        self, target: LoadedModel, prompt: Sequence[int], params: SamplingParams
    ) -> RequestOutput:
        """One request at batch 1, run to the end."""
        if self.proposer is None:
            events = generate_stream(target.model, target.tokenizer, [prompt], [params])
        else:
            events = generate_speculative(
                target.model,
                self.proposer,
                target.tokenizer,
                [prompt],
                [params],
                num_draft=self.num_draft,
                tree=self.tree,
                policy=self.policy,
            )
        return collect_outputs(events)[0]


def default_methods(drafts: DraftSources) -> list[str]:
    """Every method that can run with what was given: the EAGLE-3 methods when a head is known,
    draft-model when a draft model was named; plain and lookup always. Never llama.cpp: another
    engine, and an optional package, runs only when asked for."""
    names = [PLAIN]
    if drafts.eagle3:  # the head alone, then as the commands run it (prompt lookup grafted in)
        names += ["eagle3-chain", "eagle3-tree", "eagle3-chain+lookup", "eagle3-tree+lookup"]
        names.append("eagle3-adaptive")
    if drafts.draft_model:
        names.append("draft-model")
    return [*names, "lookup"]


def check_methods(
    names: Sequence[str], drafts: DraftSources, *, temperature: float = 0.0, device: str = "cpu"
) -> list[str]:
    """`names` in order without repeats, plain first (the baseline always runs); an unknown name
    or a method without its draft (llama.cpp: its package, greedy decoding, its device) is an
    error, raised before anything loads."""
    out = [PLAIN]
    for name in names:
        if name not in METHOD_NAMES:
            raise InvalidRequestError(
                f"unknown benchmark method '{name}' (choose from {', '.join(METHOD_NAMES)})"
            )
        if name.startswith("eagle3") and not drafts.eagle3:
            raise InvalidRequestError(
                f"method '{name}' needs an EAGLE-3 head: none ships for this model, so pass "
                "--draft PATH (or --draft random)"
            )
        if name == "draft-model" and not drafts.draft_model:
            raise InvalidRequestError("method 'draft-model' needs --draft-model MODEL")
        if name == LLAMA_CPP:
            check_llama_cpp(temperature, device)
        if name not in out:
            out.append(name)
    return out


def shipped_head(model: str) -> tuple[LoadedModel, Eagle3Proposer]:
    """A registry model at the commands' CPU precision (bf16 w4a8) and the EAGLE-3 head shipped
    for it, alone (no lookup, no gate): what the benchmarks/ A/B scripts build their methods on."""
    target = load_model(resolve_model(model), dtype=torch.bfloat16, quant="w4a8")
    head = packaged_head(model)
    if head is None:
        raise InvalidRequestError(f"no EAGLE-3 head ships for {model}")
    proposer = make_proposer("eagle3", str(head), target, quant="w4a8", progress=False).proposer
    assert isinstance(proposer, Eagle3Proposer)
    return target, proposer


def build_methods(
    names: Sequence[str],
    target: LoadedModel,
    drafts: DraftSources,
    *,
    num_draft: int,
    tree: TreeConfig,
    quant: str,
    compile: str,
    progress: bool,
    lookup_tokens: int = DEFAULT_LOOKUP_TOKENS,
    min_prob: float | None = None,
) -> list[Method]:
    """Load each draft once (the EAGLE-3 head serves chain, tree and adaptive). `quant` applies
    to the drafts as to the target; `compile` to a draft model's steps and an EAGLE-3 head's
    layers (the caller compiles the target's). `min_prob` stops the head's chains where it
    doubts them (Eagle3Proposer; trees are not gated): None leaves the eagle3-chain methods
    fixed chains and gives eagle3-adaptive the commands' default. llama.cpp loads its own copy
    of the target's file on its first generation."""
    specs: dict[str, Speculation] = {}

    def speculation(method: str, draft: str | None) -> Speculation:
        if method not in specs:
            gate = (min_prob or 0.0) if method == "eagle3" else 0.0
            specs[method] = make_proposer(
                method, draft, target, quant=quant, progress=progress, min_prob=gate
            )
            compile_proposer(specs[method].proposer, compile)
        return specs[method]

    def hybrid() -> Speculation:
        """The EAGLE-3 head's proposer (loaded once) with prompt lookup grafted in."""
        if "eagle3+lookup" not in specs:
            head = speculation("eagle3", drafts.eagle3)
            assert isinstance(head.proposer, Eagle3Proposer)
            specs["eagle3+lookup"] = with_lookup(head.proposer, head.report, lookup_tokens)
        return specs["eagle3+lookup"]

    out: list[Method] = []
    for name in names:
        if name == LLAMA_CPP:
            out.append(LlamaCppMethod(target.path, target.model.device))
            continue
        if name == PLAIN:
            out.append(BenchMethod(name, None, 0, None, "plain decoding (baseline)"))
            continue
        if name in ("eagle3-tree", "eagle3-tree+lookup"):
            spec = hybrid() if name.endswith("+lookup") else speculation("eagle3", drafts.eagle3)
            shape = f"tree depth {tree.depth}, top-k {tree.top_k}, {tree.num_nodes} nodes"
            out.append(BenchMethod(name, spec.proposer, num_draft, tree, f"{spec.report}; {shape}"))
            continue
        if name == "eagle3-adaptive":  # what the commands run: its own gate over the same head
            head = speculation("eagle3", drafts.eagle3)
            assert isinstance(head.proposer, Eagle3Proposer)
            gate = resolve_min_prob("eagle3", min_prob)
            gated = Eagle3Proposer(head.proposer.head, head.proposer.capture, gate)
            spec = with_lookup(gated, head.report, lookup_tokens)
            k = DEFAULT_DRAFT_TOKENS
            policy = speculation_policy("adaptive", k, None, spec.proposer)
            # (a --draft-min-prob given is in the head's report already)
            stop = f", stopped below path probability {gate}" if gate and min_prob is None else ""
            line = f"{spec.report}; adaptive speculation over chains of 0 .. {k}{stop}"
            out.append(BenchMethod(name, spec.proposer, k, None, line, policy))
            continue
        if name == "eagle3-chain":
            spec = speculation("eagle3", drafts.eagle3)
        elif name == "eagle3-chain+lookup":
            spec = hybrid()
        elif name == "draft-model":
            spec = speculation("draft-model", drafts.draft_model)
        else:
            spec = speculation("lookup", None)
        chain = f"{spec.report}; chain of {num_draft}"
        out.append(BenchMethod(name, spec.proposer, num_draft, None, chain))
    return out
