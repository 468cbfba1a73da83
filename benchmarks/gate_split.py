"""What the head's gate saves and loses, round by round: the fixed chain of one with 4 lookup
tokens, gated at 0.3 (the commands' bound) and ungated, over the same questions in one process
(benchmarks/ab_common.py), SmolLM2's shipped head at the default precision.

    python benchmarks/gate_split.py ../shared/data/eval/*.jsonl

Each round is classed by the head's probability of its first draft (below the bound or not) and
whether prompt lookup grafted a continuation; per class: rounds, median round milliseconds,
tokens a round (the target's own token included) and drafts made. The gated run's doubtful
rounds draft nothing; set beside the ungated run's, they give what drafting a doubtful first
token costs and lands on this machine (BENCHMARKS.md, session 47). Rounds right after
zero-draft rounds (whose head catch-ups are pending) are left out: their first-draft
probability is not known before the round."""

from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict
from typing import Any

import torch
from ab_common import run_ab

from eaglespec import engine
from eaglespec.bench.lineup import PLAIN, BenchMethod, shipped_head
from eaglespec.draft import hybrid
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.methods import with_lookup

BOUND = 0.3


def main(files: list[str]) -> None:
    torch.set_num_threads(2)
    target, base = shipped_head("smollm2-135m")
    rounds: dict[tuple[float, str, str], list[tuple[float, int, int]]] = defaultdict(list)
    now: dict[str, Any] = {}  # the round in progress: first-draft probability, graft, drafts
    graft, run_round = hybrid.HybridProposer.graft, engine.BatchRunner.round

    def logged_graft(self: Any, state: Any, tree: Any, room: int) -> Any:
        head = state.head
        # the head's first draft comes from its last catch-up's logits (unknown while pending)
        p1 = math.nan if head.pending else float(torch.softmax(head.logits.float(), -1).amax())
        out = graft(self, state, tree, room)
        now.update(p1=p1, grafted=out.num_nodes > tree.num_nodes, drafted=tree.num_nodes - 1)
        now["bound"] = self.head.min_prob
        return out

    def logged_round(self: Any, *args: Any, **kwargs: Any) -> Any:
        now.clear()
        report = run_round(self, *args, **kwargs)
        if now and not math.isnan(now["p1"]):
            doubt = f"p1 < {BOUND}" if now["p1"] < BOUND else f"p1 >= {BOUND}"
            key = (now["bound"], doubt, "lookup" if now["grafted"] else "no lookup")
            rounds[key].append((report.seconds, 1 + report.output.accepted[0], now["drafted"]))
        return report

    hybrid.HybridProposer.graft = logged_graft  # type: ignore[method-assign]
    engine.BatchRunner.round = logged_round  # type: ignore[method-assign]
    gated = with_lookup(Eagle3Proposer(base.head, base.capture, BOUND), "", 4).proposer
    ungated = with_lookup(base, "", 4).proposer
    methods = [
        BenchMethod(PLAIN, None, 0, None, "plain decoding"),
        BenchMethod(f"gated at {BOUND}", gated, 1, None, "gated"),
        BenchMethod("ungated", ungated, 1, None, "ungated"),
    ]
    run_ab(target, methods, files, 4, 128)
    print("| bound | first draft | lookup | rounds | median ms | tokens a round | drafts a round |")
    print("|---|---|---|---|---|---|---|")
    for key in sorted(rounds):
        v = rounds[key]
        ms = 1e3 * statistics.median(s for s, _, _ in v)
        tokens = sum(t for _, t, _ in v) / len(v)
        drafts = sum(d for _, _, d in v) / len(v)
        bound, doubt, lookup = key
        print(
            f"| {bound} | {doubt} | {lookup} | {len(v)} | {ms:.2f} | {tokens:.2f} | {drafts:.2f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
