"""One prefill forward over a random prompt, at the commands' default precision: the cost of
prompt processing against its length.

    python benchmarks/prefill_cost.py [--model smollm2-135m] [--sizes 64 256 1024] [--repeats 3]

Each size: a fresh cache, one forward over the prompt (no capture), projecting the last row's
logits only, as the engine's prefill does (until session 61 this projected every row's, 49,152
logits a row for SmolLM2, which no prefill of the engine computes); medians over --repeats after
one warm-up forward. To compare with another checkout, run the same command with
PYTHONPATH=<that checkout>/src.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eaglespec import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="auto", quant="auto", draft="none", progress=False)
    model = llm.model
    gen = torch.Generator().manual_seed(0)
    print(f"{args.model}, {llm.quant}, {torch.get_num_threads()} threads")
    print("| prompt tokens | ms | tok/s |")
    print("|---|---|---|")
    with torch.inference_mode():
        for n in args.sizes:
            ids = torch.randint(0, model.cfg.vocab_size, (1, n), generator=gen)
            pos = torch.arange(n)[None]
            last = torch.tensor([[n - 1]])  # (1, 1): the engine's prefill projects this row
            samples = []
            for rep in range(args.repeats + 1):
                cache = model.new_cache(1, n + 8)
                start = time.perf_counter()
                model(ids, pos, cache, logit_index=last)
                if rep:  # the first forward warms up
                    samples.append(time.perf_counter() - start)
            t = statistics.median(samples)
            print(f"| {n} | {t * 1e3:.0f} | {n / t:.0f} |")


if __name__ == "__main__":
    main()
