"""Cost of one target verification forward against the number of draft tokens, and of one
EAGLE-3 draft step, on this machine.

    python benchmarks/verify_cost.py [--model smollm2-135m] [--dtype float32] [--prefix 128]
                                     [--sizes 1 2 4 8 16 32 64] [--repeats 15]
                                     [--quant none|int8|int4] [--compile none|block|full]
                                     [--no-attention-kernel] [--head-amx-min-rows 8 16]
                                     [--avx2-together both] [--direct both|each|stack]

Speculative decoding pays when verifying T tokens costs little more than decoding one: the speedup
is bounded by (mean accepted length) x (cost of 1 token) / (cost of a round). Each size runs the
target over T new tokens after a committed prefix, causal among them (a chain, as the engine
verifies it: no mask tensor, so T = 1 is exactly a decode step), then forgets them; medians over
--repeats after a warm-up round, the sizes timed round-robin. Until session 14 every size carried a
chain's tree mask, which made the one-token row slower than a real decode step and understated what
verification adds.

--no-attention-kernel keeps eaglespec's CPU attention kernel (model/cpu_attention.py) out of the
process, set before anything compiles: run once with and once without, each in its own process,
to compare it with PyTorch's and inductor's attention (a switch flipped inside one process is
re-guarded by dynamo and recompiled, so it does not compare anything).

--head-amx-min-rows times every size once per setting of the 8-bit kernel's fewest rows for one
AMX tile (csrc/w4a8.cpp; 16: only full tiles, the kernel before session 30), round-robin in one
process: what the output head's partial tiles buy a verification, where the CPU has AMX.

--avx2-together both times every size with the w4a8 kernels' AVX2 tiles taking a weight block's two
halves together (the default) and apart, round-robin in one process (the same bits; where the
kernels run their AVX2 path: on an AVX-512 CPU it changes nothing).

--direct both times every size with the fused layer's kernels called directly and run in one team
of threads a forward (csrc/layer.cpp's native_layer and csrc/team.h: the default, "on") and
through the ops, each in a parallel region of its own ("off", the fused layer before session 57),
round-robin in one process (the same bits); `each` adds the team alone and the direct calls alone;
`stack` times the decoder's layers in one pass over shared buffers (csrc/layer.cpp's native_stack,
the default since session 59) against the direct calls layer by layer (`use_native_stack`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from eaglespec import LLM
from eaglespec.draft.loader import load_eagle3, random_eagle3
from eaglespec.heads import packaged_head
from eaglespec.model import cpu_attention
from eaglespec.model.quant import quantize_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quant", default="none")
    ap.add_argument("--compile", default="none")
    ap.add_argument("--no-attention-kernel", action="store_true")
    ap.add_argument("--head-amx-min-rows", type=int, nargs="+", default=[])
    ap.add_argument("--avx2-together", choices=["on", "off", "both"], default="on")
    ap.add_argument("--direct", choices=["on", "off", "both", "each", "stack"], default="on")
    args = ap.parse_args()
    if args.no_attention_kernel:  # before any forward is traced: graphs keep what they saw
        cpu_attention.fits = lambda q, k: False

    llm = LLM(
        args.model, dtype=args.dtype, quant=args.quant, compile=args.compile, draft="none",
        progress=False,
    )  # fmt: skip
    model = llm.model
    L = model.cfg.num_layers
    capture = (2, L // 2, L - 3)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.cfg.vocab_size, (1, args.prefix), generator=gen)
    cache = model.new_cache(1, args.prefix + max(args.sizes) + 1)
    # the shipped head where one ships (else a random one over the whole vocabulary), quantized
    # as the commands quantize a head (methods.load_speculation)
    shipped = packaged_head(args.model)
    if shipped is not None:
        loaded = load_eagle3(str(shipped), model)
        raw, capture = loaded.head, tuple(loaded.capture)
    else:
        raw = random_eagle3(model, seed=0)
    head = quantize_model(raw, llm.quant)
    draft_cache = head.new_cache(1, args.prefix + max(args.sizes) + 1)
    print(
        f"{args.model} {args.dtype} quant {llm.quant} compile {args.compile}, "
        f"head {shipped.name if shipped else 'random'}, "
        f"prefix {args.prefix}, threads {torch.get_num_threads()}, "
        f"attention kernel {'off' if args.no_attention_kernel else 'on'}"
    )
    with torch.inference_mode():
        out = model(prefix, torch.arange(args.prefix)[None], cache, capture=capture)
        cache.advance([args.prefix])
        feats = head.combine([h[:, :1] for h in out.hidden])  # (1, 1, C)
        steps: dict[int, tuple[Callable[[], None], Callable[[], None]]] = {}
        for T in args.sizes:
            ids = torch.randint(0, model.cfg.vocab_size, (1, T), generator=gen)
            pos = torch.arange(args.prefix, args.prefix + T)[None]

            def verify(ids=ids, pos=pos) -> None:
                model(ids, pos, cache, capture=capture)  # causal among the new tokens

            def draft_step(ids=ids, pos=pos, T=T) -> None:
                head(ids, feats.expand(1, T, -1), pos - args.prefix, draft_cache)

            steps[T] = (verify, draft_step)
        # sizes round-robin, repeat by repeat, so that the machine's drift (up to 1.5x over
        # minutes on the shared VMs) falls on every size alike; the first round warms up
        # the kernel's AMX setting is touched only when asked (a CPU without the w4a8 kernel has
        # no such op), and put back after
        ops = torch.ops.eaglespec_w4a8
        together = {"on": [True], "off": [False], "both": [True, False]}[args.avx2_together]
        # (team, direct calls, one pass) of the fused layer ops (csrc/layer.cpp's use_team,
        # use_native, use_native_stack)
        direct = {
            "on": [(True, True, True)],
            "off": [(False, False, False)],
            "both": [(True, True, True), (False, False, False)],
            "each": [(True, True, True), (True, False, False), (False, True, True)]
            + [(False, False, False)],
            "stack": [(True, True, True), (True, True, False)],
        }[args.direct]
        settings: list[tuple[int | None, bool, tuple[bool, bool, bool]]] = [
            (a, t, d)
            for a in (list(args.head_amx_min_rows) or [None])
            for t in together
            for d in direct
        ]
        kept = ops.amx_min_rows(8, 16) if args.head_amx_min_rows else None
        layer_ops = torch.ops.eaglespec_layer if args.direct != "on" else None
        Setting = tuple[int | None, bool, tuple[bool, bool, bool]]
        samples: dict[tuple[Setting, int, int], list[float]] = {
            (a, T, i): [] for a in settings for T in steps for i in (0, 1)
        }
        for rep in range(args.repeats + 1):
            for a in settings:
                if a[0] is not None:
                    ops.amx_min_rows(8, a[0])
                if args.avx2_together != "on":
                    ops.avx2_together(a[1])
                if layer_ops is not None:
                    layer_ops.use_team(a[2][0])
                    layer_ops.use_native(a[2][1])
                    layer_ops.use_native_stack(a[2][2])
                for T, fns in steps.items():
                    for i, fn in enumerate(fns):
                        start = time.perf_counter()
                        fn()
                        if rep:
                            samples[(a, T, i)].append(time.perf_counter() - start)
        if kept is not None:
            ops.amx_min_rows(8, kept)
        if args.avx2_together != "on":
            ops.avx2_together(True)
        if layer_ops is not None:
            layer_ops.use_team(True)
            layer_ops.use_native(True)
            layer_ops.use_native_stack(True)
        ms = {key: statistics.median(v) * 1000 for key, v in samples.items()}
        for a in settings:
            if a[0] is not None:
                print(f"\nthe 8-bit kernel's AMX tiles from {a[0]} rows")
            if args.avx2_together != "on":
                print(f"\nAVX2 tiles: a weight block's halves {'together' if a[1] else 'apart'}")
            if args.direct != "on":
                team, native, stack = a[2]
                print(
                    f"\nfused layer: {'one team a forward' if team else 'a region per kernel'}, "
                    f"kernels {'called directly' if native else 'through the ops'}"
                    + (", the layers in one pass" if native and stack else "")
                )
            base = ms[(a, args.sizes[0], 0)]
            print("| draft tokens T | target forward ms | x one token | draft head step ms |")
            print("|---|---|---|---|")
            for T in args.sizes:
                f, d = ms[(a, T, 0)], ms[(a, T, 1)]
                print(f"| {T} | {f:.1f} | {f / base:.2f} | {d:.2f} |")
        if len(settings) > 1:  # each setting's times over the last one's, in the same process
            last = settings[-1]
            print(f"\ntime over the last setting's: {', '.join(map(str, settings))}")
            print("| draft tokens T | target forward | draft head step |")
            print("|---|---|---|")
            for T in args.sizes:
                cols = [
                    " / ".join(f"{ms[(a, T, i)] / ms[(last, T, i)]:.3f}" for a in settings)
                    for i in (0, 1)
                ]
                print(f"| {T} | {cols[0]} | {cols[1]} |")


if __name__ == "__main__":
    main()
