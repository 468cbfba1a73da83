"""Benchmark questions in FastChat format, as Spec-Bench and the EAGLE evaluations use them.

One JSON object per line: `question_id`, `category` (may be empty) and `turns`, the user turns of
one conversation. Later turns are answered in the context of the model's own earlier answers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eaglespec.errors import InvalidRequestError

GROUPINGS = ("category", "file")


@dataclass(frozen=True, slots=True)
class Question:
    source: str  # the file's name without extension and "_question": "mt_bench"
    question_id: int | str  # as the file gives it
    category: str  # the question's category, or `source` when the file leaves it empty
    turns: tuple[str, ...]  # user turns, in order

    def group(self, by: str) -> str:
        """The table row this question counts toward: its category or its file."""
        return self.category if by == "category" else self.source


def source_name(path: Path) -> str:
    """'data/mt_bench_question.jsonl' -> 'mt_bench' (Spec-Bench's and EAGLE's file naming)."""
    return path.stem.removesuffix("_question")


def read_questions(path: str | Path, limit: int | None = None) -> list[Question]:
    """The first `limit` questions of one file (all when None), in file order."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise InvalidRequestError(f"cannot read questions {path}: {e.strerror}") from e
    source = source_name(path)
    out: list[Question] = []
    for n, line in enumerate(lines, 1):
        if limit is not None and len(out) >= limit:
            break
        if line.strip():
            out.append(_parse(line, source, f"{path}:{n}"))
    if not out:
        raise InvalidRequestError(f"{path}: no questions")
    return out


def read_all(paths: Sequence[str | Path], limit: int | None = None) -> list[Question]:
    """Questions of every file, `limit` per file, files in the order given."""
    return [q for p in paths for q in read_questions(p, limit)]


def _parse(line: str, source: str, where: str) -> Question:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{where}: not valid JSON: {e.msg}") from e
    if not isinstance(rec, dict):
        raise InvalidRequestError(f"{where}: expected a JSON object")
    turns = rec.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise InvalidRequestError(f"{where}: 'turns' must be a non-empty list of strings")
    qid = rec.get("question_id", where.rsplit(":", 1)[-1])
    if not isinstance(qid, int | str):
        raise InvalidRequestError(f"{where}: 'question_id' must be an integer or a string")
    category = rec.get("category") or source
    return Question(source, qid, str(category), tuple(turns))
