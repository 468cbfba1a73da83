"""Load benchmark of `eaglespec serve`: output tokens/s and latency at several numbers of
concurrent streaming clients, with speculation off, on (the configured chain every round) and
adaptive (policy.py), on the same loaded model and the same prompts.

Each client sends `--requests` chat requests one after another (streaming, greedy, ignore_eos so
every request produces exactly --max-tokens tokens); the server runs in this process on loopback.
Reported per mode and concurrency:
  tok/s      completion tokens of all requests / wall time from the first send to the last byte
  TTFT p50   send to the first content chunk
  TPOT       (latency - TTFT) / (tokens - 1), averaged over requests: time per output token
  ITL p50/p99  gaps between content chunks (a speculation round may deliver several tokens in
             one chunk, so chunk gaps are what a reader of the stream sees; TPOT is per token)

    python benchmarks/serve_load.py --clients 1,4,16 --requests 2 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from eaglespec.cliargs import int_list
from eaglespec.heads import packaged_head
from eaglespec.llm import LLM
from eaglespec.registry import resolve_model
from eaglespec.serve.app import ServeOptions, create_app

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short story about a robot learning to paint.",
    "List five tips for staying productive when working from home.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle in simple terms.",
    "Give me a recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines work?",
]


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def one_request(url: str, name: str, prompt: str, max_tokens: int) -> dict[str, object]:
    body = {
        "model": name, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    sent = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    done = time.perf_counter()
    return {"sent": sent, "arrivals": arrivals, "done": done, "tokens": tokens}


def run_level(url: str, name: str, clients: int, requests: int, max_tokens: int) -> dict:
    results: list[dict] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for k in range(requests):
            prompt = PROMPTS[(c * requests + k) % len(PROMPTS)]
            res = one_request(url, name, prompt, max_tokens)
            with lock:
                results.append(res)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(int(r["tokens"]) for r in results)
    ttft = [r["arrivals"][0] - r["sent"] for r in results if r["arrivals"]]
    tpot = [
        (r["done"] - r["arrivals"][0]) / (int(r["tokens"]) - 1)
        for r in results
        if r["arrivals"] and int(r["tokens"]) > 1
    ]
    gaps = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    return {
        "clients": clients,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "ttft_p50_s": _percentile(ttft, 0.5),
        "tpot_mean_s": statistics.fmean(tpot) if tpot else float("nan"),
        "itl_p50_s": _percentile(gaps, 0.5),
        "itl_p99_s": _percentile(gaps, 0.99),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", help="EAGLE-3 head folder (default: the one shipped for the model)")
    ap.add_argument("--dtype", default="auto", help="default: what `eaglespec serve` runs")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", default="none")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--modes", default="off,on,adaptive")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from server_fixtures import running_server  # tests/ helper: uvicorn in a thread

    draft = args.draft or str(packaged_head(args.model) or "")
    engine = ThreadPoolExecutor(max_workers=1)  # loads and decodes, as `eaglespec serve` does
    llm = engine.submit(
        LLM, str(resolve_model(args.model)), dtype=args.dtype, quant=args.quant,
        compile=args.compile, device=args.device, method="eagle3", draft=draft,
        num_draft=args.draft_tokens,
    ).result()  # fmt: skip
    levels = int_list(args.clients, "--clients")
    rows = []
    print(f"model {args.model}, draft {draft}, {args.device}, dtype {llm.loaded.precision.dtype}, "
          f"quant {llm.loaded.precision.quant}, "
          f"compile {args.compile}, threads {torch.get_num_threads()}, "
          f"{args.requests} requests/client x {args.max_tokens} tokens")  # fmt: skip
    print("| speculation | clients | tok/s | TTFT p50 ms | TPOT ms | ITL p50 ms | ITL p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        options = ServeOptions(served_name="m", max_seqs=max(levels), speculation=mode)
        app = create_app(llm, options, engine=engine)
        with running_server(app) as url:
            one_request(url, "m", "Hello!", 8)  # warm-up
            for clients in levels:
                row = {"speculation": mode, **run_level(url, "m", clients, args.requests,
                                                        args.max_tokens)}  # fmt: skip
                rows.append(row)
                print(
                    f"| {mode} | {clients} | {row['tok_per_s']:.1f} | "
                    f"{1e3 * row['ttft_p50_s']:.0f} | {1e3 * row['tpot_mean_s']:.1f} | "
                    f"{1e3 * row['itl_p50_s']:.1f} | {1e3 * row['itl_p99_s']:.1f} |",
                    flush=True,
                )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
