"""Generations -> statistics per method, overall and per category, and the losslessness check.

Definitions (the same for every method, so they compare):
  tokens/s          all new tokens over all generation time (prefill + decode), summed over the
                    generations before dividing, so long answers weigh more (as Spec-Bench does)
  speedup           a method's tokens/s over plain decoding's on the same questions
  mean accept len   tokens per target verification forward, the bonus or recovered token included
                    (EAGLE's tau): (accepted draft tokens + rounds) / rounds
  accept rate [j]   share of the rounds that proposed a draft token at position j+1 which accepted
                    it (acceptance is a prefix, so: accepted at least j+1 draft tokens)
  round time        decode time per verification round, split into drafting, verification (the
                    target forward, verify, host sync) and other (bookkeeping, streaming text);
                    for plain decoding the time per decode step, not split

A reference engine (llama.cpp) is another implementation with other numerics: its greedy outputs
are counted against plain decoding's (how many match, where they first differ on average) but its
losslessness is None, "not applicable", never False; its speedup is its tokens/s over eaglespec
plain's, and its acceptance statistics are empty (it has no draft).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from eaglespec.bench.lineup import PLAIN, REFERENCE_ENGINES
from eaglespec.bench.questions import Question
from eaglespec.bench.runner import Generation
from eaglespec.requests import ShapeStats


@dataclass(frozen=True, slots=True)
class Mismatch:
    source: str  # question file
    question_id: int | str
    turn: int  # 0-based
    position: int  # first differing token (the shorter length when one output extends the other)


@dataclass(frozen=True, slots=True)
class LosslessCheck:
    lossless: bool | None  # None when sampling, or for a reference engine (other numerics)
    compared: int  # generations compared with plain decoding's
    mismatches: int  # of those, how many differ (0 when sampling)
    first_mismatch: Mismatch | None  # in question order
    reference: bool = False  # another engine: a mismatch is numerics, not a speculation bug
    mean_first_difference: float | None = None  # mean `position` over the mismatches


@dataclass(frozen=True, slots=True)
class RoundTime:
    total_ms: float  # decode time per round (plain: per decode step)
    draft_ms: float | None  # None for plain decoding
    verify_ms: float | None
    other_ms: float | None


@dataclass(frozen=True, slots=True)
class ShapeShare:
    """A method's rounds of one draft shape (the adaptive policy's arms; a fixed method has
    one): how often it ran, what it landed and what it cost."""

    rounds: int
    share: float  # of the method's rounds
    tokens_per_round: float  # accepted drafts plus the bonus token
    ms_per_round: float  # drafting and verification (without the round's other bookkeeping)


@dataclass(frozen=True, slots=True)
class MethodStats:
    generations: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    tokens_per_second: float  # new tokens / (prefill + decode) seconds
    decode_tokens_per_second: float  # tokens after each first / decode seconds
    speedup: float | None  # tokens_per_second over plain's; None when plain took no time
    forwards: int  # target forwards after the prefills: rounds, or plain's decode steps
    mean_accept_length: float | None  # None for plain decoding
    accept_rate_by_position: tuple[float, ...]  # empty for plain decoding
    round_time: RoundTime | None  # None when there was no round
    peak_memory_bytes: int  # the largest of its generations' peaks
    lossless: LosslessCheck
    shapes: dict[str, ShapeShare]  # by shape name, most rounds first; empty without rounds


@dataclass(frozen=True, slots=True)
class BenchSummary:
    group_by: str  # "category" or "file"
    overall: dict[str, MethodStats]  # method -> its statistics over every question
    groups: dict[str, dict[str, MethodStats]]  # group -> method -> statistics; first-seen order


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where `a` and `b` differ; None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_lossless(
    outputs: Sequence[Generation],
    plain: Sequence[Generation],
    questions: Sequence[Question],
    greedy: bool,
    reference: bool = False,
) -> LosslessCheck:
    """Compare each output's token ids with plain decoding's for the same question and turn.
    With `reference` (another engine) the differences are counted but decide nothing."""
    plain_ids = {(g.question, g.turn): g.output.token_ids for g in plain}
    pairs = [
        (g, plain_ids[g.question, g.turn]) for g in outputs if (g.question, g.turn) in plain_ids
    ]
    if not greedy:
        return LosslessCheck(None, len(pairs), 0, None, reference)
    found: list[Mismatch] = []
    for g, ref in sorted(pairs, key=lambda p: (p[0].question, p[0].turn)):
        pos = first_difference(g.output.token_ids, ref)
        if pos is not None:
            q = questions[g.question]
            found.append(Mismatch(q.source, q.question_id, g.turn, pos))
    return LosslessCheck(
        None if reference else not found,
        len(pairs),
        len(found),
        found[0] if found else None,
        reference,
        sum(m.position for m in found) / len(found) if found else None,
    )


def method_stats(
    gens: Sequence[Generation],
    plain: Sequence[Generation],
    questions: Sequence[Question],
    *,
    drafting: bool,
    greedy: bool,
    reference: bool = False,
) -> MethodStats:
    """One method's statistics over `gens`; `plain` holds the baseline's for the same turns.
    `drafting`: it has rounds and acceptance; `reference`: another engine (check_lossless)."""
    stats = [g.output.stats for g in gens]
    new = sum(s.new_tokens for s in stats)
    prefill = sum(s.prefill_seconds for s in stats)
    decode = sum(s.decode_seconds for s in stats)
    later = sum(max(s.new_tokens - 1, 0) for s in stats)
    tps, base = _tokens_per_second(gens), _tokens_per_second(plain)
    rounds = sum(s.rounds for s in stats)
    forwards = rounds if drafting else later
    accepted = _sum_by_position([s.accepted_by_position for s in stats])
    proposed = _sum_by_position([s.proposed_by_position for s in stats])
    round_time = None
    if forwards:
        total = decode / forwards * 1e3
        draft = sum(s.draft_seconds for s in stats) / forwards * 1e3
        verify = sum(s.verify_seconds for s in stats) / forwards * 1e3
        round_time = (
            RoundTime(total, draft, verify, total - draft - verify)
            if drafting
            else RoundTime(total, None, None, None)
        )
    return MethodStats(
        generations=len(gens),
        new_tokens=new,
        prefill_seconds=prefill,
        decode_seconds=decode,
        tokens_per_second=tps,
        decode_tokens_per_second=later / decode if decode > 0 else 0.0,
        speedup=tps / base if base > 0 else None,
        forwards=forwards,
        mean_accept_length=(sum(s.accepted_tokens for s in stats) + rounds) / rounds
        if drafting and rounds
        else None,
        accept_rate_by_position=tuple(a / p for a, p in zip(accepted, proposed, strict=True) if p),
        round_time=round_time,
        peak_memory_bytes=max((g.peak_memory_bytes for g in gens), default=0),
        lossless=check_lossless(gens, plain, questions, greedy, reference),
        shapes=shape_shares([s.shapes for s in stats]),
    )


def shape_shares(per_generation: Sequence[dict[str, ShapeStats]]) -> dict[str, ShapeShare]:
    """The generations' rounds summed by draft shape, most rounds first."""
    total: dict[str, ShapeStats] = {}
    for shapes in per_generation:
        for name, one in shapes.items():
            total.setdefault(name, ShapeStats()).add(one.rounds, one.tokens, one.seconds)
    rounds = sum(t.rounds for t in total.values())
    return {
        name: ShapeShare(
            t.rounds, t.rounds / rounds, t.tokens / t.rounds, t.seconds / t.rounds * 1e3
        )
        for name, t in sorted(total.items(), key=lambda kv: -kv[1].rounds)
        if t.rounds
    }


