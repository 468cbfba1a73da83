"""The draft shape that pays on this machine, measured once and stored per model, draft and
machine, so `eaglespec generate` starts from it instead of guessing.

`calibrate` decodes a few prompts once per arm of the adaptive policy (policy.py): plain steps
(k = 0), chains of 1 .. k drafts and the configured EAGLE-2 tree, at batch 1. From those rounds it
records what the policy's cost model needs, measured here, not assumed:

    seconds(k)           mean wall time of a round drafting k tokens (draft steps + one verify
                         forward of k + 1 tokens + bookkeeping) on this hardware
    P(accept >= j)       per draft position, from the chain rounds; the tree's mean tokens/round

and the policy's best arm is the one with the highest tokens(k) / seconds(k). The learned state is
written as JSON under the cache directory, keyed by everything that changes a round's cost or its
acceptance: the model file, the draft (its path and its content: a head retrained into the same
folder accepts differently), device, dtype, quantization, compile mode, threads, the torch
version and eaglespec's own code (a digest of its Python and C++ sources: a new kernel changes
what a round costs, as the eager-step kernels of 2026-11-25 made a plain step 1.6x faster).
`generate` loads it as the adaptive policy's starting point (all arms measured, so it skips
exploring), keeps adapting to the prompt at hand, and stores the updated state after the
run: a first run without calibration explores online and leaves a calibration behind.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eaglespec.config import SamplingParams
from eaglespec.methods import speculation_policy
from eaglespec.paths import cache_dir
from eaglespec.policy import AdaptiveDraft, DraftChoice, FixedDraft
from eaglespec.registry import sha256_file
from eaglespec.requests import collect_outputs

if TYPE_CHECKING:
    from eaglespec.llm import LLM


@dataclass(frozen=True, slots=True)
class CalibrationKey:
    model: str  # resolved model path
    model_bytes: int
    method: str
    draft: str | None  # draft name, or a draft path's last component (its content is keyed)
    draft_content: str | None  # draft_fingerprint(draft): None for names and "random"
    num_draft: int
    tree: str | None
    lookup_tokens: int  # prompt-lookup tokens grafted into each round (0: none)
    draft_min_prob: float  # where chains stop on the head's doubt (0: fixed length)
    device: str
    dtype: str
    quant: str
    compile: str
    threads: int
    torch: str
    engine: str  # engine_fingerprint(): eaglespec's version and a digest of its code

    def file(self) -> Path:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        return cache_dir() / "calibration" / f"{digest[:20]}.json"


DRAFT_SUFFIXES = (".safetensors", ".json", ".bin", ".pt", ".gguf")
HASH_LIMIT = 64 << 20  # bytes: larger files are keyed by size and modification time


def draft_fingerprint(draft: str | None) -> str | None:
    """A digest of what a draft path holds, so a head retrained or replaced at the same path is
    another calibration: the content of each weight and config file (the files of the folder
    itself, not of subfolders, where a training run keeps gigabytes of features), or for a file
    over HASH_LIMIT its size and modification time. None when `draft` is not a path (a
    registry name, whose file the registry pins by hash, or "random", which is seeded)."""
    path = Path(draft) if draft else None
    if path is None or not path.exists():
        return None
    files = [path] if path.is_file() else sorted(path.iterdir())
    h = hashlib.sha256()
    for f in files:
        if not f.is_file() or f.suffix not in DRAFT_SUFFIXES:
            continue
        st = f.stat()
        content = sha256_file(f) if st.st_size <= HASH_LIMIT else str(st.st_mtime_ns)
        h.update(f"{f.name}\0{st.st_size}\0{content}\0".encode())
    return h.hexdigest()[:20]


@functools.cache
def engine_fingerprint() -> str:
    """eaglespec's version and a digest of its Python and C++ sources (not the shipped heads,
    which the draft fingerprint covers): another build of the engine is another calibration."""
    import eaglespec

    root = Path(eaglespec.__file__).parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.suffix in (".py", ".cpp", ".h") and f.is_file():
            h.update(f"{f.relative_to(root)}\0".encode() + f.read_bytes())
    return f"{eaglespec.__version__}+{h.hexdigest()[:12]}"


def calibration_key(llm: LLM) -> CalibrationKey:
    path = Path(llm.loaded.path)
    size = (
        sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        if path.is_dir()
        else (path.stat().st_size if path.exists() else 0)
    )
    tree = llm.tree
    content = draft_fingerprint(llm.draft)
    # A draft path is keyed by its content and folder name, not where it lies: the head shipped
    # in one clone of the package is the same head in another.
    draft = llm.draft if content is None or llm.draft is None else Path(llm.draft).name
    return CalibrationKey(
        model=str(path.resolve()) if path.exists() else str(path),
        model_bytes=size,
        method=llm.method,
        draft=draft,
        draft_content=content,
        num_draft=llm.num_draft,
        tree=None if tree is None else f"{tree.depth},{tree.top_k},{tree.num_nodes}",
        lookup_tokens=llm.lookup_tokens,
        draft_min_prob=llm.draft_min_prob,
        device=str(llm.model.device),
        dtype=str(llm.model.dtype).removeprefix("torch."),
        quant=llm.quant,
        compile=llm.compile,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        engine=engine_fingerprint(),
    )


def load_calibration(key: CalibrationKey, policy: AdaptiveDraft) -> dict[str, Any] | None:
    """Seed `policy` with the stored state for `key`; returns the stored record, or None when
    there is none (or it cannot be read: a calibration is never worth an error)."""
    try:
        record: dict[str, Any] = json.loads(key.file().read_text())
        policy.load_state(record["policy"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record


def save_calibration(key: CalibrationKey, policy: AdaptiveDraft, source: str) -> Path:
    """Store `policy`'s state for `key` (atomically: a reader never sees half a file)."""
    path = key.file()
    path.parent.mkdir(parents=True, exist_ok=True)
    best = policy.best(1)
    record = {
        "key": asdict(key),
        "source": source,  # "calibrate" or "generate"
        "saved": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "best": None if best is None else arm_name(best, policy),
        "policy": policy.state(),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    return path


class CalibrationStore:
    """An LLM's adaptive policy tied to its stored calibration: `open` seeds the policy (and
    says so), `save` writes what the run taught it. Inert for any other policy."""

    def __init__(self, key: CalibrationKey | None, policy: AdaptiveDraft | None) -> None:
        self.key, self.policy = key, policy

    @classmethod
    def open(cls, llm: LLM, say: Callable[[str], None]) -> CalibrationStore:
        policy = llm.policy
        if llm.proposer is None or not isinstance(policy, AdaptiveDraft):
            return cls(None, None)
        key = calibration_key(llm)
        record = load_calibration(key, policy)
        if record is None:
            say(
                "[adaptive speculation: no calibration stored for this model and machine yet; "
                "measuring each draft length during this run (`eaglespec bench --calibrate` "
                "measures them properly)]"
            )
        else:
            say(
                f"[adaptive speculation: calibration of {record['saved']} "
                f"({record['source']}), best at batch 1: {record['best']}]"
            )
        return cls(key, policy)

    def save(self) -> None:
        if self.key is not None and self.policy is not None:
            # A read-only cache costs the next run its head start, nothing else.
            with contextlib.suppress(OSError):
                save_calibration(self.key, self.policy, "generate")


@dataclass(frozen=True, slots=True)
class ArmResult:
    choice: str  # "plain", "lookup", "chain<k>" or "tree<depth>,<top-k>,<nodes>"
    rounds: int
    seconds_per_round: float
    tokens_per_round: float  # bonus included
    tokens_per_second: float  # tokens_per_round / seconds_per_round


def calibrate(
    llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: int
) -> tuple[AdaptiveDraft, list[ArmResult]]:
    """Decode `prompts` (greedy, batch 1, one warm-up first) once per arm; returns the policy
    holding the measurements and one row per arm."""
    assert llm.proposer is not None, "calibration needs a draft"
    # The policy the commands run for this draft (make_policy decides its arms and settings)
    policy = speculation_policy("adaptive", llm.num_draft, llm.tree, llm.proposer)
    assert isinstance(policy, AdaptiveDraft)
    params = SamplingParams(max_tokens=max_tokens)
    rows = []
    collect_outputs(llm.stream([prompts[0]], SamplingParams(max_tokens=8)))  # warm-up
    for choice in policy.choices:
        seconds: list[float] = []
        tokens: list[int] = []
        forced = _Recorder(choice, policy, seconds, tokens)
        for ids in prompts:
            llm.generate([ids], params, policy=forced)
        mean = sum(seconds) / len(seconds)
        per_round = sum(tokens) / len(tokens)
        policy.record(choice, 1, mean, per_round)
        rows.append(
            ArmResult(arm_name(choice, policy), len(seconds), mean, per_round, per_round / mean)
        )
    return policy, rows


class _Recorder(FixedDraft):
    """Every round drafts `choice`; the rounds feed `into` (acceptance) and the lists."""

    def __init__(
        self, choice: DraftChoice, into: AdaptiveDraft, seconds: list[float], tokens: list[int]
    ) -> None:
        super().__init__(choice)
        self.into, self.seconds, self.tokens = into, seconds, tokens

    def observe(
        self, batch: int, choice: DraftChoice, seconds: float, accepted: Sequence[int]
    ) -> None:
        self.into.observe(batch, choice, seconds, accepted)
        self.seconds.append(seconds)
        self.tokens.extend(1 + a for a in accepted)


def arm_name(choice: DraftChoice, policy: AdaptiveDraft) -> str:
    """The arm as reports name it: "plain" for plain steps, "lookup" for a grafting proposer's
    candidates alone (its zero-draft arm), else the policy's name."""
    if choice == policy.plain:
        return "plain"
    return "lookup" if choice == policy.zero else choice.name
