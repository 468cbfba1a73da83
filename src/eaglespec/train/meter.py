"""Throughput of each stage of `eaglespec train`: items and tokens done, tokens per second, shown
as the stage runs (a log line at most every `every` seconds, and at the end) and recorded in
train_report.json, so a recipe's cost per token is measured on every run, not estimated.

Tokens mean what each stage turns into training signal: response tokens written (prompt writing,
answering), positions captured (features: prompt + response), positions x unrolled steps trained.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Deadline:
    """When a stage stops starting work (`--synth-seconds`, `--regen-seconds`): what it made by
    then is kept, the rows still running are dropped. `at` is a `clock()` reading; None: never."""

    at: float | None = None
    clock: Callable[[], float] = time.monotonic

    @classmethod
    def after(cls, seconds: float | None, clock: Callable[[], float] = time.monotonic) -> Deadline:
        return cls(None if seconds is None else clock() + seconds, clock)

    def passed(self) -> bool:
        return self.at is not None and self.clock() >= self.at

    def halfway(self) -> Deadline:
        """Half of the time left from now: for work whose products need the other half (prompts
        written, then answered). Never stays never; a passed deadline stays passed."""
        if self.at is None:
            return self
        now = self.clock()
        return Deadline(now + max(0.0, self.at - now) / 2, self.clock)


NEVER = Deadline()


class Meter:
    def __init__(
        self,
        stage: str,
        unit: str,
        log: Callable[[str], None],
        *,
        total: int | None = None,
        done: int = 0,  # made by an earlier run (a resumed one): shown, not rated or reported
        every: float = 10.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.stage, self.unit, self.log, self.total, self.done = stage, unit, log, total, done
        self.every, self.clock = every, clock
        self.items = self.tokens = 0
        self.start = clock()
        self.shown = self.start

    def add(self, items: int, tokens: int) -> None:
        self.items += items
        self.tokens += tokens
        if self.clock() - self.shown >= self.every:
            self.show()

    def show(self) -> None:
        self.shown = self.clock()
        of = f"/{self.total}" if self.total is not None else ""
        self.log(
            f"{self.stage}: {self.done + self.items}{of} {self.unit}, {self.tokens:,} tokens, "
            f"{self.rate():,.0f} tokens/s"
        )

    def rate(self) -> float:
        return self.tokens / max(self.clock() - self.start, 1e-9)

    def result(self) -> dict[str, Any]:
        """The stage's record in train_report.json (and a last line in the log)."""
        self.show()
        seconds = max(self.clock() - self.start, 1e-9)  # one reading for both fields
        return {
            self.unit: self.items,
            "tokens": self.tokens,
            # to the millisecond: a stage of a second or less, rounded to 0.1 s, disagreed with
            # its own tokens_per_s by up to 10% (tests/test_train_real.py)
            "seconds": round(seconds, 3),
            "tokens_per_s": round(self.tokens / seconds, 1),
        }
