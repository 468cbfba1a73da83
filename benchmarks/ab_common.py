"""What the in-process A/B scripts (policy_ab.py, graft_ab.py) share: modules as a git revision
had them, imported beside today's, and the run of the methods interleaved question by question
over one target (bench/runner.py), so the machine's drift falls on every variant alike."""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Sequence
from pathlib import Path

from eaglespec.bench.aggregate import summarize
from eaglespec.bench.lineup import PLAIN, BenchMethod
from eaglespec.bench.memory import memory_meter
from eaglespec.bench.questions import read_all
from eaglespec.bench.report import ab_table, shape_table
from eaglespec.bench.runner import RunSettings, run_benchmark
from eaglespec.model.loader import LoadedModel


def module_at(rev: str, path: str) -> types.ModuleType:
    """`path` (relative to the repository) at git revision `rev`, executed as a module of its
    own (named after the path and revision), against today's other modules."""
    text = subprocess.run(
        ["git", "show", f"{rev}:{path}"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parent,
    ).stdout  # fmt: skip
    name = f"{Path(path).stem}_at_{rev}".replace("~", "_").replace("^", "_").replace(".", "_")
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses resolve annotations through it
    exec(compile(text, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def run_ab(
    target: LoadedModel, methods: Sequence[BenchMethod], files: Sequence[str], limit: int,
    max_tokens: int,
) -> None:  # fmt: skip
    """Greedy answers to the first `limit` questions of each file by every method, interleaved
    per question; prints plain decoding's speed and the A/B table (tokens a round, speed over
    plain decoding, whether every output equals plain greedy decoding's), then each method's
    rounds by draft shape (the adaptive policies' picks)."""
    questions = read_all(files, limit)
    settings = RunSettings(max_tokens=max_tokens, temperature=0.0, seed=0)
    gens = run_benchmark(target, methods, questions, settings, memory_meter(target.model.device))
    stats = summarize(gens, questions, [m.name for m in methods], group_by="file", greedy=True)
    plain = stats.overall[PLAIN]
    print(f"{plain.generations} turns, plain {plain.tokens_per_second:.1f} tokens/s")
    print(ab_table(stats.overall))
    print()
    print(shape_table(stats.overall))
