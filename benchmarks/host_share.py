"""What a generation spends outside its kernels, and so what a native decode loop or round could
buy at most: each generation against a replay of only its kernel ops, in one process.

    python benchmarks/host_share.py [--model smollm2-135m] [--questions FILE...] [--limit 2]
                                    [--max-tokens 128] [--repeats 5]

Each question's first turn is answered greedily at the commands' default precision twice in
turn, plain (speculation off) and with the commands' default speculation (the shipped head,
adaptive), while the calls of the kernel ops are recorded: the target's decoder
(`cpu_layer.forward_decoder`, and `cpu_layer.greedy_chain` for greedy steps and chains, the
argmax included), the head's step (`cpu_layer.forward_head`, and `cpu_layer.head_chain` for
catch-ups and chain steps) and the greedy argmax (`sampling.greedy_tokens`, where the engine
calls it). Right after each generation those calls are replayed in order from a loop that does
nothing else, with the same arguments (the KV caches are written again with the same values).
The replay is what the generation costs with every other piece of host work gone (the engine's
Python, the tree and cache bookkeeping, the tokenizer, the policy) and only the ops' own Python
wrappers left: a floor for a loop or round run natively. Prints per mode the median ms a token
of the generation and of its replay, their ratio, and the speed-up a native loop could give at
most (generation / replay).

Without the fused CPU path (no AVX2, a GPU, torch.compile) the ops are never called and the
replay is empty: the script says so and stops.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eaglespec import LLM, SamplingParams, engine, generate
from eaglespec.bench.questions import read_all
from eaglespec.draft import proposer
from eaglespec.model import cpu_layer

DEFAULT_QUESTIONS = sorted(
    str(p) for p in (Path(__file__).parent.parent.parent / "shared/data/eval").glob("*.jsonl")
)
Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class Recorder:
    """Wraps module-level functions so that, while `calls` is a list, each call is appended to
    it (the original function and its arguments) before it runs."""

    def __init__(self) -> None:
        self.calls: list[Call] | None = None

    def wrap(self, module: Any, name: str) -> None:
        inner = getattr(module, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if self.calls is not None:
                self.calls.append((inner, args, kwargs))
            return inner(*args, **kwargs)

        setattr(module, name, recorded)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--questions", nargs="+", default=DEFAULT_QUESTIONS)
    ap.add_argument("--limit", type=int, default=2, help="questions per file")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="rounds over the questions (+1 warm-up)")
    args = ap.parse_args()
    if not args.questions:
        raise SystemExit("no questions: pass --questions (../shared/data/eval is not beside us)")
    llms = {
        "plain": LLM(args.model, speculation="off", progress=False),
        "speculative": LLM(args.model, progress=False),  # the commands' default speculation
    }
    prompts = [llms["plain"].encode(q.turns[0]) for q in read_all(args.questions, args.limit)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rec = Recorder()
    rec.wrap(cpu_layer, "forward_decoder")
    rec.wrap(cpu_layer, "greedy_chain")
    rec.wrap(cpu_layer, "forward_head")
    rec.wrap(cpu_layer, "head_chain")
    for module in (engine, generate, proposer):  # each imported greedy_tokens by name
        rec.wrap(module, "greedy_tokens")
    ms: dict[str, dict[str, list[float]]] = {m: {"run": [], "replay": []} for m in llms}
    for rep in range(args.repeats + 1):  # the first is a warm-up
        for prompt in prompts:
            for mode, llm in llms.items():
                rec.calls = []
                start = time.perf_counter()
                llm.generate(prompt, params)
                run = time.perf_counter() - start
                calls, rec.calls = rec.calls, None
                if not calls:
                    raise SystemExit("no kernel op was called: the fused CPU path is not in use")
                start = time.perf_counter()
                for fn, a, kw in calls:
                    fn(*a, **kw)
                replay = time.perf_counter() - start
                if rep:
                    ms[mode]["run"].append(run / args.max_tokens * 1e3)
                    ms[mode]["replay"].append(replay / args.max_tokens * 1e3)
    print(
        f"{args.model}, default precision, {len(prompts)} prompts x {args.repeats}, "
        f"{args.max_tokens} tokens, medians"
    )
    print("| mode | ms/token | kernel ops only, ms/token | ops / generation | at most |")
    print("|---|---|---|---|---|")
    for mode, t in ms.items():
        ratios = [r / g for r, g in zip(t["replay"], t["run"], strict=True)]
        share = statistics.median(ratios)
        print(
            f"| {mode} | {statistics.median(t['run']):.2f} | {statistics.median(t['replay']):.2f} "
            f"| {share:.3f} | {1 / share:.2f}x |"
        )


if __name__ == "__main__":
    main()
