"""What a w4a8 matmul call costs beyond its bytes: the same cold weights streamed by one call, by
P calls over consecutive slices of them, and (L3-warm) by P calls over one matrix's slices.

    python benchmarks/call_split.py [--threads 2] [--pieces 16] [--rows 1 4 8] [--repeats 9]

A 16,384 x 576 4-bit matrix (5.9 MB, SmolLM2's width) in 24 copies (141 MB: beyond every cache,
as a decode step's 120 decoder matrices are together); a pass reads each copy once, either in
one call or in P calls of 16,384 / P output rows each, which read the very same addresses in
the same order. The warm pass makes P calls over the first copy's slices again and again. Prints
the milliseconds a copy and, for the split pass, the extra microseconds a call over one call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from roofline import random_w4a8

from eaglespec.model import w4a8

N, K, COPIES = 16384, 576, 24
PASSES = ("one call", "split", "split, warm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pieces", type=int, default=16)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    w4a8.require()
    torch.set_num_threads(args.threads)
    op = torch.ops.eaglespec_w4a8.linear
    copies = [random_w4a8(N, K).weight for _ in range(COPIES)]
    n, per = N // args.pieces, copies[0].numel() // args.pieces
    slices = [[w[i * per : (i + 1) * per] for i in range(args.pieces)] for w in copies]
    times: dict[tuple[int, str], list[float]] = {}
    with torch.inference_mode():
        for rep in range(args.repeats + 1):
            for m in args.rows:
                x = torch.randn(m, K).bfloat16()
                for name in PASSES:
                    start = time.perf_counter()
                    if name == "one call":
                        for w in copies:
                            op(x, w, N)
                    else:  # the split pass over every copy, or the warm one over the first
                        for ws in slices if name == "split" else [slices[0]] * COPIES:
                            for s in ws:
                                op(x, s, n)
                    if rep:  # the first round warms up
                        times.setdefault((m, name), []).append(
                            (time.perf_counter() - start) / COPIES
                        )
    mb = copies[0].numel() / 1e6
    print(
        f"{N} x {K} 4-bit ({mb:.1f} MB) x {COPIES} copies, {args.threads} threads, "
        f"{args.pieces} calls a copy when split; ms a copy, medians of {args.repeats}"
    )
    print("| rows M | one call | split | split, warm | extra us a call (split - one) |")
    print("|---|---|---|---|---|")
    for m in args.rows:
        one, split, warm = (statistics.median(times[(m, k)]) for k in PASSES)
        extra = (split - one) / args.pieces * 1e6
        print(f"| {m} | {one * 1e3:.3f} | {split * 1e3:.3f} | {warm * 1e3:.3f} | {extra:.1f} |")


if __name__ == "__main__":
    main()
