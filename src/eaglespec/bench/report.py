"""report.md: the benchmark as tables a person reads, with the command that produced it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eaglespec.bench.aggregate import BenchSummary, LosslessCheck, MethodStats
from eaglespec.bench.lineup import PLAIN, REFERENCE_ENGINES


def fmt_lossless(check: LosslessCheck, method: str) -> str:
    if method == PLAIN:
        return "baseline"
    if check.reference:
        return fmt_reference_match(check)
    if check.lossless is None:
        return "n/a (sampling)"
    if check.lossless:
        return f"yes ({check.compared}/{check.compared})"
    m = check.first_mismatch
    where = (
        f"; first: {m.source} {m.question_id} turn {m.turn + 1}, token {m.position}" if m else ""
    )
    return f"**no**: {check.mismatches} of {check.compared} differ{where}"


def fmt_reference_match(check: LosslessCheck) -> str:
    """Another engine's outputs against plain decoding's: counted, not judged."""
    if check.compared == 0:
        return "n/a (another engine)"
    where = (
        ""
        if check.mean_first_difference is None
        else f"; those differ first at token {check.mean_first_difference:.1f} on average"
    )
    same = check.compared - check.mismatches
    return f"n/a (another engine): {same}/{check.compared} match plain{where}"


def reference_lines(overall: dict[str, MethodStats]) -> list[str]:
    """One line per reference engine: eaglespec plain's decode speed over the engine's (the
    number a CPU user compares), and every eaglespec method's tokens/s over the engine's."""
    lines = []
    plain = overall[PLAIN]
    for name in (m for m in overall if m in REFERENCE_ENGINES):
        ref = overall[name]
        if ref.decode_tokens_per_second <= 0 or ref.tokens_per_second <= 0:
            continue
        decode = plain.decode_tokens_per_second / ref.decode_tokens_per_second
        ours = ", ".join(
            f"{m} {s.tokens_per_second / ref.tokens_per_second:.2f}x"
            for m, s in overall.items()
            if m not in REFERENCE_ENGINES
        )
        lines += [
            f"eaglespec plain / {name} decode ratio **{decode:.2f}** "
            f"({plain.decode_tokens_per_second:.1f} vs {ref.decode_tokens_per_second:.1f} "
            f"decode tok/s). eaglespec tok/s over {name}'s (prefill included): {ours}.",
            "",
        ]
    return lines


def fmt_round_time(s: MethodStats) -> str:
    t = s.round_time
    if t is None:
        return "-"
    if t.draft_ms is None or t.verify_ms is None or t.other_ms is None:
        return f"{t.total_ms:.1f} per step"
    return f"{t.draft_ms:.1f} / {t.verify_ms:.1f} / {t.other_ms:.1f} ({t.total_ms:.1f})"


def fmt_speedup(s: MethodStats) -> str:
    return "-" if s.speedup is None else f"{s.speedup:.2f}x"


def fmt_accept_length(s: MethodStats) -> str:
    return "-" if s.mean_accept_length is None else f"{s.mean_accept_length:.2f}"


def fmt_rates(s: MethodStats) -> str:
    return ", ".join(f"{r:.2f}" for r in s.accept_rate_by_position) or "-"


def summary_table(overall: dict[str, MethodStats]) -> str:
    rows = [
        "| method | tok/s | speedup | mean accept length | accept rate by draft position "
        "| ms per round: draft / verify / other (total) | peak memory | lossless |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in overall.items():
        rows.append(
            f"| {name} | {s.tokens_per_second:.1f} | {fmt_speedup(s)} | {fmt_accept_length(s)} "
            f"| {fmt_rates(s)} | {fmt_round_time(s)} | {s.peak_memory_bytes / 2**20:.0f} MiB "
            f"| {fmt_lossless(s.lossless, name)} |"
        )
    return "\n".join(rows)


def shape_table(overall: dict[str, MethodStats]) -> str:
    """Each drafting method's rounds by draft shape: the adaptive policy's choices beside the
    fixed methods' one shape, each at its tokens a round and drafting + verification time."""
    rows = [
        "| method | shape | share of rounds | tokens a round | ms a round (draft + verify) "
        "| tokens per draft + verify second |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in overall.items():
        for shape, one in s.shapes.items():
            rate = one.tokens_per_round / one.ms_per_round * 1e3 if one.ms_per_round else 0.0
            rows.append(
                f"| {name} | {shape} | {one.share:.1%} | {one.tokens_per_round:.2f} "
                f"| {one.ms_per_round:.1f} | {rate:.0f} |"
            )
    return "\n".join(rows)


def ab_table(
    overall: dict[str, MethodStats], extra: tuple[str, Callable[[str], str]] | None = None
) -> str:
    """The in-process A/B table the benchmarks/ scripts print: per method but plain, tokens a
    round to three places, speed over plain, and how many turns equal plain greedy's (greedy
    runs); `extra`, a (header, cell from the method's name) column after them."""
    head, cell = extra if extra is not None else ("", None)
    rows = [
        "| method | tokens a round | x plain | lossless |" + (f" {head} |" if cell else ""),
        "|---|---|---|---|" + ("---|" if cell else ""),
    ]
    for name, s in overall.items():
        if name == PLAIN:
            continue
        assert s.mean_accept_length is not None and s.speedup is not None
        check = s.lossless
        rows.append(
            f"| {name} | {s.mean_accept_length:.3f} | {s.speedup:.3f}x "
            f"| {check.compared - check.mismatches}/{check.compared} |"
            + (f" {cell(name)} |" if cell else "")
        )
    return "\n".join(rows)


def group_table(
    summary: BenchSummary, methods: Sequence[str], cell: Callable[[MethodStats], str]
) -> str:
    """Rows: groups then "all"; columns: `methods`; one metric per table."""
    rows = [
        f"| {summary.group_by} | turns | " + " | ".join(methods) + " |",
        "|---|---|" + "---|" * len(methods),
    ]
    tables = [*summary.groups.items(), ("**all**", summary.overall)]
    for name, table in tables:
        turns = table[PLAIN].generations
        rows.append(f"| {name} | {turns} | " + " | ".join(cell(table[m]) for m in methods) + " |")
    return "\n".join(rows)


def render_report(
    summary: BenchSummary,
    *,
    command: str,
    settings: dict[str, Any],
    environment: dict[str, Any],
    descriptions: dict[str, str],
    memory_scope: str,
    plots: Sequence[str],
) -> str:
    env = environment
    names = list(summary.overall)
    compared = [m for m in names if m != PLAIN]  # speedup and losslessness columns
    drafting = [m for m in compared if m not in REFERENCE_ENGINES]
    references = [m for m in names if m in REFERENCE_ENGINES]
    hardware = env["gpu"] or env["cpu"]
    git = env["eaglespec"]["git"]
    commit = f", eaglespec {git['commit'][:10]}{' (dirty)' if git['dirty'] else ''}" if git else ""
    sampling = (
        "greedy" if settings["temperature"] == 0 else f"temperature {settings['temperature']}"
    )
    lines = [
        f"# eaglespec bench: {Path(env['model']['path']).name}",
        "",
        f"```\n{command}\n```",
        "",
        f"{env['date']}; {hardware}; torch {env['torch']}, {env['threads']} threads; "
        f"device {env['device']}, {env['dtype']}, quant {env['quant']}, "
        f"compile {env['compile']}{commit}.",
        f"{summary.overall[PLAIN].generations} turns from {', '.join(settings['questions'])}; "
        f"at most {settings['max_tokens']} new tokens per turn, {sampling}, batch 1, methods "
        "interleaved per question after a warm-up.",
        "",
        "tok/s: new tokens over prefill + decode time, summed over all turns. Speedup: over plain "
        "decoding on the same questions. Mean acceptance length: tokens per target forward, "
        "the bonus token included. Accept rate [j]: share of rounds that accepted their j-th "
        f"draft token. Peak memory: {memory_scope}; every method's models stay loaded together. "
        "Lossless: token ids identical to plain decoding's for every turn (greedy only).",
        *(
            [
                f"{', '.join(references)}: another engine on the same model file, same prompt "
                "ids and thread count (a reference, not a speculation method): speedup is its "
                "tok/s over eaglespec plain's; its outputs are counted against plain's (other "
                "numerics, so not expected to equal them), and a later turn continues from its "
                "own answer.",
            ]
            if references
            else []
        ),
        "",
        "## Summary",
        "",
        summary_table(summary.overall),
        "",
        *reference_lines(summary.overall),
        *(
            [
                "### Rounds by draft shape",
                "",
                "The shape each round ran (the adaptive policy's arms, by the length it asked "
                "for; a gated chain may draft fewer).",
                "",
                shape_table(summary.overall),
                "",
            ]
            if any(summary.overall[m].shapes for m in drafting)
            else []
        ),
        "## Methods",
        "",
        *[f"- **{name}**: {descriptions[name]}" for name in names],
        "",
        f"## By {summary.group_by}",
        "",
        "### Speedup over plain decoding",
        "",
        group_table(summary, compared, fmt_speedup),
        "",
        "### Tokens/s",
        "",
        group_table(summary, names, lambda s: f"{s.tokens_per_second:.1f}"),
        "",
        "### Mean acceptance length",
        "",
        group_table(summary, drafting, fmt_accept_length),
        "",
        "### Lossless",
        "",
        group_table(summary, compared, lambda s: fmt_lossless(s.lossless, "")),
        "",
    ]
    if plots:
        lines += ["## Plots", "", *[f"![{Path(p).stem}]({p})\n" for p in plots]]
    return "\n".join(lines).rstrip("\n") + "\n"
