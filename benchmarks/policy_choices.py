"""Which shapes the adaptive policy picks, and what each landed: `eaglespec bench` run as given,
with every AdaptiveDraft round logged (its shape, wall time and tokens landed per row).

    python benchmarks/policy_choices.py --questions ../shared/data/eval/*.jsonl --limit 4 \\
        --max-tokens 128 --methods plain eagle3-chain+lookup eagle3-adaptive --num-draft 1 \\
        --group-by file --threads 2 --quiet --out /tmp/policy-bench [--log rounds.json]

Prints the bench's table, then per shape: rounds picked, median round milliseconds, mean tokens a
round and tokens per millisecond, and the sequence of picks (one character a round: 0-9 a chain of
that length, t the tree). Compare the adaptive row with the fixed shapes' in the same run.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence

from eaglespec import policy
from eaglespec.cli import main as eaglespec_main


def main(argv: Sequence[str]) -> None:
    log_path = None
    if "--log" in argv:
        i = list(argv).index("--log")
        log_path, argv = argv[i + 1], [*argv[:i], *argv[i + 2 :]]
    rounds: list[tuple[str, float, float]] = []  # (shape, seconds, tokens a row)
    observe = policy.AdaptiveDraft.observe

    def logged(
        self: policy.AdaptiveDraft,
        batch: int,
        choice: policy.DraftChoice,
        seconds: float,
        accepted: Sequence[int],
    ) -> None:
        rounds.append((choice.name, seconds, 1 + sum(accepted) / max(1, len(accepted))))
        observe(self, batch, choice, seconds, accepted)

    policy.AdaptiveDraft.observe = logged  # type: ignore[method-assign]
    try:
        eaglespec_main(["bench", *argv])
    except SystemExit as e:
        if e.code:
            raise
    by_shape: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for name, seconds, tokens in rounds:
        by_shape[name].append((seconds, tokens))
    print(f"\nadaptive rounds: {len(rounds)}")
    print("| shape | rounds | median ms | tokens a round | tokens / ms |")
    print("|---|---|---|---|---|")
    for name, v in sorted(by_shape.items()):
        ms = statistics.median(s for s, _ in v) * 1e3
        tokens = sum(t for _, t in v)
        print(
            f"| {name} | {len(v)} | {ms:.2f} | {tokens / len(v):.2f} | "
            f"{tokens / sum(s for s, _ in v) / 1e3:.3f} |"
        )
    picks = "".join("t" if n.startswith("tree") else n.removeprefix("chain") for n, _, _ in rounds)
    print("\npicks, one a round:")
    for i in range(0, len(picks), 100):
        print(picks[i : i + 100])
    if log_path:
        with open(log_path, "w") as f:
            json.dump(rounds, f)


if __name__ == "__main__":
    main(sys.argv[1:])
