"""Where a decode step's time goes: torch profiler over plain greedy decoding, or over
speculative rounds with --draft (an EAGLE-3 head folder; --num-draft tokens per chain).

    python benchmarks/profile_step.py [--model smollm2-135m] [--dtype bfloat16]
        [--quant w4a8-all] [--compile full] [--tokens 24] [--rows 18]
        [--draft src/eaglespec/heads/smollm2-135m --num-draft 3]

Two warm-up generations (which also compile), then one profiled generation of --tokens tokens
after a 40-token prompt; prints the operators by self CPU time. The prompt's prefill is in the
profile too (one call per layer at 40 rows), so per-step costs are the totals over --tokens - 1
decode steps, approximately.
"""

from __future__ import annotations

import argparse

from torch.profiler import ProfilerActivity, profile

from eaglespec import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quant", default="w4a8-all")
    ap.add_argument("--compile", default="full")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rows", type=int, default=18, help="operators to print")
    ap.add_argument("--draft", default=None, help="EAGLE-3 head folder: profile speculation")
    ap.add_argument("--num-draft", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quant=args.quant,
        compile=args.compile,
        progress=False,
        draft=args.draft or "none",
        num_draft=args.num_draft,
        speculation="on",
        lookup_tokens=0,
    )
    ids = list(range(100, 140))  # a 40-token prompt
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    for _ in range(2):
        list(llm.stream(ids, params))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        list(llm.stream(ids, params))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
