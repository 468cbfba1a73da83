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
from typing import Any

import torch
from ab_common import module_at, run_ab

from eaglespec.bench.lineup import PLAIN, BenchMethod, shipped_head
from eaglespec.draft.hybrid import HybridProposer


def hybrid_at(rev: str) -> Any:
    """HybridProposer as git revision `rev` had it."""
    return module_at(rev, "src/eaglespec/draft/hybrid.py").HybridProposer


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
    run_ab(target, methods, args.questions, args.limit, args.max_tokens)


if __name__ == "__main__":
    main()
