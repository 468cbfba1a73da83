"""PNG plots of a benchmark: speedup and mean acceptance length per category (grouped bars, one
colour per method, plain decoding as a dashed line), and acceptance by draft position.

matplotlib's object API (`Figure`, rendered by Agg when saved to PNG) keeps the process's global
backend and pyplot state untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from eaglespec.bench.aggregate import BenchSummary, MethodStats
from eaglespec.bench.lineup import METHOD_NAMES, PLAIN, REFERENCE_ENGINES

# one per METHOD_NAMES entry, in its order (the +lookup methods a darker shade of their own)
_PALETTE = (
    "#7f7f7f",
    "#1f77b4",
    "#ff7f0e",
    "#0b3c5d",
    "#a64d00",
    "#d62728",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
)
_COLORS = dict(zip(METHOD_NAMES, _PALETTE, strict=True))


def _bar_figure(summary: BenchSummary, methods: Sequence[str]) -> tuple[Figure, Axes]:
    bars = (len(summary.groups) + 1) * max(len(methods), 1)
    fig = Figure(figsize=(min(16.0, max(6.0, 2.0 + 0.4 * bars)), 4.5))
    return fig, fig.subplots()


def _grouped_bars(
    ax: Axes,
    summary: BenchSummary,
    methods: Sequence[str],
    value: Callable[[MethodStats], float | None],
) -> None:
    """One group of bars per category, then "all" past a divider; one bar per method, values
    on the bars."""
    tables = [*summary.groups.items(), ("all", summary.overall)]
    width = 0.8 / max(len(methods), 1)
    tallest = 1.0
    for i, m in enumerate(methods):
        xs = [g + (i - (len(methods) - 1) / 2) * width for g in range(len(tables))]
        ys = [value(t[m]) or 0.0 for _, t in tables]
        bars = ax.bar(xs, ys, width, label=m, color=_COLORS.get(m))
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
        tallest = max(tallest, *ys)
    ax.axvline(len(tables) - 1.5, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(tables)), [name for name, _ in tables], rotation=20, ha="right")
    ax.get_xticklabels()[-1].set_fontweight("bold")
    ax.set_ylim(0, tallest * 1.15)
    ax.set_xlabel(summary.group_by)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _legend(ax: Axes) -> None:
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _bar_plot(
    path: Path,
    summary: BenchSummary,
    value: Callable[[MethodStats], float | None],
    *,
    methods: Sequence[str],
    baseline: str,
    ylabel: str,
    title: str,
) -> None:
    """Grouped bars of `value` for `methods`, plain decoding as a dashed line at 1."""
    fig, ax = _bar_figure(summary, methods)
    _grouped_bars(ax, summary, methods, value)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label=baseline)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    _legend(ax)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def plot_speedup(path: Path, summary: BenchSummary, subtitle: str) -> None:
    _bar_plot(
        path,
        summary,
        lambda s: s.speedup,
        methods=[m for m in summary.overall if m != PLAIN],  # a reference engine's bar too
        baseline="plain decoding (1.0x)",
        ylabel="speedup over plain decoding (x)",
        title=f"Speedup by {summary.group_by} (tokens/s over plain's)\n{subtitle}",
    )


def plot_accept_length(path: Path, summary: BenchSummary, subtitle: str) -> None:
    _bar_plot(
        path,
        summary,
        lambda s: s.mean_accept_length,
        methods=[m for m in summary.overall if m != PLAIN and m not in REFERENCE_ENGINES],
        baseline="plain decoding (1 token)",
        ylabel="mean acceptance length\n(tokens per target forward)",
        title=f"Mean acceptance length by {summary.group_by}\n{subtitle}",
    )


def plot_accept_rate(path: Path, summary: BenchSummary, subtitle: str) -> None:
    fig = Figure(figsize=(6.0, 4.5))
    ax = fig.subplots()
    for m, s in summary.overall.items():
        rates = s.accept_rate_by_position
        if m != PLAIN and rates:
            positions = range(1, len(rates) + 1)
            ax.plot(positions, rates, marker="o", label=m, color=_COLORS.get(m))
    ax.set_ylim(0, 1.05)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position (tree: depth)")
    ax.set_ylabel("share of rounds accepting the draft token")
    ax.set_title(f"Acceptance by draft position, all questions\n{subtitle}", fontsize=10)
    ax.grid(alpha=0.3)
    _legend(ax)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def write_plots(out: Path, summary: BenchSummary, subtitle: str) -> list[str]:
    """The PNG files written under `out` (names relative to it). Every plot compares methods with
    plain decoding, so none is drawn with plain alone; the acceptance plots need a drafting
    method (a reference engine such as llama.cpp has only a speedup)."""
    compared = [m for m in summary.overall if m != PLAIN]
    plots = {"speedup.png": plot_speedup} if compared else {}
    if any(m not in REFERENCE_ENGINES for m in compared):
        plots |= {"accept_length.png": plot_accept_length, "accept_rate.png": plot_accept_rate}
    for name, plot in plots.items():
        plot(out / name, summary, subtitle)
    return list(plots)
