"""How much to draft in each speculation round: fixed, off, or chosen from measured costs and
observed acceptance. Host-side arithmetic only, no tensors.

The adaptive policy maximises expected tokens per second for the current batch size B:

    tokens(k) = 1 + sum_{j=1..k} P(accept >= j)      a chain of k drafts (the 1 is the bonus)
    rate(k)   = tokens(k) / seconds(B, k)            per row, per second of wall time

P(accept >= j) is estimated from every row of every round whose arm asked for at least j tokens
(acceptance counts per draft position, with a Beta(1, 1) prior and exponential forgetting, so the
estimate follows the traffic; a draft a gated head declined counts as not accepted), pooled over
the arms: every chain round teaches every chain arm, so no arm is judged on the few rounds it ran
itself. While a chain shorter than the longest wins, every `probe_every` rounds a probe runs the
next longer chain (the position only it asks for) or the next shorter one (its time), by turns.
With a proposer that grafts its own
candidates into every round (prompt lookup), a chain of k can land more than k + 1 tokens:
tokens(k) adds the arm's measured surplus (accepted tokens beyond its k, a moving average over
its own rounds: lookup keys its graft on a chain of one's draft, so a chain of one lands more
beyond its length than a chain of four), and the zero-draft arm, all graft, is valued at what
it landed. seconds(B, k) is a moving average of measured round times (their plain mean until an
arm has 1 / smoothing of them), per power-of-two bucket of B, since verifying k + 1 tokens for B
rows costs more as B grows. An EAGLE-2 tree configured beside the chains is one more arm with its
own measured tokens per round.

k = 0 is a plain decoding step (the draft only catches up), so drafting stops when no k > 0
beats it by a margin (5%, so that round-time noise alone does not move it off plain steps). With
a proposer that grafts its own candidates into every round (prompt lookup, `grafts`), k = 0 is a
speculative round too (lookup's candidates alone), and plain steps are one more arm (DraftChoice
graft=False): in a batch every row verifies as many tokens as the longest graft, so on SmolLM2 a
12-row zero-draft round took 4.4x a plain step for 1.7 tokens a row, and a batch that could only
choose among speculative rounds ran at 0.54x plain decoding (session 59). The head's arms must
beat lookup's alone with no margin (a 5% lean towards it measured 2-7% slower on SmolLM2's six
sets, benchmarks/policy_ab.py, BENCHMARKS.md), and whatever wins must beat plain steps by the
margin. Arms never measured at a batch bucket are tried before their costs are trusted, twice:
the first round of an arm at a bucket is a warm-up whose time is not kept (first calls allocate,
and a compiled step compiles that shape). While no head arm runs, a probe of the best one keeps
the acceptance estimate from going stale; probes run once the rounds since the last have taken
`probe_every` times the probe's round time, so they cost at most 1 / probe_every of the time at
any batch size. This is the cost model the server runs; nothing in it is a constant guessed for
a machine (the margin is a tolerance for noise, not a cost). Among the drafting arms the
shortest whose expected rate is within LONGER_LEAN (5%) of the best runs: the model credits a
longer chain with every position's pooled acceptance, but a longer chain's rounds land less than
that where it counts (prompt lookup keys its graft on a chain of one's draft only,
draft/hybrid.py), and an estimate within a few percent of another is noise; on SmolLM2's six
sets the default ran gated chains of 4 in 76-97% of its rounds at 2.00-2.12 tokens against the
chain of one's 2.17 (BENCHMARKS.md, session 52).
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
# How much faster a longer drafting arm must look than a shorter one to run instead of it
LONGER_LEAN = 0.05


@dataclass(frozen=True, slots=True)
class DraftChoice:
    num_draft: int  # chain length (0: no drafting this round)
    tree: TreeConfig | None = None  # an EAGLE-2 tree instead of a chain
    # whether a grafting proposer (prompt lookup, draft/hybrid.py) adds its candidates; False
    # with no drafts: a plain decoding step, one token a row
    graft: bool = True

    @property
    def name(self) -> str:
        if not self.graft and self.num_draft == 0 and self.tree is None:
            return "plain"
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
    tokens: float | None = None  # EMA tokens per row per round (`_measured` arms only)
    # EMA tokens a row accepted beyond the chain's length (a graft's continuation; chains only)
    surplus: float | None = None
    # Buckets whose first round this policy has seen: that round is not timed (warm-up).
    warmed: set[int] = field(default_factory=set)
    timed: dict[int, int] = field(default_factory=dict)  # batch bucket -> rounds timed
    rounds: int = 0  # rounds whose tokens were observed


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
        lean: float = LONGER_LEAN,
    ) -> None:
        """`measure_tokens`: the zero-draft arm's tokens per round is its measured moving
        average, not 1: for a proposer that grafts candidates of its own into every round
        (draft/hybrid.py) a zero-draft round lands what the grafts do, and plain steps are an
        arm of their own (`plain`, beside `zero`). Chains of k >= 1 are
        always valued by the pooled model plus the surplus (module doc): measured one arm at a
        time, an arm judged on its first unlucky rounds (a response's opening tokens accept
        little) was never run again, and the default ran the arm that happened to look best
        (BENCHMARKS.md, session 52)."""
        if max_draft < 1:
            raise InvalidRequestError(f"adaptive drafting needs max_draft >= 1, got {max_draft}")
        self.max_draft = max_draft
        # The plain decoding step; under grafts the zero-draft arm is a speculative round too
        # (lookup's candidates alone), so a plain step is an arm of its own.
        self.plain = DraftChoice(0, graft=not measure_tokens)
        self.zero = DraftChoice(0) if measure_tokens else None
        self.heads = [DraftChoice(k) for k in range(1, max_draft + 1)]  # the head's arms
        if tree is not None:
            self.heads.append(DraftChoice(0, tree))
        self.choices = [self.plain] + ([self.zero] if self.zero else []) + self.heads
        self.arms = {c: _Arm() for c in self.choices}
        # Weight of a new round's time (and measured tokens) in its arm's moving average. A
        # round's tokens swing from 1 to 6 with lookup's grafts, so at 0.2 one lucky or unlucky
        # round reordered the arms and an arm left behind kept its unlucky estimate (no later
        # round of it to correct it): 0.05 ran 1.004-1.044x as fast on SmolLM2's six sets over
        # four A/Bs, and its tokens a round varied less (benchmarks/policy_ab.py, BENCHMARKS.md).
        self.smoothing = smoothing
        self.forget = forget  # per-row decay of the acceptance counts
        self.probe_every = probe_every
        self.margin = margin  # how much faster than plain steps any other arm must look
        self.lean = lean  # how much faster than a shorter drafting arm a longer one must look
        self.proposed = [0.0] * max_draft  # [j]: rows that proposed >= j + 1 (decayed)
        self.accepted = [0.0] * max_draft  # [j]: rows that accepted >= j + 1 (decayed)
        self.rounds_without_drafts = 0
        self.rounds_below_longest = 0  # rounds of a chain shorter than max_draft since a probe
        self.probe_shorter = True  # probes alternate: the next longer chain, the next shorter
        self.measure_tokens = measure_tokens

    def accept_prob(self, j: int) -> float:
        """P(accept >= j + 1) among rows that proposed j + 1 tokens, Beta(1, 1) prior."""
        return (self.accepted[j] + 1.0) / (self.proposed[j] + 2.0)

    def expected_tokens(self, choice: DraftChoice) -> float:
        """Tokens a row gains per round with this choice (bonus included)."""
        tokens = self.arms[choice].tokens
        if choice.tree is not None:
            return tokens if tokens is not None else self.expected_tokens(DraftChoice(1))
        if choice.num_draft == 0:
            return tokens if self._measured(choice) and tokens is not None else 1.0
        drafts = sum(self.accept_prob(j) for j in range(choice.num_draft))
        return 1.0 + drafts + (self.arms[choice].surplus or 0.0)

    def choose(self, batch: int) -> DraftChoice:
        bucket = _bucket(batch)
        for c in self.choices:  # explore: every arm is timed once per batch bucket
            if bucket not in self.arms[c].seconds:
                return c
        best = self._pick(bucket)
        if best not in self.heads:  # plain steps or lookup's candidates alone
            self.rounds_without_drafts += 1
            probe = max(self.heads, key=lambda c: self.rate(c, bucket))
            if self._due(self.rounds_without_drafts, best, probe, bucket):  # refresh acceptance
                self.rounds_without_drafts = 0
                return probe
            return best
        self.rounds_without_drafts = 0
        if best.tree is None and best.num_draft < self.max_draft:
            self.rounds_below_longest += 1
            # the next longer chain (the next position's acceptance: only it asks for that) or
            # the next shorter one (its time), by turns
            shorter = not self.probe_shorter and best.num_draft > 1
            probe = DraftChoice(best.num_draft + (-1 if shorter else 1))
            if self._due(self.rounds_below_longest, best, probe, bucket):
                self.rounds_below_longest = 0
                self.probe_shorter = not self.probe_shorter
                return probe
        return best

    def _due(self, rounds: int, best: DraftChoice, probe: DraftChoice, bucket: int) -> bool:
        """Whether a probe is due: once the rounds of `best` since the last one have taken
        `probe_every` times the probe's round time, so probes cost at most 1 / probe_every of
        the time. Counted in rounds alone, a probe of a chain of one every 32 plain steps of a
        12-row batch cost 18% of the time (a round of it takes 6 plain steps' time there)."""
        seconds = self.arms[best].seconds[bucket], self.arms[probe].seconds[bucket]
        return rounds * seconds[0] >= self.probe_every * seconds[1]

    def _measured(self, choice: DraftChoice) -> bool:
        """Whether the arm is valued at its measured tokens per round (the tree, and the
        zero-draft arm under grafts), not by the chain model."""
        return choice.tree is not None or (choice == self.zero)

    def _weight(self, n: int) -> float:
        """A moving average's weight for its n-th value: the plain mean until 1 / smoothing
        values, so an arm measured a few times is not held to its first, unlucky rounds."""
        return max(self.smoothing, 1.0 / n)

    def best(self, batch: int) -> DraftChoice | None:
        """The arm this policy runs at this batch size once it has measured them all (its
        choice without exploring or probing, the margin over zero-draft rounds applied); None
        while some arm is unmeasured there."""
        bucket = _bucket(batch)
        if any(bucket not in self.arms[c].seconds for c in self.choices):
            return None
        return self._pick(bucket)

    def _pick(self, bucket: int) -> DraftChoice:
        """The shortest of the head's arms within `lean` of the best one's expected rate
        (chains by length, then the tree); lookup's candidates alone (the grafted zero-draft
        arm) if they look faster; plain steps unless the pick beats them by the margin (every
        arm measured at `bucket`)."""
        top = max(self.rate(c, bucket) for c in self.heads)
        best = next(c for c in self.heads if (1 + self.lean) * self.rate(c, bucket) >= top)
        if self.zero is not None and self.rate(best, bucket) < self.rate(self.zero, bucket):
            best = self.zero  # a speculative round too: no margin (module doc)
        if self.rate(best, bucket) < (1 + self.margin) * self.rate(self.plain, bucket):
            best = self.plain  # drafting must beat plain steps clearly, not within noise
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
            n = arm.timed[bucket] = arm.timed.get(bucket, 0) + 1
            arm.seconds[bucket] = seconds if old is None else _mix(old, seconds, self._weight(n))
        else:  # its first round here pays first-call costs (a compile of its shape: minutes)
            arm.warmed.add(bucket)
        if self._measured(choice):
            mean = 1.0 + sum(accepted) / max(1, len(accepted))
            w = self._weight(arm.rounds + 1)
            arm.tokens = mean if arm.tokens is None else _mix(arm.tokens, mean, w)
        arm.rounds += 1
        if choice.tree is not None:
            return
        if choice.num_draft and accepted:
            beyond = sum(max(0, a - choice.num_draft) for a in accepted) / len(accepted)
            old = arm.surplus
            arm.surplus = beyond if old is None else _mix(old, beyond, self._weight(arm.rounds))
        for a in accepted:
            for j in range(self.max_draft):
                self.proposed[j] *= self.forget
                self.accepted[j] *= self.forget
            for j in range(choice.num_draft):
                self.proposed[j] += 1.0
                self.accepted[j] += float(j < a)

    def record(self, choice: DraftChoice, batch: int, seconds: float, tokens: float) -> None:
        """Set an arm's measured mean round time at this batch size (and, for an arm valued at
        its measured tokens, `_measured`, its mean tokens per round), replacing the moving
        averages: what a calibration run measured."""
        arm = self.arms[choice]
        arm.seconds[_bucket(batch)] = seconds
        settled = round(1 / self.smoothing)  # a mean: later rounds move it as a moving average
        arm.timed[_bucket(batch)] = arm.rounds = settled
        if self._measured(choice):
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
                    "surplus": self.arms[c].surplus,
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
                self.arms[choice].surplus = arm.get("surplus")
                settled = round(1 / self.smoothing)  # stored means move as moving averages
                self.arms[choice].timed = {b: settled for b in self.arms[choice].seconds}
                self.arms[choice].rounds = settled


DraftPolicy = FixedDraft | AdaptiveDraft


def make_policy(
    mode: str,
    num_draft: int,
    tree: TreeConfig | None,
    has_draft: bool,
    *,
    grafts: bool = False,
) -> DraftPolicy:
    """`mode` "adaptive", "on" (the configured shape every round) or "off"; without a draft only
    "off" runs. `grafts`: the proposer adds candidates to every round (measure the zero-draft
    arm's tokens, AdaptiveDraft's `measure_tokens`, with no margin over it, since it then drafts
    too, and plain steps an arm of their own). A gated head (Eagle3Proposer's min_prob) needs
    nothing more: a draft it declines counts as not accepted at its position, so the chain model
    values gated arms at what they land."""
    check_policy_args(mode, num_draft, tree, has_draft=has_draft)
    if mode == "off" or not has_draft:
        return FixedDraft(DraftChoice(0))
    if mode == "on":
        return FixedDraft(DraftChoice(num_draft, tree))
    return AdaptiveDraft(max(1, num_draft), tree, measure_tokens=grafts)


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
