"""Plain decoding and one speculative shape on one prompt at the commands' default precision, for
comparing two checkouts: run it alternately under each (`PYTHONPATH=<worktree>/src python
benchmarks/decode_ab.py LABEL`), several times, and compare the medians of runs next to each other.

    python benchmarks/decode_ab.py LABEL [--tokens 128] [--repeats 4] [--chain 1] [--lookup 4]

Decode tokens per second (after the first token) of `--repeats` generations of each, medians; the
speculative shape is a fixed chain of `--chain` drafts of the shipped head with `--lookup`
prompt-lookup tokens grafted in (0: none).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from eaglespec import LLM, SamplingParams
from eaglespec.heads import packaged_head
from eaglespec.policy import DraftChoice, FixedDraft

PROMPT = "Write a short story about a robot who learns to paint."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("label")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--chain", type=int, default=1)
    ap.add_argument("--lookup", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(2)
    head = packaged_head(args.model)
    # (a checkout from before prompt lookup was grafted in takes no lookup_tokens: --lookup 0)
    extra = {"lookup_tokens": args.lookup} if args.lookup else {}
    # speculation off: generate() alone decodes plainly, with policy=spec it drafts the chain
    extra |= {"speculation": "off"}
    llm = LLM(args.model, dtype="auto", quant="auto", progress=False, draft=str(head), **extra)
    ids = llm.encode(PROMPT)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    spec = FixedDraft(DraftChoice(args.chain))
    plain: list[float] = []
    drafted: list[float] = []
    for _ in range(args.repeats):
        plain.append(llm.generate([ids], params)[0].stats.tokens_per_second)
        drafted.append(llm.generate([ids], params, policy=spec)[0].stats.tokens_per_second)
    name = f"chain {args.chain}" + (f" + lookup {args.lookup}" if args.lookup else "")
    print(
        f"{args.label}: plain {statistics.median(plain):.1f} tok/s, "
        f"{name} {statistics.median(drafted):.1f} tok/s"
    )


if __name__ == "__main__":
    main()
