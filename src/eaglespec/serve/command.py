"""`eaglespec serve`: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eaglespec.calibration import CalibrationStore
from eaglespec.cliargs import add_model_args, add_speculation_args, load_llm, precision_line
from eaglespec.errors import InvalidRequestError


def add_serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API (continuous batching)",
        description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, and a chat page at / that marks every drafted token. "
        "Without --method/--draft it drafts with the EAGLE-3 head shipped for the model, if one "
        "ships, under adaptive speculation.",
    )
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-name", help="model id clients use (default: the --model value)")
    p.add_argument("--max-seqs", type=int, default=16, help="sequences decoding together")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429s")
    p.add_argument(
        "--max-model-len",
        type=int,
        help="prompt + output tokens per request (default: the model's context)",
    )
    p.add_argument("--shutdown-grace", type=float, default=10.0, help="seconds to finish work")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="prefill new prompts this many tokens at a time, running streams decoding in "
        "between, so a long prompt does not stall them (0: each prompt in one forward)",
    )
    add_speculation_args(p, default_method="eagle3 with the head shipped for the model, else none")


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from eaglespec.serve.app import ServeOptions, create_app

    for flag in ("max_seqs", "max_queue", "max_model_len", "port", "prefill_chunk"):
        value = getattr(args, flag)
        if value is not None and value < (0 if flag in ("port", "prefill_chunk") else 1):
            raise InvalidRequestError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    # One thread loads the model, warms it up and decodes with it (serve/scheduler.py says why a
    # second thread's OpenMP team halves a CPU stream's speed); the main thread serves HTTP.
    engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eaglespec-engine")
    llm = engine.submit(load_llm, args, progress=True).result()
    print(precision_line(llm), file=sys.stderr)
    if llm.draft_report:
        print(f"[{llm.method}: {llm.draft_report}]", file=sys.stderr)
    path = Path(args.model)
    name = args.served_name or (path.name if path.exists() else args.model)
    options = ServeOptions(
        served_name=name,
        max_seqs=args.max_seqs,
        max_queue=args.max_queue,
        max_model_len=args.max_model_len,
        shutdown_grace=args.shutdown_grace,
        prefill_chunk=args.prefill_chunk or None,
    )
    calibration = CalibrationStore.open(llm, lambda line: print(line, file=sys.stderr))
    if llm.compile != "none":  # compile before serving: one batch of one and one of two
        print("[compiling the decode steps: warm-up generations]", file=sys.stderr)
        engine.submit(llm.warm_up, "Hello", batch_sizes=(1, 2)).result()
    # What serving taught the policy, per batch size, is kept for the next start, at shutdown
    # (Ctrl-C or SIGTERM alike: create_app's on_stop).
    app = create_app(llm, options, on_stop=calibration.save, engine=engine)
    url = f"http://{args.host}:{args.port}"
    print(f"[chat page: {url}/  OpenAI API: {url}/v1]", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
