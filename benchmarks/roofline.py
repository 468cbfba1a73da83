"""The roofline of this machine for the w4a8 kernels: streaming bandwidth and int8 peak measured
(csrc/roofline.cpp), then every kernel's time per pass and its fraction of the binding limit at
M activation rows.

    python benchmarks/roofline.py [--shapes smollm2-135m] [--rows 1 2 3 4 8 16 32 64]
                                  [--repeats 9] [--threads 2] [--amx on|off|both]
                                  [--amx-min-rows N] [--avx2-together on|off|both]

Limits: a pass over a model's 4-bit decoder matrices (one copy per layer, as a decode step reads
them: together they exceed the private caches) must at least stream its weight bytes at the
measured bandwidth, and must at least execute M * K * N / 64 vpdpbusd at the measured VNNI peak
(on an AVX2 CPU without VNNI: M * K * N / 32 vpmaddubsw at their measured peak, which leaves out
the vpaddw and vpmaddwd the AVX2 path needs besides, so its fractions are upper bounds);
the binding limit is the larger of the two times, and "of limit" is that time over the measured
one (1.0 would be the hardware's best). The 8-bit output head likewise, two copies used in turn.
Bandwidth is measured over a buffer the size of the decoder's weights (what a decode step
streams; on a VM with a large shared L3 that can be above DRAM's) and over 1 GiB (DRAM).
Medians over --repeats after one warm-up round, all cases timed round-robin. Where the CPU has
AMX, `--amx both` times every case with the kernels' AMX tiles on and off (the same bits), and
`--amx-min-rows 1` sends every row count through them (the kernel's default starts at a
measured crossover). Where the kernels run their AVX2 path, `--avx2-together both` times every case
with every tile taking a weight block's two halves together (the
default) and apart (csrc/w4a8.cpp's block_tile_avx2; the same bits).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from eaglespec.model import w4a8
from eaglespec.model.extension import build

# name -> (layers, [(N, K) of the fused qkv, o, fused gate/up, down], (N, K) of the output head)
SHAPES = {
    "smollm2-135m": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)], (49152, 576)),
    "qwen2.5-0.5b": (24, [(1152, 896), (896, 896), (9728, 896), (896, 4864)], (151936, 896)),
    "qwen2.5-1.5b": (28, [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)], (151936, 1536)),
}
HEAD_COPIES = 2


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes per second reading a buffer of nbytes once, the engine's threads."""
    buf = torch.ones(nbytes, dtype=torch.uint8)
    return nbytes / median_time(lambda: torch.ops.eaglespec_roofline.stream(buf), repeats)


def int8_peak(repeats: int) -> tuple[str, int, float]:
    """The int8 multiply the w4a8 kernels use here (vpdpbusd, or vpmaddubsw on AVX2), its int8
    multiply-adds an instruction, and instructions per second on the engine's threads."""
    ops = torch.ops.eaglespec_roofline
    iters = 1_000_000
    # instruction, multiply-adds each, the op, its independent chains a round (csrc/roofline.cpp)
    name, macs, fn, chains = (
        ("vpdpbusd", 64, ops.vnni, 16) if ops.has_vnni() else ("vpmaddubsw", 32, ops.maddubs, 12)
    )
    seconds = median_time(lambda: fn(iters), repeats)
    return name, macs, chains * iters * torch.get_num_threads() / seconds


