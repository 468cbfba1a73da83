"""Plain decoding on CPU: eaglespec's configurations against llama.cpp on the same GGUF file.

    python benchmarks/cpu_decode.py [--model smollm2-135m] [--tokens 128] [--repeats 3]
        [--configs float32:none:none bfloat16:int8:none bfloat16:int4:none bfloat16:int4:block]
        [--prefill 512] [--json OUT]

Configs are dtype:quant:compile. llama.cpp runs through the `llama-cpp-python` package (built from
its sdist with GGML_NATIVE=ON; not a dependency of eaglespec), with the same thread count.

Both engines get the same prompt token ids (the chat-templated PROMPT, tokenized by eaglespec) and
decode greedily for --tokens tokens, EOS ignored. Decode speed: tokens after the first over the
time after the first token. Prefill speed: --prefill prompt tokens (a synthetic prompt) over the
time to the first token. All configurations and llama.cpp are interleaved run by run, so a drift
in machine speed hits all alike; medians over --repeats after one warm-up run each (which also
compiles the compiled configurations).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from eaglespec import LLM, SamplingParams
from eaglespec.registry import resolve_model

PROMPT = "Write a short story about a robot who learns to paint."


def eaglespec_run(llm: LLM, ids: list[int], n: int) -> tuple[float, float]:
    """(decode tok/s, seconds to the first token)."""
    stamps: list[float] = []
    start = time.perf_counter()
    for _ in llm.stream(ids, SamplingParams(max_tokens=n, ignore_eos=True)):
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), stamps[0] - start


def llamacpp_run(llm, ids: list[int], n: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    stamps: list[float] = []
    llm.reset()
    start = time.perf_counter()
    for _ in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) == n:
            break
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), stamps[0] - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument(
        "--configs",
        nargs="+",
        default=[
            "float32:none:none",
            "bfloat16:none:none",
            "bfloat16:int8:none",
            "bfloat16:int4:none",
            "bfloat16:int4:block",
        ],
    )
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    threads = torch.get_num_threads()
    path = resolve_model(args.model, progress=False)
    engines: dict[str, object] = {}
    for c in args.configs:
        dtype, quant, comp = c.split(":")
        engines[c] = LLM(
            str(path), dtype=dtype, quant=quant, compile=comp, draft="none", progress=False
        )
    first = next(iter(engines.values()))
    assert isinstance(first, LLM)
    ids = first.encode(PROMPT)
    long_ids = (first.encode("the quick brown fox jumps over the lazy dog " * 60, chat=False))[
        : args.prefill
    ]
    if not args.no_llamacpp:
        from llama_cpp import Llama

        engines["llama.cpp"] = Llama(
            str(path), n_threads=threads, n_ctx=2048, n_batch=512, verbose=False
        )
    decode: dict[str, list[float]] = defaultdict(list)
    prefill: dict[str, list[float]] = defaultdict(list)
    for r in range(args.repeats + 1):
        for name, eng in engines.items():
            run = eaglespec_run if isinstance(eng, LLM) else llamacpp_run
            tps, _ = run(eng, ids, args.tokens)
            _, ttft = run(eng, long_ids, 2)
            if r:  # run 0 warms up (and compiles)
                decode[name].append(tps)
                prefill[name].append(len(long_ids) / ttft)
            print(
                f"run {r} {name}: decode {tps:.1f} tok/s, prefill {len(long_ids) / ttft:.0f} tok/s",
                flush=True,
            )
    ref = statistics.median(decode["llama.cpp"]) if "llama.cpp" in decode else None
    rows = {}
    head = f"prefill tok/s ({len(long_ids)} tokens)"
    print(f"\n| engine (dtype:quant:compile) | decode tok/s | {head} | decode vs llama.cpp |")
    print("|---|---|---|---|")
    for name in engines:
        d, p = statistics.median(decode[name]), statistics.median(prefill[name])
        ratio = f"{d / ref:.2f}x" if ref else "-"
        rows[name] = {"decode": d, "prefill": p, "decode_runs": decode[name]}
        spread = f"{min(decode[name]):.1f}-{max(decode[name]):.1f}"
        print(f"| {name} | {d:.1f} ({spread}) | {p:.0f} | {ratio} |")
    if args.json:
        env = {"torch": torch.__version__, "threads": threads, "model": str(path)}
        args.json.write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
