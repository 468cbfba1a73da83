"""The server's Prometheus metrics, in a registry of their own (one per app, so tests and several
apps in one process never share counts). Updated from the engine thread, read by /metrics."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets in seconds: a token on a 2-core CPU takes 10-100 ms, a prefill up to seconds.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "eaglespec_requests",
            "Requests by outcome: stop, length, cancelled, error, rejected",
            ["outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter("eaglespec_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "eaglespec_generation_tokens", "Generated tokens", registry=r
        )
        self.ttft = Histogram(
            "eaglespec_time_to_first_token_seconds",
            "Arrival to first generated token, queueing included",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "eaglespec_inter_token_latency_seconds",
            "Time between generated tokens of a request (a round's gap shared by its tokens)",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.rounds = Counter(
            "eaglespec_spec_rounds", "Row-rounds: one per running sequence per round", registry=r
        )
        self.draft_tokens = Counter("eaglespec_spec_draft_tokens", "Draft tokens", registry=r)
        self.accepted_tokens = Counter(
            "eaglespec_spec_accepted_tokens", "Draft tokens accepted", registry=r
        )
        self.mean_accept = Gauge(
            "eaglespec_spec_mean_acceptance_length",
            "Tokens per target forward per sequence, bonus included (all rounds so far)",
            registry=r,
        )
        self.proposed_at = Counter(
            "eaglespec_spec_proposed_by_position",
            "Row-rounds that proposed a token at this draft position (1-based)",
            ["position"],
            registry=r,
        )
        self.accepted_at = Counter(
            "eaglespec_spec_accepted_by_position",
            "Row-rounds that accepted the token at this draft position (1-based)",
            ["position"],
            registry=r,
        )
        self.accept_rate = Gauge(
            "eaglespec_spec_acceptance_rate",
            "Acceptance rate at each draft position (1-based)",
            ["position"],
            registry=r,
        )
        self.draft_length = Gauge(
            "eaglespec_draft_length", "Draft tokens per row in the last round", registry=r
        )
        self.batch_size = Gauge(
            "eaglespec_batch_size", "Sequences in the running batch", registry=r
        )
        self.queue_depth = Gauge("eaglespec_queue_depth", "Requests waiting to start", registry=r)
        self._totals = [0, 0]  # row-rounds, accepted tokens: for the mean acceptance gauge
        self._by_position: list[list[int]] = []  # [j] = [proposed, accepted]

    def record_round(self, drafted: int, accepted: Sequence[int]) -> None:
        """One round: `drafted` draft positions, `accepted[b]` accepted by row b."""
        self.draft_length.set(drafted)
        if not drafted:
            return
        self.rounds.inc(len(accepted))
        self.draft_tokens.inc(drafted * len(accepted))
        self.accepted_tokens.inc(sum(accepted))
        self._totals[0] += len(accepted)
        self._totals[1] += sum(accepted)
        self.mean_accept.set((self._totals[0] + self._totals[1]) / self._totals[0])
        while len(self._by_position) < drafted:
            self._by_position.append([0, 0])
        for j in range(drafted):
            hits = sum(1 for a in accepted if a > j)
            counts = self._by_position[j]
            counts[0] += len(accepted)
            counts[1] += hits
            position = str(j + 1)
            self.proposed_at.labels(position).inc(len(accepted))
            self.accepted_at.labels(position).inc(hits)
            self.accept_rate.labels(position).set(counts[1] / counts[0])

    def render(self) -> bytes:
        return generate_latest(self.registry)
