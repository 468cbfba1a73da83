"""How much to draft in each speculation round: fixed, off, or chosen from measured costs and
observed acceptance. Host-side arithmetic only, no tensors.

The adaptive policy maximises expected tokens per second for the current batch size B:

    tokens(k) = 1 + sum_{j=1..k} P(accept >= j)      a chain of k drafts (the 1 is the bonus)
    rate(k)   = tokens(k) / seconds(B, k)            per row, per second of wall time

P(accept >= j) is estimated from every row of every round that proposed at least j tokens
(acceptance counts per draft position, with a Beta(1, 1) prior and exponential forgetting, so the
estimate follows the traffic). seconds(B, k) is a moving average of measured round times, per
power-of-two bucket of B, since verifying k + 1 tokens for B rows costs more as B grows. An EAGLE-2
tree configured beside the chains is one more arm with its own measured tokens per round.

k = 0 is a plain decoding step (the draft only catches up), so drafting stops when no k > 0
beats it by a margin (5%, so that round-time noise alone does not move it off plain steps). With
a proposer that grafts its own candidates into every round (prompt lookup, `grafts`), k = 0 is a
speculative round too and the margin is 0: a 5% lean towards it measured 2-7% slower on SmolLM2's
six sets (benchmarks/policy_ab.py, BENCHMARKS.md). Arms
never measured at a batch bucket are tried before their costs are trusted, twice: the first
round of an arm at a bucket is a warm-up whose time is not kept (first calls allocate, and a
compiled step compiles that shape), and while
drafting is off a probe round every `probe_every` rounds keeps the acceptance estimate from going
stale. This is the cost model the server runs; nothing in it is a constant guessed for a machine
(the margin is a tolerance for noise, not a cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from eaglespec.config import TreeConfig
from eaglespec.errors import InvalidRequestError

SPECULATION_MODES = ("adaptive", "on", "off")
# How much faster than plain decoding steps a drafting arm must look (a tolerance for noise)
PLAIN_MARGIN = 0.05


@dataclass(frozen=True, slots=True)
class DraftChoice:
    num_draft: int  # chain length (0: no drafting this round)
    tree: TreeConfig | None = None  # an EAGLE-2 tree instead of a chain

    @property
    def name(self) -> str:
        if self.tree is not None:
            t = self.tree
            return f"tree{t.depth},{t.top_k},{t.num_nodes}"
        return f"chain{self.num_draft}"


class FixedDraft:
    """The same shape every round: `on` with the configured shape, `off` with num_draft 0."""

    def __init__(self, choice: DraftChoice) -> None:
        self.choice = choice

    def choose(self, batch: int) -> DraftChoice:
        return self.choice

    def observe(
        self, batch: int, choice: DraftChoice, seconds: float, accepted: Sequence[int]
    ) -> None:
        pass


class ScriptedDraft:
    """The given shapes in order, one a round, then the last one for every later round
    (`LLM.warm_up` walks the step shapes with it)."""

    def __init__(self, choices: Sequence[DraftChoice]) -> None:
        if not choices:
            raise ValueError("ScriptedDraft needs at least one shape")
        self.choices = list(choices)
        self.rounds = 0

    def choose(self, batch: int) -> DraftChoice:
        choice = self.choices[min(self.rounds, len(self.choices) - 1)]
        self.rounds += 1
        return choice

    def observe(
        self, batch: int, choice: DraftChoice, seconds: float, accepted: Sequence[int]
    ) -> None:
        pass


@dataclass
class _Arm:
    seconds: dict[int, float] = field(default_factory=dict)  # batch bucket -> EMA round seconds
    tokens: float | None = None  # EMA tokens per row per round (trees only)
    # Buckets whose first round this policy has seen: that round is not timed (warm-up).
    warmed: set[int] = field(default_factory=set)


class AdaptiveDraft:
    """Chains of 0 .. max_draft tokens (and `tree`, if given), chosen per round."""

    def __init__(
        self,
        max_draft: int,
        tree: TreeConfig | None = None,
        *,
        smoothing: float = 0.05,
        forget: float = 0.995,
        probe_every: int = 32,
        margin: float = PLAIN_MARGIN,
        measure_tokens: bool = False,
    ) -> None:
        """`measure_tokens`: every arm's tokens per round is its measured moving average, not
        the chain model's 1 + sum P(accept >= j) (which counts the chain's own drafts only): for
        a proposer that grafts candidates of its own into every round (draft/hybrid.py), a
        chain of k can land more than k + 1 tokens and a zero-draft round more than one."""
        if max_draft < 1:
            raise InvalidRequestError(f"adaptive drafting needs max_draft >= 1, got {max_draft}")
        self.max_draft = max_draft
        self.choices = [DraftChoice(k) for k in range(max_draft + 1)]
        if tree is not None:
            self.choices.append(DraftChoice(0, tree))
        self.arms = {c: _Arm() for c in self.choices}
        # Weight of a new round's time (and measured tokens) in its arm's moving average. A
        # round's tokens swing from 1 to 6 with lookup's grafts, so at 0.2 one lucky or unlucky
        # round reordered the arms and an arm left behind kept its unlucky estimate (no later
        # round of it to correct it): 0.05 ran 1.004-1.044x as fast on SmolLM2's six sets over
        # four A/Bs, and its tokens a round varied less (benchmarks/policy_ab.py, BENCHMARKS.md).
        self.smoothing = smoothing
        self.forget = forget  # per-row decay of the acceptance counts
        self.probe_every = probe_every
        self.margin = margin  # how much faster than the zero-draft arm a drafting arm must look
        self.proposed = [0.0] * max_draft  # [j]: rows that proposed >= j + 1 (decayed)
        self.accepted = [0.0] * max_draft  # [j]: rows that accepted >= j + 1 (decayed)
        self.rounds_without_drafts = 0
        self.measure_tokens = measure_tokens

    def accept_prob(self, j: int) -> float:
        """P(accept >= j + 1) among rows that proposed j + 1 tokens, Beta(1, 1) prior."""
        return (self.accepted[j] + 1.0) / (self.proposed[j] + 2.0)

    def expected_tokens(self, choice: DraftChoice) -> float:
        """Tokens a row gains per round with this choice (bonus included)."""
        tokens = self.arms[choice].tokens
        if choice.tree is not None:
            return tokens if tokens is not None else self.expected_tokens(DraftChoice(1))
        if self.measure_tokens and tokens is not None:
            return tokens
        return 1.0 + sum(self.accept_prob(j) for j in range(choice.num_draft))

    def choose(self, batch: int) -> DraftChoice:
        bucket = _bucket(batch)
        for c in self.choices:  # explore: every arm is timed once per batch bucket
            if bucket not in self.arms[c].seconds:
                return c
        best = self._pick(bucket)
        if best.num_draft == 0 and best.tree is None:
            self.rounds_without_drafts += 1
            if self.rounds_without_drafts >= self.probe_every:  # refresh the acceptance estimate
                self.rounds_without_drafts = 0
                drafting = [c for c in self.choices if c.num_draft or c.tree]
                return max(drafting, key=lambda c: self.rate(c, bucket))
        else:
            self.rounds_without_drafts = 0
        return best

    def best(self, batch: int) -> DraftChoice | None:
        """The arm this policy runs at this batch size once it has measured them all (its
        choice without exploring or probing, the margin over zero-draft rounds applied); None
        while some arm is unmeasured there."""
        bucket = _bucket(batch)
        if any(bucket not in self.arms[c].seconds for c in self.choices):
            return None
        return self._pick(bucket)

    def _pick(self, bucket: int) -> DraftChoice:
        """The highest expected rate, unless it beats the zero-draft arm by less than the
        margin (every arm measured at `bucket`)."""
        best = max(self.choices, key=lambda c: self.rate(c, bucket))
        plain = self.choices[0]
        if self.rate(best, bucket) < (1 + self.margin) * self.rate(plain, bucket):
            best = plain  # drafting must beat plain steps clearly, not within round-time noise
        return best

    def rate(self, choice: DraftChoice, bucket: int) -> float:
        """Expected tokens per row per second at this batch bucket (measured arms only)."""
        return self.expected_tokens(choice) / self.arms[choice].seconds[bucket]

    def observe(
        self, batch: int, choice: DraftChoice, seconds: float, accepted: Sequence[int]
    ) -> None:
        """One finished round: its wall time and the draft tokens each row accepted. The first
        round of each arm at each batch bucket warms it up and its time is not kept: eager first
        calls allocate, and a compiled step compiles the round's shape on first use (minutes for
        a fully compiled target), which would make that arm look minutes long for many rounds."""
        arm = self.arms.get(choice)
        if arm is None:
            return
        bucket = _bucket(batch)
        if bucket in arm.warmed:
            old = arm.seconds.get(bucket)
            arm.seconds[bucket] = seconds if old is None else _mix(old, seconds, self.smoothing)
        else:  # its first round here pays first-call costs (a compile of its shape: minutes)
            arm.warmed.add(bucket)
        if choice.tree is not None or self.measure_tokens:
            mean = 1.0 + sum(accepted) / max(1, len(accepted))
            arm.tokens = mean if arm.tokens is None else _mix(arm.tokens, mean, self.smoothing)
        if choice.tree is not None:
            return
        for a in accepted:
            for j in range(self.max_draft):
                self.proposed[j] *= self.forget
                self.accepted[j] *= self.forget
            for j in range(choice.num_draft):
                self.proposed[j] += 1.0
                self.accepted[j] += float(j < a)

    def record(self, choice: DraftChoice, batch: int, seconds: float, tokens: float) -> None:
        """Set an arm's measured mean round time at this batch size (and, for the tree or when
        tokens are measured, its mean tokens per round), replacing the moving averages: what a
        calibration run measured."""
        arm = self.arms[choice]
        arm.seconds[_bucket(batch)] = seconds
        if choice.tree is not None or self.measure_tokens:
            arm.tokens = tokens

    def state(self) -> dict[str, Any]:
        """What the policy has learned, as JSON-able data (calibration.py stores it)."""
        return {
            "max_draft": self.max_draft,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "arms": [
                {
                    "choice": c.name,
                    "seconds": {str(b): s for b, s in self.arms[c].seconds.items()},
                    "tokens": self.arms[c].tokens,
                }
                for c in self.choices
            ],
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Start from a stored `state()`: arms and draft positions this policy does not have are
        ignored, so a stored state from a longer chain or another tree still seeds the rest."""
        n = min(self.max_draft, len(state["proposed"]))
        self.proposed[:n] = [float(x) for x in state["proposed"][:n]]
        self.accepted[:n] = [float(x) for x in state["accepted"][:n]]
        by_name = {c.name: c for c in self.choices}
        for arm in state["arms"]:
            choice = by_name.get(arm["choice"])
            if choice is not None:
                self.arms[choice].seconds = {int(b): float(s) for b, s in arm["seconds"].items()}
                self.arms[choice].tokens = arm["tokens"]


