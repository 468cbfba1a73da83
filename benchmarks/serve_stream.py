"""One stream through `eaglespec serve` against the same prompts through `LLM.stream`, and why
they differed: decoding on another thread than the one that loaded the model.

    python benchmarks/serve_stream.py [--model smollm2-135m] [--threads 2] [--rounds 2]

Two measurements, each a median over the prompts (128 greedy tokens, EOS ignored, the commands'
defaults otherwise, a first pass to warm up), rounds alternating:
  threads  LLM.stream in a fresh process: loaded and run on the main thread; loaded on the main
           thread and run on a new one (what serve did before session 35); loaded and run on one
           executor thread (what serve does). A second thread's OpenMP team makes libgomp stop
           spinning between parallel regions once it counts more threads than cores.
  serve    `eaglespec serve` as its own process with one streaming client here: tokens/s from
           the first content chunk to the last, against the first LLM.stream's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from serve_load import one_request  # benchmarks/: the same streamed request and its timings

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short story about a robot learning to paint.",
    "List five tips for staying productive when working from home.",
    "What is the difference between a list and a tuple in Python?",
]
PORT = 8765
WHERE = {"main": "loaded and run on main", "other": "run on a new thread", "executor": "serve's"}


def stream_rate(llm, prompt: str) -> float:  # type: ignore[no-untyped-def]
    import torch

    from eaglespec.config import SamplingParams

    with torch.inference_mode():
        first, n = None, 0
        for ev in llm.stream(prompt, SamplingParams(max_tokens=128, ignore_eos=True)):
            if ev.token_ids and first is None:
                first = time.perf_counter()
            n += len(ev.token_ids)
        return (n - 1) / (time.perf_counter() - first)


def serve_rates(model: str, n_threads: int) -> list[float]:
    cmd = ["eaglespec", "serve", "--model", model, "--port", str(PORT), "--threads", str(n_threads)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{PORT}"
    try:
        for _ in range(1200):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        rates = []
        for i, p in enumerate(PROMPTS * 2):  # the first pass warms up
            r = one_request(url, model, p, 128)  # serve_load's streamed chat request
            if i >= len(PROMPTS):
                rates.append((int(r["tokens"]) - 1) / (r["done"] - r["arrivals"][0]))
        return rates
    finally:
        server.terminate()
        server.wait()


def child(model: str, n_threads: int, where: str) -> None:
    """In a fresh process: load on the main thread and stream there (`main`) or on a new thread
    (`other`), or load and stream on one executor thread (`executor`, what serve does)."""
    import torch

    from eaglespec.llm import LLM

    torch.set_num_threads(n_threads)
    if where == "executor":
        engine = ThreadPoolExecutor(max_workers=1)
        llm = engine.submit(LLM, model, progress=False).result()
        run = lambda p: engine.submit(stream_rate, llm, p).result()  # noqa: E731
    else:
        llm = LLM(model, progress=False)
        run = lambda p: stream_rate(llm, p)  # noqa: E731
    if where == "other":
        rates: list[float] = []
        t = threading.Thread(target=lambda: rates.extend(run(p) for p in PROMPTS * 2))
        t.start(), t.join()
    else:
        rates = [run(p) for p in PROMPTS * 2]
    print(json.dumps(rates[len(PROMPTS) :]))  # the first pass warms up


def stream_rates(model: str, n_threads: int, where: str) -> list[float]:
    cmd = [
        sys.executable,
        __file__,
        "--model",
        model,
        "--threads",
        str(n_threads),
        "--child",
        where,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", choices=("main", "other", "executor"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.model, args.threads, args.child)
    for _ in range(args.rounds):
        rates = {w: statistics.median(stream_rates(args.model, args.threads, w)) for w in WHERE}
        line = ", ".join(f"{WHERE[w]} {r:.1f}" for w, r in rates.items())
        print(f"threads  tok/s: {line}; new thread / main {rates['other'] / rates['main']:.2f}x")
        s = statistics.median(serve_rates(args.model, args.threads))
        print(
            f"serve    one stream {s:6.1f} tok/s, LLM.stream {rates['main']:6.1f}: "
            f"{s / rates['main']:.2f}x"
        )


if __name__ == "__main__":
    main()
