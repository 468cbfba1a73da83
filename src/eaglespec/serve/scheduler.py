"""The engine loop: one thread owns the model and serves every request by continuous batching.

Between two speculation rounds it drops cancelled sequences (their cache rows go at once), admits
waiting requests up to `max_seqs` running (all newcomers share one ragged prefill), then runs one
round for the whole batch with the draft shape the policy picks for this batch size. Requests
arrive from any thread through `submit`; their events go back through each submission's
`deliver` callback, called on the engine thread (the app hands them to its event loop).

The engine loop runs on the thread that loaded the model when the server is given one (`engine`,
a one-worker executor: `eaglespec serve` loads, warms up and decodes on it). On a CPU this is
what keeps one stream as fast as `generate`: OpenMP gives each thread that opens a parallel
region its own team of workers, and once a second team exists (the loading thread's, beside the
decoding thread's) libgomp counts more threads than cores and stops spinning between regions,
so every one of the hundreds of regions in a step waits for a worker to wake (SmolLM2 decoded
in another thread than the one that loaded it: 0.45x the tokens/s, benchmarks/serve_stream.py).

Admission: at most `max_queue` requests wait; past that `submit` raises `QueueFullError` (the
app answers 429 with Retry-After). Each request's KV room (prompt + max_tokens + one round of
drafts) is reserved when it joins, and the app refuses requests that cannot fit the context.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import torch

from eaglespec.config import SamplingParams
from eaglespec.engine import BatchRunner, Prefill
from eaglespec.errors import EaglespecError
from eaglespec.policy import AdaptiveDraft, FixedDraft
from eaglespec.requests import StreamEvent
from eaglespec.serve.metrics import ServerMetrics


class QueueFullError(EaglespecError):
    """Too many requests waiting: retry later."""


class ServerClosingError(EaglespecError):
    """The server is shutting down and takes no new work."""


Deliver = Callable[[StreamEvent | None, Exception | None], None]


@dataclass(eq=False)
class Submission:
    id: int
    prompt: list[int]
    params: SamplingParams
    deliver: Deliver  # called on the engine thread with (event, None) or (None, error)
    arrived: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None
    finished: bool = False


class Scheduler:
    def __init__(
        self,
        runner: BatchRunner,
        policy: FixedDraft | AdaptiveDraft,
        metrics: ServerMetrics,
        *,
        max_seqs: int,
        max_queue: int,
        prefill_chunk: int | None = None,
        engine: Executor | None = None,
    ) -> None:
        """`prefill_chunk`: newcomers' prompts are prefilled this many tokens per engine step,
        with a round of the running batch after each chunk, so a long prompt does not stall
        the streams already running (None: each group in one forward). `engine`: run the loop
        on this one-worker executor's thread, the one that loaded the model (None: a thread of
        its own)."""
        self.runner = runner
        self.prefill_chunk = prefill_chunk
        self._prefill: Prefill | None = None  # newcomers being prefilled, in chunks
        self._prefill_subs: list[Submission] = []
        self.policy = policy
        self.metrics = metrics
        self.max_seqs = max_seqs
        self.max_queue = max_queue
        self._cond = threading.Condition()
        self._waiting: deque[Submission] = deque()
        self._running: dict[int, Submission] = {}
        self._cancelled: set[int] = set()
        self._closing = False
        self._deadline = float("inf")  # perf_counter after which running requests are cancelled
        self._ids = itertools.count()
        self._engine = engine
        self._loop_run: Future[None] | threading.Thread | None = None  # the loop, once started

    # --- any thread -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._engine is not None:
            self._loop_run = self._engine.submit(self._loop)
        else:
            thread = threading.Thread(target=self._loop, name="eaglespec-engine", daemon=True)
            thread.start()
            self._loop_run = thread

    def submit(self, prompt: list[int], params: SamplingParams, deliver: Deliver) -> Submission:
        with self._cond:
            if self._closing:
                raise ServerClosingError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                self.metrics.requests.labels("rejected").inc()
                raise QueueFullError(
                    f"{len(self._waiting)} requests are already waiting (--max-queue "
                    f"{self.max_queue}); retry shortly"
                )
            sub = Submission(next(self._ids), list(prompt), params, deliver)
            self._waiting.append(sub)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()
        return sub

    def cancel(self, sub: Submission) -> None:
        """The client went away: forget a waiting request, or free a running one's rows before the
        next round."""
        with self._cond:
            if sub.finished:
                return
            if sub in self._waiting:
                self._waiting.remove(sub)
                self.metrics.queue_depth.set(len(self._waiting))
                self._finish(sub, "cancelled")
            else:
                self._cancelled.add(sub.id)
            self._cond.notify()

    def stop(self, grace: float = 10.0) -> None:
        """Refuse new work, let running requests finish for up to `grace` seconds, cancel the
        rest, and end the engine thread."""
        with self._cond:
            self._closing = True
            self._deadline = time.perf_counter() + grace
            self._cond.notify()
        if isinstance(self._loop_run, threading.Thread):
            self._loop_run.join()
        elif self._loop_run is not None:
            self._loop_run.result()

    def set_policy(self, policy: FixedDraft | AdaptiveDraft) -> None:
        """Rounds from the next one on take their shapes from `policy`."""
        with self._cond:
            self.policy = policy

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        with self._cond:
            return len(self._running), len(self._waiting)

    # --- the engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        with torch.inference_mode():  # the engine thread only decodes: no autograd bookkeeping
            self._serve()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._running or self._closing or self._cancelled):
                    self._cond.wait()
                if self._closing:
                    for sub in self._waiting:
                        sub.deliver(None, ServerClosingError("the server is shutting down"))
                        self._finish(sub, "cancelled")
                    self._waiting.clear()
                    if time.perf_counter() > self._deadline:
                        self._cancelled.update(self._running)
                cancelled = [i for i in self._cancelled if i in self._running]
                self._cancelled.clear()
                free = self.max_seqs - (len(self._running) - len(cancelled))
                if self._prefill is not None:
                    free = 0  # later arrivals wait for the group being prefilled
                newcomers = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
                self.metrics.queue_depth.set(len(self._waiting))
                for sub in newcomers:
                    self._running[sub.id] = sub
            if cancelled:
                self.runner.drop(cancelled)
                for i in cancelled:
                    sub = self._running.pop(i)
                    sub.deliver(None, ServerClosingError("cancelled"))
                    self._finish(sub, "cancelled")
            if newcomers:
                self._begin(newcomers)
            if self._prefill is not None:
                self._prefill_step()
            if self.runner.seqs:
                self._round()
            self.metrics.batch_size.set(len(self.runner.seqs))
            with self._cond:
                if self._closing and not self._running and not self._waiting:
                    return

    def _begin(self, subs: list[Submission]) -> None:
        try:
            self._prefill = self.runner.begin_join(
                [s.prompt for s in subs],
                [s.params for s in subs],
                [s.id for s in subs],
                chunk=self.prefill_chunk,
            )
        except Exception as e:  # a bad request must not take the server down
            self._fail(subs, e)
            return
        self._prefill_subs = subs
        for sub in subs:
            self.metrics.prompt_tokens.inc(len(sub.prompt))

    def _prefill_step(self) -> None:
        """One chunk of the newcomers' prefill; when it was the last, they join the batch."""
        assert self._prefill is not None
        prefill, subs = self._prefill, self._prefill_subs
        try:
            if not prefill.step():
                return
            events = self.runner.complete_join(prefill)
        except Exception as e:  # an engine bug: fail these requests, keep serving
            self._prefill, self._prefill_subs = None, []
            self.runner.drop([s.id for s in subs])
            self._fail([s for s in subs if s.id in self._running], e)
            return
        self._prefill, self._prefill_subs = None, []
        gone = [s.id for s in subs if s.id not in self._running]  # cancelled while prefilling
        if gone:
            self.runner.drop(gone)
        self._dispatch([e for e in events if e.index in self._running])

    def _fail(self, subs: list[Submission], error: Exception) -> None:
        for sub in subs:
            del self._running[sub.id]
            sub.deliver(None, error)
            self._finish(sub, "error")

    def _round(self) -> None:
        try:
            report = self.runner.policy_round(self.policy)
        except Exception as e:  # an engine bug: fail the batch, keep serving
            ids = [s.out.index for s in self.runner.seqs]
            self.runner.drop(ids)
            self._fail([self._running[i] for i in ids], e)
            return
        self.metrics.record_round(report.output.drafted, report.output.accepted)
        self._dispatch(report.events)

    def _dispatch(self, events: list[StreamEvent]) -> None:
        now = time.perf_counter()
        for event in events:
            sub = self._running[event.index]
            n = len(event.token_ids)
            if n:
                if sub.last_token_at is None:
                    self.metrics.ttft.observe(now - sub.arrived)
                    n -= 1  # the first token has a time to first token, not a gap
                if n:
                    gap = (now - (sub.last_token_at or now)) / n
                    for _ in range(n):
                        self.metrics.itl.observe(gap)
                sub.last_token_at = now
                self.metrics.generation_tokens.inc(len(event.token_ids))
            if event.output is not None:
                del self._running[event.index]
                self._finish(sub, event.output.finish_reason or "stop")
            sub.deliver(event, None)

    def _finish(self, sub: Submission, outcome: str) -> None:
        sub.finished = True
        self.metrics.requests.labels(outcome).inc()
