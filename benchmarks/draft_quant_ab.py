"""The EAGLE-3 head's own precision, A/B in one process: its lm_head at 8 bits (what `--quant
w4a8` gives a head today) against 4 bits (`w4a8-all`), chain and tree, on the same target,
questions and turns, methods interleaved per question (bench/runner.py).

    python benchmarks/draft_quant_ab.py --questions ../shared/data/eval/*.jsonl \\
        [--draft src/eaglespec/heads/smollm2-135m] [--modes w4a8 w4a8-all] [--limit 4]
        [--max-tokens 128] [--num-draft 2] [--tree 4,4,16] [--threads 2]

Per mode and shape (bench/aggregate.py's definitions): tokens a round, decode tokens/s and its
ratio to plain decoding's, draft milliseconds per round, and whether every output equals plain
greedy decoding's. The target
runs in bf16 at `--target-quant` (w4a8: SmolLM2's default precision).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from eaglespec.bench.aggregate import summarize
from eaglespec.bench.lineup import PLAIN, BenchMethod
from eaglespec.bench.memory import memory_meter
from eaglespec.bench.questions import read_all
from eaglespec.bench.runner import RunSettings, run_benchmark
from eaglespec.config import TreeConfig
from eaglespec.draft.loader import load_eagle3
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.model.loader import load_model
from eaglespec.model.quant import quantize_model
from eaglespec.registry import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", nargs="+", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="src/eaglespec/heads/smollm2-135m")
    ap.add_argument("--modes", nargs="+", default=["w4a8", "w4a8-all"])
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-draft", type=int, default=2)
    ap.add_argument("--tree", default="4,4,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target-quant", default="w4a8", help="the target's (SmolLM2's default)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(resolve_model(args.model), dtype=torch.bfloat16, quant=args.target_quant)
    depth, top_k, nodes = (int(x) for x in args.tree.split(","))
    tree = TreeConfig(depth=depth, top_k=top_k, num_nodes=nodes)
    methods = [BenchMethod(PLAIN, None, 0, None, "plain")]
    for mode in args.modes:
        loaded = load_eagle3(args.draft, target.model)
        proposer = Eagle3Proposer(quantize_model(loaded.head, mode), loaded.capture)
        methods.append(BenchMethod(f"chain/{mode}", proposer, args.num_draft, None, mode))
        methods.append(BenchMethod(f"tree/{mode}", proposer, args.num_draft, tree, mode))
    questions = read_all(args.questions, args.limit)
    settings = RunSettings(max_tokens=args.max_tokens, temperature=0.0, seed=0)
    gens = run_benchmark(target, methods, questions, settings, memory_meter(target.model.device))
    stats = summarize(gens, questions, [m.name for m in methods], group_by="file", greedy=True)
    base = stats.overall[PLAIN]
    print(
        f"target {target.path.name}, {base.generations} turns; "
        f"plain {base.decode_tokens_per_second:.1f} tokens/s"
    )
    print("| method | tokens a round | tokens/s | x plain | draft ms / round | lossless |")
    print("|---|---|---|---|---|---|")
    for m in methods[1:]:
        got = stats.overall[m.name]
        tps = got.decode_tokens_per_second
        assert got.mean_accept_length is not None and got.round_time is not None
        check = got.lossless
        print(
            f"| {m.name} | {got.mean_accept_length:.3f} | {tps:.1f} | "
            f"{tps / base.decode_tokens_per_second:.2f}x | {got.round_time.draft_ms:.2f} "
            f"| {check.compared - check.mismatches}/{check.compared} |"
        )
    per_turn = [g.output.stats.tokens_per_second for g in gens if g.method == PLAIN]
    print(f"plain per turn: median {statistics.median(per_turn):.1f} tokens/s")


if __name__ == "__main__":
    main()
