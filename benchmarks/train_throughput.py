"""Tokens per second of the training pipeline's data stages on a fixed sample: prompt writing
(self-asked, sampled), answering (greedy) and feature capture, as `eaglespec train` runs them.

    python benchmarks/train_throughput.py [--model smollm2-135m] [--answers 256] [--synth 128]
                                          [--dtype auto --quant auto] [--repeats 1]

Answers: the first --answers prompts of GSM8K's training questions and the Alpaca seed tasks
(half each, from ../shared/data/train), up to 256 new tokens; then the same answers again with
their features taken as they are answered (train/recorder.py), the pipeline's way since
2026-11-26, against answering + features above. Run it from an old checkout
(PYTHONPATH=OLD/src) with the same arguments to compare: it uses only the stage functions both
have. Prints one markdown row per stage and repeat.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from eaglespec.model.loader import load_model
from eaglespec.registry import resolve_model
from eaglespec.train.data import read_all
from eaglespec.train.features import capture_features

try:
    from eaglespec.train.features import FeatureSink
except ImportError:  # a checkout from before features were taken while answering
    FeatureSink = None  # type: ignore[assignment,misc]
from eaglespec.train.regen import RegenConfig, read_samples, regenerate
from eaglespec.train.synth import SynthConfig, synthesize_prompts

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "train"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--answers", type=int, default=256)
    ap.add_argument("--synth", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--data", type=Path, default=DATA, help="the training prompt files' folder")
    args = ap.parse_args()
    target = load_model(
        resolve_model(args.model, progress=False), dtype=args.dtype, quant=args.quant
    )
    half = args.answers // 2
    convs = read_all([str(args.data / "gsm8k_train.jsonl")])[:half]
    convs += read_all([str(args.data / "alpaca_seed_tasks.jsonl")])[: args.answers - half]
    precision = f"{target.precision.dtype} {target.precision.quant}"
    tokens = [0]

    def count(_: int, n: int) -> None:
        tokens[0] += n

    for rep in range(args.repeats):
        work = Path(tempfile.mkdtemp())
        tokens[0] = 0
        t = time.perf_counter()
        got = synthesize_prompts(
            target.model,
            target.tokenizer,
            work / "s.jsonl",
            SynthConfig(prompts=args.synth, seed=rep),
            on_batch=count,
        )
        _row(args.label, precision, "prompt writing", len(got), tokens[0], time.perf_counter() - t)
        t = time.perf_counter()
        summary = regenerate(target.model, target.tokenizer, convs, work / "r.jsonl", RegenConfig())
        _row(
            args.label,
            precision,
            "answering",
            summary.new,
            summary.response_tokens,
            time.perf_counter() - t,
        )
        samples = read_samples(work / "r.jsonl")
        L = target.config.num_layers
        t = time.perf_counter()
        capture_features(target.model, samples, (2, L // 2, L - 3), work / "features")
        positions = sum(len(s.prompt) + len(s.response) for s in samples)
        _row(args.label, precision, "features", len(samples), positions, time.perf_counter() - t)
        if FeatureSink is None:  # an old checkout: no features while answering
            continue
        t = time.perf_counter()
        sink = FeatureSink(work / "recorded", (2, L // 2, L - 3))
        summary = regenerate(
            target.model, target.tokenizer, convs, work / "r2.jsonl", RegenConfig(), features=sink
        )
        _row(
            args.label,
            precision,
            f"answering + features ({sink.samples} recorded)",
            summary.new,
            summary.response_tokens,
            time.perf_counter() - t,
        )


def _row(label: str, precision: str, stage: str, items: int, tokens: int, seconds: float) -> None:
    print(
        f"| {label} | {precision} | {stage} | {items} | {tokens} | {seconds:.1f} | "
        f"{tokens / seconds:.0f} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
