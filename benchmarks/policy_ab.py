"""Adaptive speculation's settings A/B in one process: the fixed chain of one with prompt lookup
against adaptive policies of given longest chains and margins, methods interleaved per question
over the same target, head and questions (bench/runner.py).

    python benchmarks/policy_ab.py --questions ../shared/data/eval/*.jsonl \\
        [--model smollm2-135m] [--arms 2:0 4:0:0.3] [--lookup-tokens 4] [--limit 4] \\
        [--max-tokens 128] [--threads 2] [--policy-rev REV]

An arm MAX:MARGIN is AdaptiveDraft(MAX, measure_tokens=True, margin=MARGIN); MAX:MARGIN:P is
the same over a head whose chains stop where their path probability falls below P
(--draft-min-prob P; 0: never), and MAX:MARGIN:P:S the same with its moving averages' weight of
a new round S (`smoothing`, 0.05 by default). An arm FIXED:K:P is a fixed chain of K with
lookup, gated at P (0: never). The commands run 4:0:0.3 (since session 40; 2:0 before, 4:0.05 before
session 34). An arm written REV:MAX:MARGIN[:P] runs the AdaptiveDraft of git revision
--policy-rev instead of today's (src/eaglespec/policy.py as it was there), so a change to the
policy is measured against the policy before it, over the same rounds' machine. Per method:
tokens a round, speed over plain decoding (new tokens over prefill + decode seconds, summed) and
whether every output equals plain greedy decoding's (bench/aggregate.py's definitions). The
model (a registry name with a shipped head: SmolLM2 by default) and its shipped head at the
default precision (bf16 w4a8).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from ab_common import module_at, run_ab

from eaglespec.bench.lineup import PLAIN, BenchMethod, shipped_head
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.methods import with_lookup
from eaglespec.policy import AdaptiveDraft


def policy_at(rev: str) -> Any:
    """AdaptiveDraft as git revision `rev` had it."""
    return module_at(rev, "src/eaglespec/policy.py").AdaptiveDraft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", nargs="+", required=True)
    ap.add_argument("--model", default="smollm2-135m", help="a registry name with a shipped head")
    ap.add_argument(
        "--arms", nargs="+", default=["2:0", "4:0:0.3"], help="MAX:MARGIN[:MIN_PROB[:SMOOTHING]]"
    )
    ap.add_argument("--lookup-tokens", type=int, default=4)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--policy-rev", default=None, help="git revision of REV:... arms' policy")
    args = ap.parse_args()
    if args.policy_rev is None and any(a.startswith("REV:") for a in args.arms):
        ap.error("arms written REV:... need --policy-rev")
    torch.set_num_threads(args.threads)
    target, base = shipped_head(args.model)
    fixed = with_lookup(base, "", args.lookup_tokens).proposer
    methods = [
        BenchMethod(PLAIN, None, 0, None, "plain decoding"),
        BenchMethod("chain of 1 + lookup", fixed, 1, None, "fixed"),
    ]
    then_type = None if args.policy_rev is None else policy_at(args.policy_rev)
    for arm in args.arms:
        if arm.startswith("FIXED:"):  # a fixed chain of K with lookup, gated at P
            k, gate = arm.split(":")[1:]
            gated = Eagle3Proposer(base.head, base.capture, float(gate))
            proposer = with_lookup(gated, "", args.lookup_tokens).proposer
            methods.append(BenchMethod(arm, proposer, int(k), None, arm))
            continue
        then = arm.startswith("REV:")
        longest, margin, *gate = arm.removeprefix("REV:").split(":")
        proposer = fixed
        if gate and float(gate[0]):  # the same head, gated
            gated = Eagle3Proposer(base.head, base.capture, float(gate[0]))
            proposer = with_lookup(gated, "", args.lookup_tokens).proposer
        policy_type = then_type if then else AdaptiveDraft
        smoothing = {"smoothing": float(gate[1])} if len(gate) > 1 else {}
        policy = policy_type(int(longest), measure_tokens=True, margin=float(margin), **smoothing)
        name = f"adaptive {arm.replace('REV', args.policy_rev or '')}"
        methods.append(BenchMethod(name, proposer, int(longest), None, name, policy))
    run_ab(target, methods, args.questions, args.limit, args.max_tokens)


if __name__ == "__main__":
    main()
