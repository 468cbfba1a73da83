"""Plain greedy decoding of B sequences at once against one, at the commands' default precision:
what batching buys when every row goes through the same kernels (answering many prompts for
training, a full server batch).

    python benchmarks/batched_decode.py [--model smollm2-135m] [--batches 1 8 16 32]
                                        [--max-tokens 64] [--repeats 3]

B copies of a chat prompt (every row decodes the same number of tokens: ignore_eos), plain
greedy, eager; tokens per second of decoding = B * max_tokens over the generation's wall time,
prefill included (one forward over B rows). Medians over --repeats after one warm-up run; batch
sizes interleaved repeat by repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time

from eaglespec import LLM, SamplingParams

PROMPT = "Write a short story about a robot learning to paint."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="auto", quant="auto", draft="none", progress=False)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    times: dict[int, list[float]] = {b: [] for b in args.batches}
    for rep in range(args.repeats + 1):
        for b in args.batches:
            start = time.perf_counter()
            outs = llm.generate([PROMPT] * b, params)
            if rep:  # the first round warms up
                times[b].append(time.perf_counter() - start)
            assert all(o.token_ids == outs[0].token_ids for o in outs), "rows differ"
    one = args.max_tokens / statistics.median(times[args.batches[0]])
    print(f"{args.model}, default precision, {args.max_tokens} tokens a row")
    print("| rows B | s | tok/s | x first row count |")
    print("|---|---|---|---|")
    for b in args.batches:
        t = statistics.median(times[b])
        rate = b * args.max_tokens / t
        print(f"| {b} | {t:.2f} | {rate:.0f} | {rate / one:.2f} |")


if __name__ == "__main__":
    main()
