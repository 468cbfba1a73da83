"""results.json: everything a benchmark measured, machine-readable.

Top-level keys:
  schema        "eaglespec-bench/1"
  command       the command line that reproduces the run (every option spelled out)
  settings      questions, limits, sampling, draft shapes, grouping, the metric definitions
  environment   software, machine, engine settings, model and draft hashes (environment.py)
  methods       name -> one-line description of what drafts
  summary       method -> MethodStats over all questions (aggregate.py)
  groups        category (or file) -> method -> MethodStats
  generations   one record per method, question and turn (timings, counts, match with plain)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eaglespec.bench.aggregate import BenchSummary, first_difference
from eaglespec.bench.lineup import PLAIN, Method
from eaglespec.bench.questions import Question
from eaglespec.bench.runner import Generation

SCHEMA = "eaglespec-bench/1"
DEFINITIONS = {
    "tokens_per_second": "new tokens / (prefill + decode seconds), summed over generations",
    "decode_tokens_per_second": "tokens after each first / decode seconds, summed",
    "speedup": "tokens_per_second / plain decoding's, on the same questions",
    "mean_accept_length": "(accepted draft tokens + rounds) / rounds: tokens per target forward",
    "accept_rate_by_position": "[j]: share of rounds proposing a draft token at position j+1 "
    "that accepted it",
    "round_time": "decode milliseconds per round (plain: per decode step), split draft / verify "
    "/ other for drafting methods",
}


def generation_record(
    g: Generation, questions: Sequence[Question], plain: dict[tuple[int, int], list[int]]
) -> dict[str, Any]:
    q, s = questions[g.question], g.output.stats
    ref = plain.get((g.question, g.turn))
    return {
        "method": g.method,
        "source": q.source,
        "question_id": q.question_id,
        "category": q.category,
        "turn": g.turn,
        "prompt_tokens": len(g.prompt_token_ids),
        "new_tokens": s.new_tokens,
        "finish_reason": g.output.finish_reason,
        "prefill_seconds": s.prefill_seconds,
        "decode_seconds": s.decode_seconds,
        "rounds": s.rounds,
        "accepted_tokens": s.accepted_tokens,
        "draft_tokens": s.draft_tokens,
        "draft_seconds": s.draft_seconds,
        "verify_seconds": s.verify_seconds,
        "shapes": {name: asdict(one) for name, one in s.shapes.items()},
        "peak_memory_bytes": g.peak_memory_bytes,
        "matches_plain": None if ref is None else first_difference(g.output.token_ids, ref) is None,
    }


def results_dict(
    *,
    command: str,
    settings: dict[str, Any],
    environment: dict[str, Any],
    methods: Sequence[Method],
    summary: BenchSummary,
    questions: Sequence[Question],
    generations: Sequence[Generation],
) -> dict[str, Any]:
    plain = {(g.question, g.turn): g.output.token_ids for g in generations if g.method == PLAIN}
    return {
        "schema": SCHEMA,
        "command": command,
        "settings": {**settings, "group_by": summary.group_by, "definitions": DEFINITIONS},
        "environment": environment,
        "methods": {m.name: m.description for m in methods},
        "summary": {m: asdict(s) for m, s in summary.overall.items()},
        "groups": {
            name: {m: asdict(s) for m, s in table.items()} for name, table in summary.groups.items()
        },
        "generations": [generation_record(g, questions, plain) for g in generations],
    }


def write_results(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