def random_w4a8(n: int, k: int) -> w4a8.W4A8Linear:
    q = torch.randint(0, 16, (n, k))
    s = torch.rand(n, k // w4a8.GROUP) * 0.01
    return w4a8.W4A8Linear(q, s, -8 * s)


def random_w8a8(n: int, k: int) -> w4a8.W8A8Linear:
    return w4a8.W8A8Linear(torch.randint(-127, 128, (n, k)), torch.rand(n, k // w4a8.GROUP) * 0.01)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--amx", choices=["on", "off", "both"], default="on")
    ap.add_argument("--amx-min-rows", type=int, default=None)
    ap.add_argument("--avx2-together", choices=["on", "off", "both"], default="on")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    w4a8.require()
    reason = build("roofline", needs="an x86 CPU with AVX2 or AVX-512 VNNI")
    if reason is not None:
        raise SystemExit(reason)
    ops = torch.ops.eaglespec_w4a8
    granted = ops.use_amx(True)  # whether this CPU and OS allow it
    modes = {"on": [granted], "off": [False], "both": [True, False] if granted else [False]}
    avx2 = ops.use_avx2(False)  # whether the AVX2 path runs here
    orders = {"on": [True], "off": [False], "both": [True, False]}[args.avx2_together]
    settings = [(amx, together) for amx in modes[args.amx] for together in orders]
    if args.amx_min_rows is not None:  # both kernels
        ops.amx_min_rows(4, args.amx_min_rows)
        ops.amx_min_rows(8, args.amx_min_rows)
    layers, shapes, head = SHAPES[args.shapes]
    decoder = [[random_w4a8(n, k) for n, k in shapes] for _ in range(layers)]
    heads = [random_w8a8(*head) for _ in range(HEAD_COPIES)]
    dec_bytes = sum(lin.weight.numel() for row in decoder for lin in row)
    head_bytes = heads[0].weight.numel()
    dec_macs = layers * sum(n * k for n, k in shapes)  # per activation row
    head_macs = head[0] * head[1]

    bw_model = bandwidth(dec_bytes, args.repeats)
    step_bytes = dec_bytes + head_bytes  # what one plain decode step streams
    bw_step = bandwidth(step_bytes, args.repeats)
    bw_dram = bandwidth(1 << 30, max(3, args.repeats // 3))
    op, op_macs, peak = int8_peak(args.repeats)
    print(f"{args.shapes}, {args.threads} threads, AMX {'granted' if granted else 'absent'}")
    print(
        f"streaming bandwidth: {bw_model / 1e9:.1f} GB/s over {dec_bytes / 1e6:.0f} MB "
        f"(the decoder's weights), {bw_dram / 1e9:.1f} GB/s over 1 GiB"
    )
    print(
        f"one decode step streams {step_bytes / 1e6:.0f} MB (decoder and output head): "
        f"{bw_step / 1e9:.1f} GB/s over that much, so at most {bw_step / step_bytes:.0f} "
        f"tokens/s at one row (the plain-decoding limit)"
    )
    print(f"int8 peak: {peak / 1e9:.2f} G {op}/s = {peak * op_macs / 1e9:.0f} G int8 MAC/s")
    print()
    print(
        "| kernel | rows M | AMX | AVX2 halves | ms | weight GB/s | G MAC/s | limit | limit ms "
        "| of limit |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    cases = []  # (kernel, rows, AMX, fn, weight bytes, MACs a row, copies per call)
    for m in args.rows:
        xs = {k: torch.randn(m, k).bfloat16() for _, k in shapes}
        xh = torch.randn(m, head[1]).bfloat16()

        # the ops themselves, called in turn from C++ as the fused layer calls them (no Python
        # between them: a call from Python costs about as much as a small matrix at one row)
        dec_args = (
            [xs[k] for _ in decoder for _, k in shapes],
            [lin.weight for row in decoder for lin in row],
            [n for _ in decoder for n, _ in shapes],
        )
        head_args = ([xh] * len(heads), [lin.weight for lin in heads], [head[0]] * len(heads))

        def run_decoder(args: tuple = dec_args) -> None:
            torch.ops.eaglespec_roofline.matrices(*args, 4)

        def run_head(args: tuple = head_args) -> None:
            torch.ops.eaglespec_roofline.matrices(*args, 8)

        for setting in settings:
            cases.append(("4-bit decoder", m, setting, run_decoder, dec_bytes, dec_macs, 1))
            cases.append(("8-bit head", m, setting, run_head, head_bytes, head_macs, HEAD_COPIES))
    # every case round-robin, repeat by repeat, so the machine's drift falls on all alike
    samples: list[list[float]] = [[] for _ in cases]
    with torch.inference_mode():
        for rep in range(args.repeats + 1):
            for i, (_, _, (amx, together), fn, *_rest) in enumerate(cases):
                ops.use_amx(amx)
                ops.avx2_together(together)
                start = time.perf_counter()
                fn()
                if rep:  # the first round warms up
                    samples[i].append(time.perf_counter() - start)
    ops.use_amx(True)
    ops.avx2_together(True)
    for (name, m, (amx, together), _, nbytes, macs, copies), times in zip(
        cases, samples, strict=True
    ):
        halves = ("together" if together else "apart") if avx2 else "-"
        t = statistics.median(times) / copies
        t_mem, t_mac = nbytes / bw_model, m * macs / op_macs / peak
        limit, t_lim = ("memory", t_mem) if t_mem >= t_mac else (op, t_mac)
        print(
            f"| {name} | {m} | {'on' if amx else 'off'} | {halves} | {t * 1e3:.3f} | "
            f"{nbytes / t / 1e9:.1f} | "
            f"{m * macs / t / 1e9:.0f} | {limit} | {t_lim * 1e3:.3f} | {t_lim / t:.2f} |"
        )


if __name__ == "__main__":
    main()
