"""Answering many prompts at once for training data: plain decoding in one batch that is refilled
as rows finish (continuous batching), so the batch stays full to the end.

A fixed batch (generate.py) decodes until its longest answer ends; answers of a training mix end
anywhere between a few tokens and the limit, so most of a fixed batch's steps run with a
shrinking number of rows. Here newcomers join as soon as a quarter of the room is free, in one
ragged prefill (engine.BatchRunner.join, the server's own continuous batching with no draft),
and every finished answer is handed back at once.

Room: at most `max_rows` rows, and rows x the cache's capacity (the longest prompt + new tokens
among them) at most `budget` positions, which bounds the KV cache and the attention's padding.
Jobs join in the order given, so a caller that orders them by length keeps the capacity tight.

Each row's tokens are computed as if it decoded alone: the kernels compute every row the same
way whatever the other rows, at the commands' default precision (model/w4a8.py).

With `capture`, each answer also brings the target's states of its every position, taken as it
was answered (recorder.FeatureRecorder): what a feature prefill over it would compute.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from eaglespec.config import SamplingParams
from eaglespec.draft.base import NoDraft, Proposer
from eaglespec.engine import BatchRunner
from eaglespec.model.llama import Transformer
from eaglespec.requests import RequestOutput, StreamEvent
from eaglespec.tokenizer import Tokenizer
from eaglespec.train.recorder import FeatureRecorder, RowFeatures

# The batch's room by default, sized for 2 CPU cores (a GPU takes hundreds of rows):
MAX_ROWS = 64  # rows decoded at once
BUDGET = 24576  # rows x the cache's capacity (prompt + new tokens), at most


@dataclass(frozen=True, slots=True)
class Job:
    key: str
    prompt: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class Answer:
    job: Job
    output: RequestOutput
    features: RowFeatures | None = None  # with answer_all(capture=...)


@torch.inference_mode()  # per resumption of the generator, like generate_stream
def answer_all(
    model: Transformer,
    tokenizer: Tokenizer,
    jobs: Iterable[Job],
    *,
    max_rows: int = MAX_ROWS,
    budget: int = BUDGET,
    capture: Sequence[int] | None = None,  # boundaries whose states each answer brings
) -> Iterator[Answer]:
    """Every job's answer, in the order they finish. Closing the iterator stops decoding."""
    started: list[list[RowFeatures]] = []  # each prefill group's records, filled by the recorder
    proposer: Proposer = (
        NoDraft() if capture is None else FeatureRecorder(model, capture, started.append)
    )
    runner = BatchRunner(model, proposer, tokenizer, max_draft=0)
    queue = deque(jobs)
    running: dict[int, tuple[Job, RowFeatures | None]] = {}  # request index -> job, record
    index = 0
    while queue or runner.seqs:
        group = _newcomers(runner, queue, max_rows, budget)
        if group:
            ids = range(index, index + len(group))
            index += len(group)
            events = runner.join([j.prompt for j in group], [j.params for j in group], ids)
            records: Sequence[RowFeatures | None] = (
                started.pop() if started else [None] * len(group)
            )
            running.update(zip(ids, zip(group, records, strict=True), strict=True))
            yield from _finished(events, running)
        if runner.seqs:
            yield from _finished(runner.round(0, None).events, running)


def _newcomers(runner: BatchRunner, queue: deque[Job], max_rows: int, budget: int) -> list[Job]:
    """The jobs to join now: none until a quarter of the room is free (or the batch is empty);
    then as many as fit, taken from the front of the queue."""
    rows = len(runner.seqs)
    capacity = 0 if runner.batch is None else runner.batch.cache.capacity
    group: list[Job] = []
    for job in queue:
        need = runner.capacity_for(len(job.prompt), job.params.max_tokens)
        cap = max(capacity, need)
        if rows + len(group) >= max_rows or (rows + len(group) + 1) * cap > budget:
            break
        capacity = cap
        group.append(job)
    if not group and rows == 0 and queue:
        group = [queue[0]]  # longer than the budget alone: it runs by itself
    if rows and len(group) < max(1, (rows + len(group)) // 4):
        return []  # too little room yet: a prefill for one or two rows costs a step of all
    for _ in group:
        queue.popleft()
    return group


def _finished(
    events: list[StreamEvent], running: dict[int, tuple[Job, RowFeatures | None]]
) -> Iterator[Answer]:
    for event in events:
        if event.output is not None:
            job, record = running.pop(event.index)
            yield Answer(job, event.output, record)
