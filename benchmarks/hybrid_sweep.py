"""Prompt lookup grafted into EAGLE-3 rounds (draft/hybrid.py): which graft size and n-gram
lengths pay. Every configuration runs the same questions in one process, interleaved per question
after one warm-up (bench/runner.py), against plain decoding at the commands' default precision
with the shipped head; greedy, and every output is checked against plain's.

    python benchmarks/hybrid_sweep.py --questions ../shared/data/eval/*.jsonl --limit 4 \\
        --configs 2:0 2:4:2 2:2:2 2:6:2 2:4:1 2:4:3 1:4:2

A configuration is CHAIN:LOOKUP[:MIN_NGRAM[:MAX_NGRAM]] (LOOKUP 0: the head alone; n-grams of
MIN .. MAX tokens, default 2 .. 3), or tree:LOOKUP[...] for the 4,4,16 tree, tree=D,K,N:LOOKUP[...]
for another; lookup:N is prompt lookup alone (N tokens a round, no head). --draft takes a head
folder other than the shipped one. Prints one row per
configuration: tokens a round (the bonus included) and speed over plain, over all turns and per
file.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from eaglespec.bench.lineup import BenchMethod
from eaglespec.bench.memory import memory_meter
from eaglespec.bench.questions import read_all
from eaglespec.bench.runner import RunSettings, run_benchmark
from eaglespec.config import TreeConfig
from eaglespec.draft.hybrid import HybridProposer
from eaglespec.draft.loader import load_eagle3
from eaglespec.draft.lookup import PromptLookupProposer
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.heads import packaged_head
from eaglespec.model.loader import load_model
from eaglespec.model.quant import quantize_model
from eaglespec.registry import resolve_model

TREE = TreeConfig(depth=4, top_k=4, num_nodes=16)


def method(label: str, head: Eagle3Proposer) -> BenchMethod:
    parts = label.split(":")
    if parts[0] == "lookup":  # prompt lookup alone (no head), N draft tokens a round
        return BenchMethod(label, PromptLookupProposer(), int(parts[1]), None, label)
    tree = None
    if parts[0].startswith("tree"):
        shape = parts[0].removeprefix("tree").lstrip("=")
        tree = TreeConfig(*map(int, shape.split(","))) if shape else TREE
    chain = 0 if tree else int(parts[0])
    lookup = int(parts[1])
    if lookup == 0:
        return BenchMethod(label, head, chain, tree, label)  # type: ignore[arg-type]
    ngrams = [int(p) for p in parts[2:4]]
    lo, hi = (ngrams + [2, 3][len(ngrams) :])[:2]
    hybrid = HybridProposer(head, lookup, max_ngram=max(lo, hi), min_ngram=lo)
    return BenchMethod(label, hybrid, chain, tree, label)  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--questions", nargs="+", required=True)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--configs", nargs="+", default=["2:0", "2:4:2"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft", help="EAGLE-3 head folder (default: the model's shipped head)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target = load_model(resolve_model(args.model), dtype="auto", quant="auto")
    loaded = load_eagle3(str(args.draft or packaged_head(args.model)), target.model)
    quantize_model(loaded.head, target.precision.quant)
    head = Eagle3Proposer(loaded.head, loaded.capture)
    plain = BenchMethod("plain", None, 0, None, "plain")  # type: ignore[arg-type]
    methods = [plain] + [method(c, head) for c in args.configs]
    questions = read_all(args.questions, args.limit)
    start = time.perf_counter()
    gens = run_benchmark(
        target,
        methods,
        questions,
        RunSettings(args.max_tokens, 0.0, 0),
        memory_meter(target.model.device),
    )
    # per (method, file): tokens, forwards, seconds; plain's tokens for the lossless check
    tokens: dict[tuple[str, str], int] = defaultdict(int)
    landed: dict[tuple[str, str], int] = defaultdict(int)  # accepted + rounds
    rounds: dict[tuple[str, str], int] = defaultdict(int)
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    plain_ids = {(g.question, g.turn): g.output.token_ids for g in gens if g.method == "plain"}
    lossless: dict[str, bool] = defaultdict(lambda: True)
    for g in gens:
        s = g.output.stats
        for key in ((g.method, questions[g.question].source), (g.method, "all")):
            tokens[key] += s.new_tokens
            landed[key] += s.accepted_tokens + s.rounds
            rounds[key] += s.rounds
            seconds[key] += s.prefill_seconds + s.decode_seconds
        lossless[g.method] &= g.output.token_ids == plain_ids[(g.question, g.turn)]
    files = sorted({q.source for q in questions}) + ["all"]
    print(f"{len(gens)} generations in {time.perf_counter() - start:.0f} s")
    print("| config | " + " | ".join(files) + " | lossless |")
    print("|---" * (len(files) + 2) + "|")
    for m in methods[1:]:
        cells = []
        for f in files:
            key, base = (m.name, f), ("plain", f)
            speed = (tokens[key] / seconds[key]) / (tokens[base] / seconds[base])
            cells.append(f"{landed[key] / max(1, rounds[key]):.2f} / {speed:.2f}x")
        print(f"| {m.name} | " + " | ".join(cells) + f" | {lossless[m.name]} |")


if __name__ == "__main__":
    main()
