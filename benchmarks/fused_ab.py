"""Whole generations with the fused layer's kernels called directly in one team of threads a
forward (csrc/layer.cpp's native_layer, csrc/team.h: the default) against the kernels through the
ops, each in a parallel region of its own (the fused layer before session 57), interleaved
question by question in one process: plain greedy decoding and the commands' default speculation,
tokens per second of each and the speculation's speedup under each setting.

    python benchmarks/fused_ab.py [--model smollm2-135m] [--limit 2] [--max-tokens 128]
                                  [--passes 2] [--questions ../shared/data/eval/*.jsonl]

The two settings give the same tokens (checked: a generation that differs is an error). Each
question's first turn, chat-templated; medians of the per-question ratios and the pooled tokens
per second (total tokens over total seconds) of each method and setting.
"""

from __future__ import annotations

import argparse
import glob
import statistics
import time

import torch

from eaglespec import LLM
from eaglespec.bench.questions import read_all
from eaglespec.config import SamplingParams

SETTINGS = {"direct, one team": (True, True), "ops, a region each": (False, False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument(
        "--questions", nargs="+", default=sorted(glob.glob("../shared/data/eval/*.jsonl"))
    )
    args = ap.parse_args()
    questions = read_all(args.questions, args.limit)
    if not questions:
        raise SystemExit("no questions: pass --questions FILE.jsonl ...")
    llms = {"plain": LLM(args.model, draft="none", progress=False), "speculative": LLM(args.model)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    ops = torch.ops.eaglespec_layer
    tokens: dict[tuple[str, str], int] = {}
    seconds: dict[tuple[str, str], float] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    for llm in llms.values():  # first calls (kernel builds, calibration) out of the timing
        llm.generate([questions[0].turns[0]], params)
    for _ in range(args.passes):
        for q in questions:
            prompt = q.turns[0]
            times: dict[tuple[str, str], float] = {}
            outs: dict[str, list[int]] = {}
            for setting, (team, native) in SETTINGS.items():
                ops.use_team(team)
                ops.use_native(native)
                for name, llm in llms.items():
                    start = time.perf_counter()
                    out = llm.generate([prompt], params)[0]
                    key = (name, setting)
                    times[key] = time.perf_counter() - start
                    ids = list(out.token_ids)
                    if outs.setdefault(name, ids) != ids:
                        raise SystemExit(f"{name}: the settings generated different tokens")
                    tokens[name, setting] = tokens.get((name, setting), 0) + len(ids)
                    seconds[name, setting] = (
                        seconds.get((name, setting), 0.0) + times[name, setting]
                    )
            old, new = list(SETTINGS)[1], list(SETTINGS)[0]
            for name in llms:
                ratios.setdefault((name, "new over old time"), []).append(
                    times[name, new] / times[name, old]
                )
            for setting in SETTINGS:
                ratios.setdefault(("speedup", setting), []).append(
                    times["plain", setting] / times["speculative", setting]
                )
    ops.use_team(True)
    ops.use_native(True)
    print(
        f"{args.model}, {len(questions)} questions x {args.passes} passes, {args.max_tokens} tokens"
    )
    print("| method | setting | tok/s (pooled) |")
    print("|---|---|---|")
    for name in llms:
        for setting in SETTINGS:
            key = (name, setting)
            print(f"| {name} | {setting} | {tokens[key] / seconds[key]:.1f} |")
    print()
    print("| per question (median) | value |")
    print("|---|---|")
    for (what, which), values in ratios.items():
        print(f"| {what}: {which} | {statistics.median(values):.3f} |")


if __name__ == "__main__":
    main()
