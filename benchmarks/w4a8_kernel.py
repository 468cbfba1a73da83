"""The decode matmuls of a model, kernel against kernel: torch's int4 (`--quant int4`) and
eaglespec's w4a8 (`--quant w4a8`), weights cold in cache.

    python benchmarks/w4a8_kernel.py [--shapes qwen2.5-1.5b] [--rows 1 2 4 8] [--repeats 7]

Builds one layer's matrices per decoder layer of the named shape set with random codes (the
speed does not depend on the values), so the weights of all layers together exceed the last-level
cache as a real decode step's do, and runs every layer's matmuls in order for M activation rows.
Prints ms per pass over all layers and the weight bytes streamed per second. Kernels are
interleaved pass by pass; medians over --repeats after one warm-up pass.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from eaglespec.model import w4a8
from eaglespec.model.quant import Int4Linear

# name -> (layers, [(N, K) of the fused qkv, o, fused gate/up, down])
SHAPES = {
    "smollm2-135m": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)]),
    "qwen2.5-0.5b": (24, [(1152, 896), (896, 896), (9728, 896), (896, 4864)]),
    "qwen2.5-1.5b": (28, [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]),
}


def build(shapes: list[tuple[int, int]], layers: int) -> list[list[tuple[nn.Module, nn.Module]]]:
    out = []
    for _ in range(layers):
        row = []
        for n, k in shapes:
            lin = nn.Linear(k, n, bias=False).requires_grad_(False)
            nn.init.normal_(lin.weight, std=0.02)
            row.append((Int4Linear.from_linear(lin), w4a8.W4A8Linear.from_linear(lin)))
        out.append(row)
    return out


def weight_bytes(mod: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in mod.buffers() if b is not None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    w4a8.require()
    layers, shapes = SHAPES[args.shapes]
    model = build(shapes, layers)
    nbytes = {
        name: sum(weight_bytes(pair[i]) for row in model for pair in row)
        for i, name in enumerate(("int4", "w4a8"))
    }
    print(
        f"{args.shapes}: {layers} layers, weights int4 {nbytes['int4'] / 1e6:.0f} MB, "
        f"w4a8 {nbytes['w4a8'] / 1e6:.0f} MB, {torch.get_num_threads()} threads"
    )
    print("| rows M | int4 ms | int4 GB/s | w4a8 ms | w4a8 GB/s | w4a8 speedup |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for m in args.rows:
            xs = {k: torch.randn(m, k).bfloat16() for _, k in shapes}
            times: dict[str, list[float]] = {"int4": [], "w4a8": []}
            for rep in range(args.repeats + 1):
                for i, name in enumerate(times):
                    start = time.perf_counter()
                    for row in model:
                        for pair, (_, k) in zip(row, shapes, strict=True):
                            pair[i](xs[k])
                    if rep:  # the first pass warms up
                        times[name].append(time.perf_counter() - start)
            med = {name: statistics.median(t) for name, t in times.items()}
            print(
                f"| {m} | {med['int4'] * 1e3:.2f} | {nbytes['int4'] / med['int4'] / 1e9:.1f} | "
                f"{med['w4a8'] * 1e3:.2f} | {nbytes['w4a8'] / med['w4a8'] / 1e9:.1f} | "
                f"{med['int4'] / med['w4a8']:.2f}x |"
            )


if __name__ == "__main__":
    main()
