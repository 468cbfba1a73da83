"""Does what runs before a verification forward change its cost? A 2-token target forward timed
alone, right after the EAGLE-3 head's step (as in a round), and right after a pause of busy
Python as long as a round's orchestration; a 1-token step for scale. In one process at the
commands' default precision, sequences round-robin, medians.

    python benchmarks/verify_in_round.py [--model smollm2-135m] [--prefix 128] [--repeats 60]
                                         [--pause-ms 0.6]

Inside a round a chain of two's verification measured 1.16-1.2x a plain step against 1.06-1.07x
timed alone (benchmarks/round_split.py, session 19): this separates the head's effect on the
caches from the cores' state after any pause. Every forward writes its cache entries at the same
slots and forgets them, so each one sees the same prefix.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from eaglespec import LLM
from eaglespec.draft.loader import load_eagle3
from eaglespec.heads import packaged_head
from eaglespec.model.quant import quantize_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--pause-ms", type=float, default=0.6)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="auto", quant="auto", draft="none", progress=False)
    model, P = llm.model, args.prefix
    shipped = packaged_head(args.model)
    assert shipped is not None, f"no head ships for {args.model}"
    loaded = load_eagle3(str(shipped), model)
    capture = tuple(loaded.capture)
    head = quantize_model(loaded.head, llm.quant)  # as methods.load_speculation quantizes it
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.cfg.vocab_size, (1, P), generator=gen)
    cache, draft_cache = model.new_cache(1, P + 4), head.new_cache(1, P + 4)

    def pause() -> None:
        end = time.perf_counter() + args.pause_ms / 1000
        while time.perf_counter() < end:
            pass

    with torch.inference_mode():
        out = model(prefix, torch.arange(P)[None], cache, capture=capture)
        cache.advance([P])
        feats = head.combine(list(out.hidden))  # (1, P, C)
        head(prefix, feats, torch.arange(P)[None], draft_cache)
        draft_cache.advance([P])
        one, two = prefix[:, :1], prefix[:, :2]
        pos1, pos2 = torch.tensor([[P]]), torch.tensor([[P, P + 1]])
        last = torch.tensor([[1]])

        def step() -> None:
            model(one, pos1, cache, capture=capture)

        def verify() -> None:
            model(two, pos2, cache, capture=capture)

        def head_step() -> None:  # a catch-up of two tokens, as after one accepted draft
            head(two, feats[:, :2], pos2, draft_cache, logit_index=last)

        sequences: dict[str, list[tuple[str, Callable[[], None]]]] = {
            "1-token step": [("step", step)],
            "2-token verify alone": [("verify", verify)],
            "head step, then verify": [("head", head_step), ("verify", verify)],
            f"{args.pause_ms} ms of Python, then verify": [("pause", pause), ("verify", verify)],
        }
        times: dict[tuple[str, str], list[float]] = {
            (k, n): [] for k, seq in sequences.items() for n, _ in seq
        }
        for rep in range(args.repeats + 3):  # the first three rounds warm up
            for k, seq in sequences.items():
                for n, fn in seq:
                    start = time.perf_counter()
                    fn()
                    if rep >= 3:
                        times[(k, n)].append(time.perf_counter() - start)
    base = statistics.median(times[("1-token step", "step")])
    print(f"{args.model}, default precision ({llm.quant}), {P}-token prefix, medians")
    print("| sequence | call | ms | x 1-token step |")
    print("|---|---|---|---|")
    for (k, n), v in times.items():
        ms = statistics.median(v)
        print(f"| {k} | {n} | {ms * 1000:.2f} | {ms / base:.2f} |")


if __name__ == "__main__":
    main()
