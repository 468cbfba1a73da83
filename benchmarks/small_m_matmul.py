"""Dense matmul cost for the few rows of a verify forward: weight stored (out, in) as nn.Linear
does (`F.linear(x, W)`) against stored transposed (in, out) (`x @ W_t`).

    python benchmarks/small_m_matmul.py [--out 3072] [--in 576] [--rows 1 2 4 8 16]

Times one layer-sized matmul (default: SmolLM2's fused gate/up, 3072 x 576, fp32), median over
200 calls after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def median_us(fn, calls: int = 200) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=int, default=3072)
    ap.add_argument("--in", dest="inp", type=int, default=576)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    torch.manual_seed(0)
    w = torch.randn(args.out, args.inp)
    w_t = w.t().contiguous()
    print(f"{args.out} x {args.inp} fp32, threads {torch.get_num_threads()}")
    print("| rows | F.linear(x, W) us | x @ W_t us |")
    print("|---|---|---|")
    for m in args.rows:
        x = torch.randn(m, args.inp)
        a = median_us(lambda x=x: F.linear(x, w))
        b = median_us(lambda x=x: x @ w_t)
        print(f"| {m} | {a:.0f} | {b:.0f} |")


if __name__ == "__main__":
    main()
