"""Plain greedy decoding of B sequences at once against one, at the commands' default precision:
what batching buys when every row goes through the same kernels (answering many prompts for
training, a full server batch).

    python benchmarks/batched_decode.py [--model smollm2-135m] [--batches 1 8 16 32]
                                        [--max-tokens 64] [--repeats 3] [--amx on|off|both]

B copies of a chat prompt (every row decodes the same number of tokens: ignore_eos), plain
greedy, eager; tokens per second of decoding = B * max_tokens over the generation's wall time,
prefill included (one forward over B rows). Medians over --repeats after one warm-up run; batch
sizes interleaved repeat by repeat. `--amx both` times each batch with the w4a8 kernels' AMX
tiles on and off in turn (csrc/w4a8.cpp; the same bits either way, checked).

    python benchmarks/batched_decode.py --questions ../shared/data/eval/*.jsonl --limit 2
                                        [--speculation off adaptive] [--repeats 3]

One batch of real prompts instead (the first turns of each file's first --limit questions: the
lengths differ), greedy, ending at end-of-turn or --max-tokens, once per --speculation mode (an
LLM each, the commands' default draft), the modes interleaved repeat by repeat and every output
checked equal to the first mode's. The first call of each mode is reported apart: an adaptive
policy measures its arms at each batch size on first meeting it (policy.py) and keeps what it
learned for the later calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eaglespec import LLM, SamplingParams
from eaglespec.bench.questions import read_all

PROMPT = "Write a short story about a robot learning to paint."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--amx", choices=["on", "off", "both"], default="on")
    ap.add_argument("--questions", nargs="+", help="question files: one batch of their prompts")
    ap.add_argument("--limit", type=int, default=2, help="questions a file (with --questions)")
    ap.add_argument("--speculation", nargs="+", default=["off", "adaptive"])
    args = ap.parse_args()
    if args.questions:
        real_prompts(args)
        return
    llm = LLM(args.model, dtype="auto", quant="auto", draft="none", progress=False)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.amx]
    granted = torch.ops.eaglespec_w4a8.use_amx(True)  # whether this CPU and OS allow it
    times: dict[tuple[int, bool], list[float]] = {(b, a): [] for b in args.batches for a in modes}
    first: dict[int, list[int]] = {}
    for rep in range(args.repeats + 1):
        for b in args.batches:
            for amx in modes:
                torch.ops.eaglespec_w4a8.use_amx(amx)
                start = time.perf_counter()
                outs = llm.generate([PROMPT] * b, params)
                if rep:  # the first round warms up
                    times[b, amx].append(time.perf_counter() - start)
                assert all(o.token_ids == outs[0].token_ids for o in outs), "rows differ"
                assert first.setdefault(b, outs[0].token_ids) == outs[0].token_ids, "AMX differs"
    torch.ops.eaglespec_w4a8.use_amx(True)
    one = args.max_tokens / statistics.median(times[args.batches[0], modes[0]])
    print(f"{args.model}, default precision, {args.max_tokens} tokens a row, AMX here: {granted}")
    print("| rows B | AMX | s | tok/s | x first row count |")
    print("|---|---|---|---|---|")
    for b in args.batches:
        for amx in modes:
            t = statistics.median(times[b, amx])
            rate = b * args.max_tokens / t
            print(f"| {b} | {'on' if amx else 'off'} | {t:.2f} | {rate:.0f} | {rate / one:.2f} |")


def real_prompts(args: argparse.Namespace) -> None:
    prompts = [q.turns[0] for q in read_all(args.questions, args.limit)]
    llms = {m: LLM(args.model, speculation=m, progress=False) for m in args.speculation}
    params = SamplingParams(max_tokens=args.max_tokens)
    times: dict[str, list[float]] = {m: [] for m in llms}
    first: list[list[int]] = []
    for _ in range(args.repeats + 1):
        for mode, llm in llms.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            times[mode].append(time.perf_counter() - start)
            ids = [o.token_ids for o in outs]
            if not first:
                first.extend(ids)
            assert ids == first, f"{mode} differs from {args.speculation[0]}"
    tokens = sum(len(t) for t in first)
    lengths = [len(llms[args.speculation[0]].encode(p)) for p in prompts]
    print(
        f"{args.model}, default precision, {len(prompts)} prompts of {min(lengths)}-"
        f"{max(lengths)} tokens ({sum(lengths)} in all), {tokens} new tokens in all"
    )
    base = statistics.median(times[args.speculation[0]][1:])
    print(f"| speculation | first call s | later calls s (median) | x {args.speculation[0]} |")
    print("|---|---|---|---|")
    for mode, t in times.items():
        later = statistics.median(t[1:])
        print(f"| {mode} | {t[0]:.2f} | {later:.2f} | {base / later:.2f} |")


if __name__ == "__main__":
    main()