DraftPolicy = FixedDraft | AdaptiveDraft


def make_policy(
    mode: str,
    num_draft: int,
    tree: TreeConfig | None,
    has_draft: bool,
    *,
    grafts: bool = False,
    gated: bool = False,
) -> DraftPolicy:
    """`mode` "adaptive", "on" (the configured shape every round) or "off"; without a draft only
    "off" runs. `grafts`: the proposer adds candidates to every round (measure each arm's
    tokens, AdaptiveDraft's `measure_tokens`, and no margin over the zero-draft arm, which then
    drafts too). `gated`: the proposer drafts fewer tokens than a chain arm asks where it doubts
    them (Eagle3Proposer's min_prob), so an arm's tokens are measured too, not modelled."""
    check_policy_args(mode, num_draft, tree, has_draft=has_draft)
    if mode == "off" or not has_draft:
        return FixedDraft(DraftChoice(0))
    if mode == "on":
        return FixedDraft(DraftChoice(num_draft, tree))
    margin = 0.0 if grafts else PLAIN_MARGIN
    measure = grafts or gated
    return AdaptiveDraft(max(1, num_draft), tree, measure_tokens=measure, margin=margin)


def check_policy_args(
    mode: str, num_draft: int, tree: TreeConfig | None, *, has_draft: bool
) -> None:
    """An error naming the flag where the speculation mode and draft length cannot be run (the
    draft length only matters with a draft)."""
    if mode not in SPECULATION_MODES:
        raise InvalidRequestError(
            f"unknown speculation mode '{mode}' (choose from {', '.join(SPECULATION_MODES)})"
        )
    if not has_draft:
        return
    if num_draft < 0:
        raise InvalidRequestError(f"--draft-tokens must be at least 0, got {num_draft}")
    if mode == "adaptive" and num_draft == 0 and tree is None:
        raise InvalidRequestError(
            "adaptive speculation picks chains of 0 to --draft-tokens drafts a round: give at "
            "least 1 (or --speculation off to decode plainly)"
        )


def _bucket(batch: int) -> int:
    """The power of two at or above the batch size: round costs are shared within a bucket."""
    return 1 << max(0, batch - 1).bit_length()


def _mix(old: float, new: float, weight: float) -> float:
    return (1 - weight) * old + weight * new
