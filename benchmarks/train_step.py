"""One TTT training step of a head (forward and backward over its unrolled steps) under each
autocast dtype, on random features: what `--train-dtype` costs on the machine at hand.

    python benchmarks/train_step.py [--model smollm2-135m] [--head src/eaglespec/heads/smollm2-135m]
                                    [--dtypes float32 bfloat16] [--rows 8] [--tokens 256]
                                    [--ttt-steps 4] [--repeats 3] [--threads 2]

Prints one markdown row per dtype (interleaved rounds, median step): seconds a step and positions
x unrolled steps a second, the unit `eaglespec train` reports. `auto` in --dtypes shows what
`--train-dtype auto` picks here (train/trainer.py: bf16 only where the device has bf16 matmuls).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from eaglespec.draft.loader import load_eagle3
from eaglespec.model.loader import load_model
from eaglespec.registry import resolve_model
from eaglespec.train.trainer import TrainConfig, autocast_dtype
from eaglespec.train.ttt import TTTBatch, ttt_forward

HEAD = Path(__file__).resolve().parents[1] / "src" / "eaglespec" / "heads" / "smollm2-135m"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", type=Path, default=HEAD)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    target = load_model(resolve_model(args.model))  # fp32: only its embedding is used
    head = load_eagle3(args.head, target.model, dtype="float32").head  # fp32 master weights
    for name, p in head.named_parameters():
        p.requires_grad_("embed" not in name)  # the shared embedding stays frozen, as trained
    head.train()
    B, T, Ct = args.rows, args.tokens, head.cfg.target_hidden_size
    Vd = head.cfg.draft_vocab_size
    g = torch.Generator().manual_seed(0)
    batch = TTTBatch(
        ids=torch.randint(0, target.model.cfg.vocab_size, (B, T), generator=g),
        aux=torch.randn(B, T, 3 * Ct, generator=g),  # (B, T, 3 Ct) captured states
        target_logp=torch.log_softmax(torch.randn(B, T, Vd, generator=g), -1),  # (B, T, Vd)
        target_valid=torch.ones(B, T, dtype=torch.bool),
        loss_mask=torch.ones(B, T, dtype=torch.bool),
    )
    times: dict[str, list[float]] = {d: [] for d in args.dtypes}
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for d in args.dtypes:
            cfg = TrainConfig(dtype=d, ttt_steps=args.ttt_steps)
            t = time.perf_counter()
            with cfg.autocast(cpu):
                out = ttt_forward(head, batch, args.ttt_steps, loss=cfg.loss)
            sum(out.loss_sums).backward()
            times[d].append(time.perf_counter() - t)
            head.zero_grad(set_to_none=True)
    print(f"{B} x {T} positions, {args.ttt_steps} unrolled steps, {args.threads} threads")
    print("| --train-dtype | runs as | s a step (median) | positions x steps a second |")
    print("|---|---|---|---|")
    for d, ts in times.items():
        s = statistics.median(ts[1:])
        print(f"| {d} | {autocast_dtype(d, cpu)} | {s:.2f} | {B * T * args.ttt_steps / s:,.0f} |")


if __name__ == "__main__":
    main()