def summarize(
    generations: Sequence[Generation],
    questions: Sequence[Question],
    methods: Sequence[str],
    *,
    group_by: str,
    greedy: bool,
) -> BenchSummary:
    """Statistics of every method over all questions and per group of questions."""
    groups = list(dict.fromkeys(q.group(group_by) for q in questions))

    def table(keep: set[int]) -> dict[str, MethodStats]:
        chosen = [g for g in generations if g.question in keep]
        plain = [g for g in chosen if g.method == PLAIN]
        return {
            m: method_stats(
                [g for g in chosen if g.method == m],
                plain,
                questions,
                drafting=m != PLAIN and m not in REFERENCE_ENGINES,
                greedy=greedy,
                reference=m in REFERENCE_ENGINES,
            )
            for m in methods
        }

    by_group = {
        name: table({i for i, q in enumerate(questions) if q.group(group_by) == name})
        for name in groups
    }
    return BenchSummary(group_by, table(set(range(len(questions)))), by_group)


def _tokens_per_second(gens: Sequence[Generation]) -> float:
    seconds = sum(g.output.stats.prefill_seconds + g.output.stats.decode_seconds for g in gens)
    return sum(g.output.stats.new_tokens for g in gens) / seconds if seconds > 0 else 0.0


def _sum_by_position(rows: Sequence[Sequence[int]]) -> list[int]:
    """Element-wise sum of ragged per-position counts."""
    out = [0] * max((len(r) for r in rows), default=0)
    for r in rows:
        for j, v in enumerate(r):
            out[j] += v
    return out
