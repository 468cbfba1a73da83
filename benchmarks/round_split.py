"""Where a speculative round's time goes, against a plain step, in one process at the default
precision: the target's forwards by number of new tokens, the EAGLE-3 head's forwards, and the
rest (the engine's orchestration: tree building, verification, the host sync, bookkeeping).

    python benchmarks/round_split.py [--model smollm2-135m] [--chains 1 2] [--tokens 160]
                                     [--repeats 4] [--prompt TEXT]

Plain decoding (generate.generate_stream) and each chain length (LLM with the shipped head,
speculation on) generate the same greedy answer in turn, repeat by repeat, so the machine's drift
falls on all alike; the target's and the head's `forward` are wrapped with perf_counter. Medians
over repeats. A round's "rest" = its wall time (BatchRunner.round) - target - head.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from eaglespec import LLM, SamplingParams
from eaglespec.draft.eagle3 import Eagle3Head
from eaglespec.engine import BatchRunner
from eaglespec.generate import generate_stream
from eaglespec.heads import packaged_head
from eaglespec.requests import collect_outputs


class Timed:
    """Wraps `cls.name` to add each call's seconds to `self.seconds[key(args)]`."""

    def __init__(self, cls: type, name: str, key: Callable[..., Any]) -> None:
        self.seconds: dict[Any, list[float]] = defaultdict(list)
        self.calls: list[float] = []  # every call's seconds, in order
        inner = getattr(cls, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            elapsed = time.perf_counter() - start
            self.seconds[key(*args)].append(elapsed)
            self.calls.append(elapsed)
            return out

        setattr(cls, name, timed)

    def total(self) -> float:
        return sum(sum(v) for v in self.seconds.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chains", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument(
        "--prompt", default="Write a short story about a robot who learns to paint. Make it vivid."
    )
    args = ap.parse_args()
    head = packaged_head(args.model)
    assert head is not None, f"no head ships for {args.model}"
    llms = {
        k: LLM(
            args.model,
            dtype="auto",
            quant="auto",
            draft=str(head),
            num_draft=k,
            speculation="on",
            lookup_tokens=0,
            progress=False,
        )  # fmt: skip
        for k in args.chains
    }
    plain_llm = llms[args.chains[0]]
    prompt = plain_llm.encode(args.prompt)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    target = Timed(type(plain_llm.model), "forward", lambda self, ids, *a: ids.shape[1])
    draft = Timed(Eagle3Head, "_step", lambda self, *a: "head")  # forward and feed
    rounds = Timed(BatchRunner, "round", lambda self, *a: "round")
    rows: dict[str, list[dict[str, float]]] = defaultdict(list)
    for rep in range(args.repeats + 1):  # the first is a warm-up
        for name in ["plain", *args.chains]:
            for t in (target, draft, rounds):
                t.seconds.clear()
                t.calls.clear()
            start = time.perf_counter()
            if name == "plain":
                model, tok = plain_llm.model, plain_llm.tokenizer
                collect_outputs(generate_stream(model, tok, [prompt], [params]))
            else:
                list(llms[name].stream(prompt, params))  # type: ignore[index]
            wall = time.perf_counter() - start
            if not rep:
                continue
            n = len(rounds.seconds["round"]) or args.tokens  # plain: one step a token
            verify = target.seconds[1 if name == "plain" else int(name) + 1]  # a chain's forward
            # every forward of the rounds (the prefill is the first call): under the default
            # draft_min_prob a chain's round may draft fewer tokens than its length
            in_rounds = sum(target.calls[1:])
            spec = name != "plain"
            rows[str(name)].append(
                {
                    "tok/s": args.tokens / wall,
                    "tokens/round": args.tokens / n,
                    "forward ms": statistics.median(verify) * 1e3,  # a full-length chain's
                    "forwards ms/round": in_rounds / n * 1e3 if spec else 0.0,
                    "head ms/round": draft.total() / n * 1e3,
                    "rest ms/round": (rounds.total() - in_rounds - draft.total()) / n * 1e3
                    if spec
                    else 0.0,
                    "round ms": rounds.total() / n * 1e3 if spec else 0.0,
                }
            )
    keys = list(next(iter(rows.values()))[0])
    print(f"{args.model}, default precision, {args.tokens} tokens, medians of {args.repeats}")
    print("| run | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, reps in rows.items():
        med = {k: statistics.median(r[k] for r in reps) for k in keys}
        label = "plain" if name == "plain" else f"chain of {name}"
        print(f"| {label} | " + " | ".join(f"{med[k]:.2f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
