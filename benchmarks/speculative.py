"""Speculative decoding methods against plain decoding on the same engine, prompts and outputs.

    python benchmarks/speculative.py --questions ../shared/data/eval/humaneval_question.jsonl \\
        [--model qwen2.5-coder-1.5b] [--draft-model qwen2.5-coder-0.5b]
        [--methods plain draft-model lookup]
        [--limit 3] [--max-tokens 128] [--draft-tokens 4] [--dtype float32] [--quant none]

Questions are FastChat files (`turns`; the first turn is used, with the model's chat template).
Greedy decoding; every method's output is checked token for token against plain decoding and the
result recorded as `lossless`. A warm-up generation runs before timing. Decode tok/s is tokens
after the first over the time after the first token, per prompt, then averaged over prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from eaglespec import LLM, SamplingParams


def load_questions(paths: list[str], limit: int) -> list[tuple[str, str]]:
    out = []
    for path in paths:
        lines = Path(path).read_text().splitlines()
        for line in lines[:limit]:
            q = json.loads(line)
            out.append((Path(path).stem.replace("_question", ""), q["turns"][0]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--questions", nargs="+", required=True)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--methods", nargs="+", default=["plain", "draft-model", "lookup"])
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quant", default="none")
    args = ap.parse_args()

    questions = load_questions(args.questions, args.limit)
    params = SamplingParams(max_tokens=args.max_tokens)
    base = LLM(args.model, dtype=args.dtype, quant=args.quant, draft="none", progress=False)
    prompts = [base.encode(q) for _, q in questions]
    base.generate([prompts[0]], SamplingParams(max_tokens=8))  # warm-up
    plain = [base.generate([p], params)[0] for p in prompts]
    rows = [("plain", plain)]
    for method in (m for m in args.methods if m != "plain"):
        llm = None  # free the previous method's models before loading the next (memory)
        llm = LLM(
            args.model,
            dtype=args.dtype,
            quant=args.quant,
            progress=False,
            method=method,
            draft=args.draft_model if method == "draft-model" else None,
            num_draft=args.draft_tokens,
            speculation="on",
            lookup_tokens=0,
        )
        llm.generate([prompts[0]], SamplingParams(max_tokens=8))  # warm-up
        rows.append((method, [llm.generate([p], params)[0] for p in prompts]))

    base_speed = statistics.mean(o.stats.tokens_per_second for o in plain)
    setup = f"{args.model} ({args.dtype}, quant {args.quant}), {len(prompts)} prompts"
    print(f"{setup}, k = {args.draft_tokens}")
    print("| method | tok/s | speedup | mean accept length | accept rate by position | lossless |")
    print("|---|---|---|---|---|---|")
    for method, outs in rows:
        speed = statistics.mean(o.stats.tokens_per_second for o in outs)
        lossless = all(o.token_ids == p.token_ids for o, p in zip(outs, plain, strict=True))
        if method == "plain":
            print(f"| plain | {speed:.1f} | 1.00x | - | - | - |")
            continue
        mal = statistics.mean(o.stats.mean_accept_length for o in outs)
        by_pos = [
            statistics.mean(r)
            for r in zip(*(o.stats.accept_rate_by_position for o in outs), strict=False)
        ]
        rates = ", ".join(f"{r:.2f}" for r in by_pos)
        ratio = speed / base_speed
        print(f"| {method} | {speed:.1f} | {ratio:.2f}x | {mal:.2f} | {rates} | {lossless} |")
    for (cat, _), o in zip(questions, plain, strict=True):
        print(
            f"  {cat}: plain {o.stats.new_tokens} tokens at {o.stats.tokens_per_second:.1f} tok/s"
        )


if __name__ == "__main__":
    main()
