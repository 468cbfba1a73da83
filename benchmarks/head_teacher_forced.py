"""Heads compared on the evaluation sets' own greedy answers, teacher-forced: the training-time-test
metrics the trainer reports on its held-out split (top-1 agreement with the target by draft step,
and the greedy acceptance proxy), but on the answers users' kinds of requests get.

    python benchmarks/head_teacher_forced.py --questions ../shared/data/eval/*.jsonl \\
        --heads src/eaglespec/heads/smollm2-135m HEAD2 [--model smollm2-135m] [--limit 4] \\
        [--max-tokens 128] [--ttt-steps 4] [--out DIR]

The target (at the commands' default precision) answers the first turn of the first `--limit`
questions of each file greedily, as `eaglespec train` regenerates its data (regen.py), keeping
its states as it answers (recorder.py), and every head is scored on the same positions
(trainer.evaluate). No timing: the numbers do not depend on the machine's load, so heads can be
compared while other work runs (the six-set bench, `eaglespec bench`, times its methods and needs
quiet cores). A head's held-out top-1 (its model card) against these numbers says how far its
training data is from these sets.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from eaglespec.draft.loader import load_eagle3
from eaglespec.model.loader import load_model
from eaglespec.model.quant import dense_rows
from eaglespec.registry import resolve_model
from eaglespec.train.data import Conversation, read_conversations
from eaglespec.train.features import FeatureSink, capture_features, load_shard, shard_paths
from eaglespec.train.regen import RegenConfig, read_samples, regenerate
from eaglespec.train.trainer import TrainConfig, evaluate
from eaglespec.train.vocab import DraftVocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--questions", nargs="+", required=True)
    ap.add_argument("--heads", nargs="+", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--out", default=None, help="folder for answers and features (default: temp)")
    args = ap.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="head-tf-"))
    work.mkdir(parents=True, exist_ok=True)
    target = load_model(resolve_model(args.model), dtype="auto", quant="auto")
    heads = [load_eagle3(h, target.model) for h in args.heads]
    captures = {h.capture for h in heads}
    assert len(captures) == 1, f"the heads capture different layers: {captures}"
    capture = heads[0].capture
    cfg = TrainConfig(ttt_steps=args.ttt_steps)
    vocabs = []  # per head: its draft vocabulary and the target's output rows of it
    for loaded in heads:
        head = loaded.head
        ids = head.to_target(torch.arange(head.cfg.draft_vocab_size))  # (Vd,) ascending
        vocab = DraftVocab(ids, target.model.cfg.vocab_size)
        vocabs.append((vocab, dense_rows(target.model.lm_head, vocab.ids)))  # rows (Vd, Ct)
    results: dict[str, dict[str, Any]] = {h: {} for h in args.heads}
    for path in sorted(args.questions):
        name = Path(path).stem.removesuffix("_question")
        convs = [Conversation(c.turns[:1], c.source) for c in read_conversations(path)]
        answers = work / f"{name}.jsonl"
        regen = RegenConfig(max_new_tokens=args.max_tokens)
        folder = work / f"features-{name}"
        sink = FeatureSink(folder, capture)  # the states come with the answers (recorder.py)
        regenerate(
            target.model, target.tokenizer, convs[: args.limit], answers, regen, features=sink
        )
        capture_features(target.model, read_samples(answers), capture, folder)  # any left over
        feats = [s.sample(i) for s in map(load_shard, shard_paths(folder)) for i in range(len(s))]
        for name_h, loaded, (vocab, rows) in zip(args.heads, heads, vocabs, strict=True):
            results[name_h][name] = evaluate(loaded.head, feats, vocab, rows, cfg)
    sets = sorted({s for r in results.values() for s in r})
    print("| head | " + " | ".join(sets) + " | mean |")
    print("|---|" + "---|" * (len(sets) + 1))
    for h, per in results.items():
        first = [per[s]["acc"][0] for s in sets]
        cells = [f"{per[s]['acc'][0]:.3f} / {per[s]['accept_proxy']:.2f}" for s in sets]
        mean_proxy = sum(per[s]["accept_proxy"] for s in sets) / len(sets)
        mean = f"{sum(first) / len(first):.3f} / {mean_proxy:.2f}"
        print(f"| {h} | " + " | ".join(cells) + f" | {mean} |")
    print("cells: step-1 top-1 agreement / acceptance proxy (1 + mean all-correct chain length)")
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {work / 'results.json'}")


if __name__ == "__main__":
    main()
