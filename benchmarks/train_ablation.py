"""Training choices on equal data: each variant continues the same head on the same captured
features for the same steps, in the same batch order, and is scored on the same held-out split
(training-time-test top-1 agreement per draft step and the greedy acceptance proxy).

    python benchmarks/train_ablation.py RUN_DIR --init-from HEAD [--samples 1500]
        [--variants loss=ce loss=lk ttt_steps=7] [--lr 4e-4] [--batch-tokens 2048] [--ttt-steps 4]
        [--model smollm2-135m] [--draft-vocab 8192] [--heldout 0.02]

RUN_DIR is an `eaglespec train` output folder whose work/ holds responses.jsonl and features/
(a run stopped with --stop-after features is enough). A variant is NAME=VALUE over TrainConfig's
fields (loss, ttt_steps, lr, decay, ...). --samples takes a seeded subset of the training
responses, so one epoch is about samples * mean length / batch-tokens steps. Variants run one
after the other in this process; prints one markdown row each. The heads are shaped as the
--init-from head is (its MLP width; its output rows trained, or the target's frozen ones), and
--heldout must be the run's own fraction for its held-out split to come back.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from eaglespec.draft.config import DraftConfig, resolve_capture_layers
from eaglespec.draft.eagle3 import Eagle3Head
from eaglespec.draft.loader import load_eagle3
from eaglespec.model.loader import load_model
from eaglespec.model.quant import dense_rows
from eaglespec.registry import resolve_model
from eaglespec.train.features import load_shard, shard_paths
from eaglespec.train.pipeline import build_head, init_head, split_heldout
from eaglespec.train.regen import read_samples
from eaglespec.train.trainer import TrainConfig, evaluate, train
from eaglespec.train.vocab import build_draft_vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--init-from", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=1500)
    ap.add_argument("--variants", nargs="+", default=["loss=ce", "loss=lk"])
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--heldout", type=float, default=0.02)
    args = ap.parse_args()
    target = load_model(resolve_model(args.model, progress=False), dtype="auto", quant="auto")
    tcfg = target.config
    capture = resolve_capture_layers(DraftConfig.like_target(tcfg), tcfg.num_layers, None)
    work = args.run / "work"
    train_s, held_s = split_heldout(read_samples(work / "responses.jsonl"), args.heldout)
    random.Random(0).shuffle(train_s)
    train_s = train_s[: args.samples]
    vocab = build_draft_vocab([s.response for s in train_s], args.draft_vocab, tcfg.vocab_size)
    shards = [load_shard(p) for p in shard_paths(work / "features")]
    by_key = {k: s.sample(i) for s in shards for i, k in enumerate(s.keys)}
    train_f = [by_key[s.key] for s in train_s if s.key in by_key]
    held_f = [by_key[s.key] for s in held_s if s.key in by_key]
    weight = dense_rows(target.model.lm_head, vocab.ids)  # (Vd, Ct)
    init = load_eagle3(args.init_from, target.model)
    base = TrainConfig(
        epochs=1,
        lr=args.lr,
        warmup_steps=20,
        batch_tokens=args.batch_tokens,
        ttt_steps=args.ttt_steps,
    )
    names = {f.name for f in fields(TrainConfig)}
    print(f"{len(train_f)} training responses, {len(held_f)} held out")
    print("| variant | steps | s | held-out top-1 by step | held-out proxy |")
    print("|---|---|---|---|---|")
    width = init.head.cfg.intermediate_size  # every head shaped as the one continued
    rows = "target" if init.head.lm_head_is_target_rows else "trained"

    def new_head() -> Eagle3Head:
        head = build_head(
            target, weight, vocab, len(capture), "cpu", intermediate_size=width, lm_head=rows
        )
        init_head(head, init, capture)
        return head

    start_head = new_head()
    ref = evaluate(start_head, held_f, vocab, weight, base)
    print(f"| start | 0 | 0 | {ref['acc']} | {ref['accept_proxy']:.3f} |", flush=True)
    for variant in args.variants:
        key, _, value = variant.partition("=")
        if key not in names:
            raise SystemExit(f"unknown TrainConfig field {key!r}")
        kind = type(getattr(base, key))
        cfg = replace(base, **{key: kind(value)})
        head = new_head()
        t = time.perf_counter()
        history = train(head, train_f, vocab, weight, cfg)
        seconds = time.perf_counter() - t
        with torch.no_grad():
            m = evaluate(head, held_f, vocab, weight, replace(base, ttt_steps=args.ttt_steps))
        print(
            f"| {variant} | {len(history)} | {seconds:.0f} | {m['acc']} | "
            f"{m['accept_proxy']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
