"""Prompt lookup's graft at another revision against today's, in one process: draft/hybrid.py
taken from `--rev` (git show) and run beside today's around the same shipped head, the fixed
chain of one with lookup (what `eaglespec bench`'s eagle3-chain+lookup runs), over the same
questions, methods interleaved per question and repeated (bench/runner.py), so the machine's
drift falls on both alike.

    python benchmarks/graft_ab.py --questions ../shared/data/eval/*.jsonl --rev REV \\
        [--model smollm2-135m] [--lookup-tokens 4] [--num-draft 1] [--limit 4] \\
        [--max-tokens 128] [--repeats 2] [--threads 2]

Per method: tokens a round, speed over plain decoding (new tokens over prefill + decode seconds)
and whether every output equals plain greedy decoding's. The old module runs against today's
other modules (tree.py included), so this measures changes confined to the graft's own code.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import torch

from eaglespec.bench.aggregate import summarize
from eaglespec.bench.lineup import PLAIN, BenchMethod, shipped_head
from eaglespec.bench.memory import memory_meter
from eaglespec.bench.questions import read_all
from eaglespec.bench.report import ab_table
from eaglespec.bench.runner import RunSettings, run_benchmark
from eaglespec.draft.hybrid import HybridProposer


def hybrid_at(rev: str) -> Any:
    """HybridProposer as git revision `rev` had it."""
    text = subprocess.run(
        ["git", "show", f"{rev}:src/eaglespec/draft/hybrid.py"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parent,
    ).stdout  # fmt: skip
    module = types.ModuleType("hybrid_at_rev")
    sys.modules[module.__name__] = module  # dataclasses resolve annotations through it
    exec(compile(text, f"{rev}:src/eaglespec/draft/hybrid.py", "exec"), module.__dict__)
    return module.HybridProposer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", nargs="+", required=True)
    ap.add_argument("--rev", required=True, help="git revision of the old draft/hybrid.py")
    ap.add_argument("--model", default="smollm2-135m", help="a registry name with a shipped head")
    ap.add_argument("--lookup-tokens", type=int, default=4)
    ap.add_argument("--num-draft", type=int, default=1)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="each variant this many times")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, head = shipped_head(args.model)
    old_type = hybrid_at(args.rev)
    methods = [BenchMethod(PLAIN, None, 0, None, "plain decoding")]
    for r in range(args.repeats):
        for name, kind in ((f"{args.rev} {r + 1}", old_type), (f"today {r + 1}", HybridProposer)):
            proposer = kind(head, args.lookup_tokens)
            methods.append(BenchMethod(name, proposer, args.num_draft, None, name))
    questions = read_all(args.questions, args.limit)
    settings = RunSettings(max_tokens=args.max_tokens, temperature=0.0, seed=0)
    gens = run_benchmark(target, methods, questions, settings, memory_meter(target.model.device))
    stats = summarize(gens, questions, [m.name for m in methods], group_by="file", greedy=True)
    plain = stats.overall[PLAIN]
    print(f"{plain.generations} turns, plain {plain.tokens_per_second:.1f} tokens/s")
    print(ab_table(stats.overall))


if __name__ == "__main__":
    main()
