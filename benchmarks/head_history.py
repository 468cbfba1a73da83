"""A shipped head's acceptance against the training tokens it has seen, stage by stage: the plot
in its model card (HEAD/acceptance.png).

    python benchmarks/head_history.py [--head src/eaglespec/heads/smollm2-135m]

Reads HEAD/stages.json (per stage: its train_report file, found in HEAD (the shipped stage's) or
in --reports (the earlier stages', which the repository keeps and the package does not ship),
and the acceptance measured by `eaglespec bench` for that stage, the commands in the model card;
optionally "title" and "series", [key, label] pairs naming the acceptance keys to plot, else
SmolLM2's six-set ones) and each stage's report for its training response tokens and epochs;
tokens seen = the sum over stages of response tokens x epochs. Writes HEAD/acceptance.png and
prints the table.
"""

from __future__ import annotations

import argparse
import json
from itertools import cycle
from pathlib import Path

from matplotlib.figure import Figure

REPO = Path(__file__).resolve().parents[1]
HEAD = REPO / "src" / "eaglespec" / "heads" / "smollm2-135m"
SIX_SETS = (  # the SmolLM2 head's series, plotted where stages.json names none
    ("fp32_chain4", "chain of 4, fp32"),
    ("fp32_tree", "tree 4,4,16, fp32"),
    ("default_chain2", "chain of 2, bf16 w4a8 (default)"),
    ("default_tree", "tree 4,4,16, bf16 w4a8 (default)"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--head", type=Path, default=HEAD)
    ap.add_argument(
        "--reports", type=Path, help="default: docs/head-reports/<the head's folder name>"
    )
    args = ap.parse_args()
    reports = args.reports or REPO / "docs" / "head-reports" / args.head.name
    meta = json.loads((args.head / "stages.json").read_text())
    stages = meta["stages"]
    seen, xs = 0, []
    print("| stage | response tokens | epochs | tokens seen | acceptance |")
    print("|---|---|---|---|---|")
    for s in stages:
        path = args.head / s["report"]
        report = json.loads((path if path.exists() else reports / s["report"]).read_text())
        tokens = report["data"]["train_response_tokens"]
        epochs = report["config"]["train"]["epochs"]
        seen += tokens * epochs
        xs.append(seen / 1e6)
        print(f"| {s['name']} | {tokens:,} | {epochs} | {seen:,} | {s['acceptance']} |")
    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    series = meta.get("series", SIX_SETS)
    styles = ("o-", "o-", "s--", "s--", "^:", "^:")
    for (key, label), style in zip(series, cycle(styles)):  # a stage unmeasured: no point
        pts = [(x, s["acceptance"].get(key)) for x, s in zip(xs, stages, strict=True)]
        pts = [(x, y) for x, y in pts if y is not None]
        ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=label)
    for x, s in zip(xs, stages, strict=True):
        y = next((s["acceptance"][k] for k, _ in series if s["acceptance"].get(k)), None)
        if y is not None:
            ax.annotate(s["name"], (x, y), fontsize=8, textcoords="offset points", xytext=(4, -12))
    ax.set_xlabel("training response tokens seen (millions, x epochs)")
    ax.set_ylabel(meta.get("ylabel", "tokens per target forward, six sets"))
    ax.set_title(meta.get("title", "SmolLM2-135M EAGLE-3 head: acceptance by stage"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.head / "acceptance.png", dpi=100)


if __name__ == "__main__":
    main()
