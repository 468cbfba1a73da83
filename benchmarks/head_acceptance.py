"""An EAGLE-3 head's acceptance per evaluation set: plain greedy decoding, a greedy chain and an
EAGLE-2 tree on the same engine, prompts and outputs.

    python benchmarks/head_acceptance.py --draft src/eaglespec/heads/smollm2-135m \\
        --questions ../shared/data/eval/*.jsonl [--model smollm2-135m] [--limit 5]
        [--max-tokens 128] [--draft-tokens 2 4] [--tree 4,4,16] [--out results.json]

First turns of FastChat questions with the model's chat template, fp32 target. For each set:
mean acceptance length (tokens per target forward, the bonus included; summed over prompts, then
divided), acceptance rate per draft position, decode tokens/s and speedup over plain decoding, and
whether every output equals plain greedy decoding's (`lossless`). A warm-up runs before timing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from eaglespec import LLM, SamplingParams, TreeConfig
from eaglespec.requests import RequestOutput


def questions(path: str, limit: int) -> list[str]:
    lines = Path(path).read_text().splitlines()[:limit]
    return [json.loads(line)["turns"][0] for line in lines]


def summarize(
    outs: list[RequestOutput], plain: list[RequestOutput], seconds: float
) -> dict[str, Any]:
    rounds = sum(o.stats.rounds for o in outs)
    accepted = sum(o.stats.accepted_tokens for o in outs)
    tokens = sum(o.stats.new_tokens for o in outs)
    by_pos: list[list[int]] = []
    for o in outs:
        for j, (a, p) in enumerate(
            zip(o.stats.accepted_by_position, o.stats.proposed_by_position, strict=True)
        ):
            if j == len(by_pos):
                by_pos.append([0, 0])
            by_pos[j][0] += a
            by_pos[j][1] += p
    return {
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_second": round(tokens / seconds, 2),
        "mean_accept_length": round((accepted + rounds) / rounds, 3) if rounds else 1.0,
        "accept_rate_by_position": [round(a / p, 3) for a, p in by_pos if p],
        "lossless": all(o.token_ids == q.token_ids for o, q in zip(outs, plain, strict=True)),
    }


def run(
    llm: LLM, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[RequestOutput], float]:
    outs, start = [], time.perf_counter()
    for p in prompts:  # one at a time: batch-1 latency, as a chat user sees it
        outs.append(llm.generate([p], params)[0])
    return outs, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--questions", nargs="+", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", required=True, help="EAGLE-3 head folder")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[4], help="chain lengths")
    ap.add_argument("--tree", default="4,4,16", help="DEPTH,TOPK,NODES; '' to skip")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quant", default="none", help="none, int8 or int4 (target and head)")
    ap.add_argument("--compile", default="none", help="none, block or full")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    engine = {"dtype": args.dtype, "quant": args.quant, "compile": args.compile}
    fixed = {"speculation": "on", "lookup_tokens": 0}  # the head alone, every round

    params = SamplingParams(max_tokens=args.max_tokens)
    plain_llm = LLM(args.model, progress=False, draft="none", **engine)
    methods: dict[str, LLM] = {
        f"chain-{k}": LLM(
            args.model, draft=args.draft, num_draft=k, progress=False, **engine, **fixed
        )
        for k in args.draft_tokens
    }
    if args.tree:
        d, k, n = (int(x) for x in args.tree.split(","))
        methods[f"tree-{args.tree}"] = LLM(
            args.model,
            draft=args.draft,
            tree=TreeConfig(depth=d, top_k=k, num_nodes=n),
            progress=False,
            **engine,
            **fixed,
        )
    warm = plain_llm.encode("Hello")
    for llm in (plain_llm, *methods.values()):
        llm.generate([warm], SamplingParams(max_tokens=24))  # compiles every step shape
    results: dict[str, Any] = {"config": vars(args) | {"out": str(args.out)}, "sets": {}}
    for path in args.questions:
        name = Path(path).stem.replace("_question", "")
        prompts = [plain_llm.encode(q) for q in questions(path, args.limit)]
        plain, t_plain = run(plain_llm, prompts, params)
        row: dict[str, Any] = {"plain": summarize(plain, plain, t_plain)}
        for label, llm in methods.items():
            outs, t = run(llm, prompts, params)
            row[label] = summarize(outs, plain, t)
            row[label]["speedup"] = round(t_plain / t, 3)
        results["sets"][name] = row
        print(
            name,
            json.dumps(
                {
                    k: {m: v.get(m) for m in ("mean_accept_length", "speedup", "lossless")}
                    for k, v in row.items()
                }
            ),
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
