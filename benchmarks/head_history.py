"""The shipped head's acceptance against the training tokens it has seen, stage by stage: the plot
in its model card (src/eaglespec/heads/smollm2-135m/acceptance.png).

    python benchmarks/head_history.py [--head src/eaglespec/heads/smollm2-135m]

Reads HEAD/stages.json (per stage: its train_report file, and the six-set acceptance measured by
`eaglespec bench` for that stage, the commands in the model card) and each stage's report for
its training response tokens and epochs; tokens seen = the sum over stages of response tokens x
epochs. Writes HEAD/acceptance.png and prints the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from matplotlib.figure import Figure

HEAD = Path(__file__).resolve().parents[1] / "src" / "eaglespec" / "heads" / "smollm2-135m"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--head", type=Path, default=HEAD)
    args = ap.parse_args()
    stages = json.loads((args.head / "stages.json").read_text())["stages"]
    seen, xs = 0, []
    print("| stage | response tokens | epochs | tokens seen | six-set acceptance |")
    print("|---|---|---|---|---|")
    for s in stages:
        report = json.loads((args.head / s["report"]).read_text())
        tokens = report["data"]["train_response_tokens"]
        epochs = report["config"]["train"]["epochs"]
        seen += tokens * epochs
        xs.append(seen / 1e6)
        print(f"| {s['name']} | {tokens:,} | {epochs} | {seen:,} | {s['acceptance']} |")
    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    series = (
        ("fp32_chain4", "chain of 4, fp32", "o-"),
        ("fp32_tree", "tree 4,4,16, fp32", "o-"),
        ("default_chain2", "chain of 2, bf16 w4a8 (default)", "s--"),
        ("default_tree", "tree 4,4,16, bf16 w4a8 (default)", "s--"),
    )
    for key, label, style in series:  # a stage not measured that way has no point
        pts = [(x, s["acceptance"].get(key)) for x, s in zip(xs, stages, strict=True)]
        pts = [(x, y) for x, y in pts if y is not None]
        ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=label)
    for x, s in zip(xs, stages, strict=True):
        y = s["acceptance"].get("fp32_chain4") or s["acceptance"].get("default_chain2")
        if y is not None:
            ax.annotate(s["name"], (x, y), fontsize=8, textcoords="offset points", xytext=(4, -12))
    ax.set_xlabel("training response tokens seen (millions, x epochs)")
    ax.set_ylabel("tokens per target forward, six sets")
    ax.set_title("SmolLM2-135M EAGLE-3 head: acceptance by stage")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.head / "acceptance.png", dpi=100)


if __name__ == "__main__":
    main()
