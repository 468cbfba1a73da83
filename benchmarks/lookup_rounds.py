"""What prompt lookup's grafted tokens cost and land, round by round: the shipped head's chain
with lookup (the commands' fixed shape), greedy at the default precision, over evaluation
questions. Rounds are split by whether a lookup continuation was grafted (the round verifies the
head's drafts plus the lookup's tokens) or not (the head's drafts alone).

    python benchmarks/lookup_rounds.py --questions ../shared/data/eval/*.jsonl [--limit 4]
                                       [--model smollm2-135m] [--num-draft 1] [--lookup 4]
                                       [--max-tokens 128]

Per kind of round: how many, tokens landed a round (the target's own token included), the
median round time, and the median target forward by the number of tokens it verified; then what
a grafted round adds over an ungrafted one: tokens, milliseconds, and milliseconds a token
against the whole run's. First turns only; one warm-up question first.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import eaglespec.engine as engine
from eaglespec import LLM, SamplingParams
from eaglespec.bench.questions import read_all


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", nargs="+", required=True)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-draft", type=int, default=1)
    ap.add_argument("--lookup", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    llm = LLM(
        args.model,
        dtype="auto",
        quant="auto",
        num_draft=args.num_draft,
        speculation="on",
        lookup_tokens=args.lookup,
        progress=False,
    )
    rounds: list[tuple[bool, int, float]] = []  # (grafted, tokens landed, seconds)
    forwards: dict[int, list[float]] = defaultdict(list)  # verified tokens -> seconds
    model_cls = type(llm.model)
    forward, speculate = model_cls.forward, engine.speculate_round

    def timed_forward(self: Any, ids: Any, *a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        out = forward(self, ids, *a, **k)
        forwards[ids.shape[1]].append(time.perf_counter() - start)
        return out

    def timed_round(*a: Any, **k: Any) -> engine.RoundOutput:
        start = time.perf_counter()
        out = speculate(*a, **k)
        grafted = out.drafted > args.num_draft  # lookup nodes make it deeper than the head's
        rounds.append((grafted, out.accepted[0] + 1, time.perf_counter() - start))
        return out

    model_cls.forward = timed_forward  # type: ignore[method-assign]
    engine.speculate_round = timed_round  # type: ignore[assignment]
    params = SamplingParams(max_tokens=args.max_tokens)
    questions = read_all(args.questions, args.limit)
    list(llm.stream(questions[0].turns[0], params))  # warm-up
    rounds.clear()
    forwards.clear()
    for q in questions:
        list(llm.stream(q.turns[0], params))
    widest = 1 + args.num_draft + args.lookup  # a verification's most tokens; wider: prefills
    print(
        f"{args.model}, chain of {args.num_draft} + {args.lookup} lookup tokens, "
        f"{len(questions)} questions, {len(rounds)} rounds"
    )
    print("| rounds | count | tokens a round | median ms a round |")
    print("|---|---|---|---|")
    stats = {}
    for grafted in (False, True):
        sel = [(n, s) for g, n, s in rounds if g == grafted]
        if not sel:
            continue
        tokens = sum(n for n, _ in sel) / len(sel)
        ms = statistics.median(s for _, s in sel) * 1e3
        stats[grafted] = (tokens, ms)
        label = "lookup grafted" if grafted else "head only"
        print(f"| {label} | {len(sel)} | {tokens:.2f} | {ms:.2f} |")
    print(
        "target forward, median ms by tokens verified: "
        + ", ".join(
            f"{t}: {statistics.median(v) * 1e3:.2f}"
            for t, v in sorted(forwards.items())
            if t <= widest
        )
    )
    if len(stats) == 2:
        extra_tokens = stats[True][0] - stats[False][0]
        extra_ms = stats[True][1] - stats[False][1]
        total_ms = sum(s for _, _, s in rounds) * 1e3
        total_tokens = sum(n for _, n, _ in rounds)
        print(
            f"a grafted round adds {extra_tokens:.2f} tokens for {extra_ms:.2f} ms: "
            f"{extra_ms / extra_tokens:.2f} ms a token, against {total_ms / total_tokens:.2f} "
            "over all rounds"
        )


if __name__ == "__main__":
    main()
