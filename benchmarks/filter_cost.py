"""What the top-k / top-p / min-p filters cost on a real model's distributions, by candidate tiers.

Samples continuations of a few requests (train/synth.py's setting by default: temperature 1, top-p
0.99, as prompt writing for `eaglespec train` samples), takes the target's logits at every
sampled position in one forward, then times the filters over those rows in batches, once per
tier setting, round-robin, medians; and counts how many rows end in each tier (sampling.py's
CANDIDATES: a row goes on to the next tier only when its filters reach past the one before).

    python benchmarks/filter_cost.py [--model qwen2.5-coder-1.5b] [--rows 16] [--top-p 0.99]
                                     [--tiers 1024 1024,16384 1024,4096,16384]

Every tier setting keeps the same number of tokens a row as a whole sort (counted: which of tied
logits at a nucleus edge stay is the sort order's choice, and bf16 logits tie often).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eaglespec import LLM, SamplingParams, sampling

PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash map works.",
    "Give me three ideas for a birthday party.",
    "What is the capital of Australia and why was it chosen?",
    "Write a Python function that merges two sorted lists.",
    "Summarize the plot of a heist movie you invent.",
    "Ask me a question about my weekend.",
    "Draft an email asking for a deadline extension.",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", type=int, default=48, help="sampled tokens a prompt")
    ap.add_argument("--rows", type=int, default=16, help="rows filtered at once")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.99)
    ap.add_argument("--tiers", nargs="+", default=["1024", "1024,16384", "1024,4096,16384"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype="auto", quant="auto", draft="none", progress=False)
    params = SamplingParams(
        max_tokens=args.tokens, temperature=args.temperature, top_p=args.top_p, seed=0
    )
    rows = []
    with torch.inference_mode():
        for out in llm.generate(list(PROMPTS), params):
            ids = out.prompt_token_ids + out.token_ids
            cache = llm.model.new_cache(1, len(ids))
            T = len(ids)
            logits = llm.model(torch.tensor([ids]), torch.arange(T)[None], cache).logits[0]
            rows.append(logits[len(out.prompt_token_ids) - 1 : T - 1])  # (new, V)
    scaled = torch.cat(rows) / args.temperature  # (N, V) fp32
    N, V = scaled.shape
    batches = [scaled[i : i + args.rows] for i in range(0, N - args.rows + 1, args.rows)]
    st = sampling.SamplingTensors.from_params([params] * args.rows)
    settings = {t: tuple(int(x) for x in t.split(",")) for t in args.tiers}

    # where each row ends: the smallest tier its filters end within (V: a whole sort)
    full = torch.cat([sampling._filter_mask(b, st, ()) for b in batches])  # (n, V)
    kept = (~full).sum(-1)  # (n,)
    edges = sorted({x for t in settings.values() for x in t})
    print(
        f"{args.model}: {len(batches) * args.rows} rows of {V} logits, temperature "
        f"{args.temperature}, top-p {args.top_p}; tokens the nucleus keeps: median "
        f"{int(kept.median())}, max {int(kept.max())}"
    )
    lo = 0
    for e in [*edges, V]:
        n = int(((kept > lo) & (kept <= e)).sum())
        print(f"  rows keeping {lo + 1}-{e}: {n}")
        lo = e

    times: dict[str, list[float]] = {t: [] for t in settings}
    differ: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, tiers in settings.items():
            t0 = time.perf_counter()
            masks = [sampling._filter_mask(b, st, tiers) for b in batches]
            times[name].append((time.perf_counter() - t0) / len(batches))
            # how many tokens a row keeps (which of tied logits at the edge: sort order's choice)
            differ[name] = int(((~torch.cat(masks)).sum(-1) != kept).sum())
    base = statistics.median(times[args.tiers[0]])
    head = (
        f"| tiers | ms per {args.rows} rows | against {args.tiers[0]} | rows kept unlike a sort |"
    )
    print("\n" + head)
    print("|---|---|---|---|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m * 1e3:.1f} | {m / base:.2f}x | {differ[name]} |")


if __name__ == "__main__":
    main()
