"""The decode matmuls of a model, kernel against kernel: torch's int4 (`--quant int4`) and
eaglespec's w4a8 (`--quant w4a8`), weights cold in cache; with --head the output head instead:
torch's per-channel int8 (`_weight_int8pack_mm`, bf16 activations) against eaglespec's 8-bit
kernel (8-bit codes per group of 32, int8 activations: `--quant w4a8`'s head since 2026-11-25).

    python benchmarks/w4a8_kernel.py [--shapes qwen2.5-1.5b] [--rows 1 2 4 8] [--repeats 7]
    python benchmarks/w4a8_kernel.py --head --shapes smollm2-135m --rows 1 2 4

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
from eaglespec.model.quant import Int4Linear, Int8Linear

# name -> (layers, [(N, K) of the fused qkv, o, fused gate/up, down])
SHAPES = {
    "smollm2-135m": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)]),
    "qwen2.5-0.5b": (24, [(1152, 896), (896, 896), (9728, 896), (896, 4864)]),
    "qwen2.5-1.5b": (28, [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]),
}
HEADS = {  # name -> (N, K) of the output head
    "smollm2-135m": (49152, 576),
    "qwen2.5-0.5b": (151936, 896),
    "qwen2.5-1.5b": (151936, 1536),
}
HEAD_COPIES = 2  # heads used in turn, so each call finds its weights out of cache


def build(
    shapes: list[tuple[int, int]], layers: int, head: bool
) -> list[list[tuple[nn.Module, nn.Module]]]:
    out = []
    for _ in range(layers):
        row = []
        for n, k in shapes:
            lin = nn.Linear(k, n, bias=False).requires_grad_(False)
            nn.init.normal_(lin.weight, std=0.02)
            if head:
                row.append((Int8Linear.from_linear(lin), w4a8.W8A8Linear.from_linear(lin)))
            else:
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
    ap.add_argument("--head", action="store_true", help="the output head: int8 against w8a8")
    args = ap.parse_args()
    w4a8.require()
    layers, shapes = SHAPES[args.shapes]
    if args.head:
        layers, shapes = HEAD_COPIES, [HEADS[args.shapes]]
    names = ("int8", "w8a8") if args.head else ("int4", "w4a8")
    model = build(shapes, layers, args.head)
    nbytes = {
        name: sum(weight_bytes(pair[i]) for row in model for pair in row)
        for i, name in enumerate(names)
    }
    a, b = names
    print(
        f"{args.shapes}{' output head' if args.head else ''}: {layers} copies, weights "
        f"{a} {nbytes[a] / 1e6:.0f} MB, {b} {nbytes[b] / 1e6:.0f} MB, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"| rows M | {a} ms | {a} GB/s | {b} ms | {b} GB/s | {b} speedup |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for m in args.rows:
            xs = {k: torch.randn(m, k).bfloat16() for _, k in shapes}
            times: dict[str, list[float]] = {name: [] for name in names}
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
                f"| {m} | {med[a] * 1e3:.2f} | {nbytes[a] / med[a] / 1e9:.1f} | "
                f"{med[b] * 1e3:.2f} | {nbytes[b] / med[b] / 1e9:.1f} | {med[a] / med[b]:.2f}x |"
            )


if __name__ == "__main__":
    main()
