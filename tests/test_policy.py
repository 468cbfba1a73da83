"""The adaptive draft policy against a simulated machine: it measures every arm once, then drafts
long when acceptance is high and drafting is cheap, stops drafting when nothing is accepted (with
periodic probes), and keeps separate costs per batch-size bucket."""

from __future__ import annotations

import random

import pytest

from eaglespec.config import TreeConfig
from eaglespec.errors import InvalidRequestError
from eaglespec.policy import (
    PLAIN_MARGIN,
    AdaptiveDraft,
    DraftChoice,
    FixedDraft,
    ScriptedDraft,
    make_policy,
)


def _simulate(
    policy: AdaptiveDraft, accept: float, cost, rounds: int, batch: int = 1, seed: int = 0
) -> list[DraftChoice]:
    """Rows accept each draft position with probability `accept` until the first rejection;
    a round of k drafts at batch B takes cost(B, k) seconds."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(rounds):
        c = policy.choose(batch)
        accepted = []
        for _ in range(batch):
            a = 0
            while a < c.num_draft and rng.random() < accept:
                a += 1
            accepted.append(a)
        policy.observe(batch, c, cost(batch, c.num_draft), accepted)
        chosen.append(c)
    return chosen


def test_explores_each_arm_once_then_exploits_long_chains() -> None:
    # A run whose few probes of the chain of 4 (the only arm that measures its last position)
    # are unlucky stays on the chain of 3 until a probe lifts it: most seeded runs, not every one.
    exploits = 0
    for seed in range(10):
        policy = AdaptiveDraft(4)
        chosen = _simulate(policy, 0.9, lambda b, k: 0.010 + 0.001 * k, 200, seed=seed)
        # each arm twice: a warm-up round, then the timed one
        assert [c.num_draft for c in chosen[:10]] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
        exploits += [c.num_draft for c in chosen[-50:]] == [4] * 50
        assert policy.accept_prob(0) == pytest.approx(0.9, abs=0.06)
    assert exploits >= 8


def test_stops_drafting_when_nothing_is_accepted_but_probes() -> None:
    policy = AdaptiveDraft(4, probe_every=16)
    chosen = _simulate(policy, 0.0, lambda b, k: 0.010 + 0.004 * k, 300)
    tail = [c.num_draft for c in chosen[100:]]
    assert tail.count(0) > 0.9 * len(tail)
    assert 0 < sum(1 for k in tail if k) <= len(tail) // 16 + 1  # the probes, and only them


def test_expensive_verification_prefers_short_chains() -> None:
    # 60% acceptance; each draft token costs 40% of a plain step: one draft at most pays
    # (14% over plain steps). A run whose acceptance estimate dips under the 5% margin settles
    # on plain steps until probes lift it again, so this asks most seeded runs, not every one.
    prefers_one = 0
    for seed in range(10):
        policy = AdaptiveDraft(4)
        chosen = _simulate(policy, 0.6, lambda b, k: 0.010 + 0.004 * k, 400, seed=seed)
        tail = [c.num_draft for c in chosen[-100:]]
        prefers_one += max(set(tail), key=tail.count) == 1
    assert prefers_one >= 8


def test_costs_are_kept_per_batch_bucket() -> None:
    # Drafting is nearly free alone, but at batch 8 verifying drafts costs 3x a plain step each.
    def cost(b: int, k: int) -> float:
        return 0.010 + (0.0005 if b == 1 else 0.03) * k

    policy = AdaptiveDraft(3)
    _simulate(policy, 0.7, cost, 100, batch=1)
    _simulate(policy, 0.7, cost, 100, batch=8)
    assert policy.choose(1).num_draft == 3
    assert policy.choose(8).num_draft == 0
    assert policy.choose(5).num_draft == 0  # 5 shares the bucket of 8


def test_tree_arm_uses_its_measured_tokens() -> None:
    tree = TreeConfig(depth=3, top_k=2, num_nodes=4)
    policy = AdaptiveDraft(2, tree)
    arm = DraftChoice(0, tree)
    assert arm in policy.choices and arm.name == "tree3,2,4"
    for c in policy.choices * 2:  # warm up and time every arm: the tree accepts 2 per row
        policy.observe(1, c, 0.010, [2] if c.tree else [0])
    assert policy.expected_tokens(arm) == pytest.approx(3.0)
    assert policy.choose(1) == arm


def test_first_round_of_an_arm_is_a_warm_up_and_not_timed() -> None:
    """A compiled step compiles on its first call: that round must not become the arm's cost,
    or plain steps (explored first) would look minutes long and never be chosen again."""
    policy = AdaptiveDraft(1)
    plain, chain = DraftChoice(0), DraftChoice(1)
    policy.observe(1, plain, 300.0, [0])  # compiling
    assert policy.choose(1) == plain and 1 not in policy.arms[plain].seconds
    policy.observe(1, plain, 0.010, [0])
    policy.observe(1, chain, 200.0, [0])  # compiling
    policy.observe(1, chain, 0.020, [0])
    assert policy.arms[plain].seconds[1] == 0.010 and policy.arms[chain].seconds[1] == 0.020
    assert policy.choose(1) == plain  # nothing accepted: a draft round costs twice a plain one
    policy.observe(4, chain, 99.0, [1, 1, 1, 1])  # a new batch bucket warms up again
    assert 4 not in policy.arms[chain].seconds
    assert policy.accept_prob(0) > 0.5  # acceptance counts are kept from warm-up rounds


def test_make_policy_modes() -> None:
    tree = TreeConfig(depth=2, top_k=2, num_nodes=3)
    assert make_policy("on", 3, tree, True).choose(4) == DraftChoice(3, tree)
    assert make_policy("off", 3, None, True).choose(4) == DraftChoice(0)
    assert make_policy("adaptive", 3, None, False).choose(1) == DraftChoice(0)  # no draft
    assert isinstance(make_policy("adaptive", 3, None, True), AdaptiveDraft)
    assert isinstance(make_policy("on", 3, None, True), FixedDraft)
    with pytest.raises(InvalidRequestError, match="speculation mode"):
        make_policy("sometimes", 3, None, True)


def test_scripted_draft_walks_its_shapes_then_keeps_the_last() -> None:
    tree = TreeConfig(depth=2, top_k=2, num_nodes=3)
    shapes = [DraftChoice(0), DraftChoice(2), DraftChoice(3, tree)]
    policy = ScriptedDraft(shapes)
    picked = [policy.choose(1) for _ in range(5)]
    assert picked == [*shapes, shapes[-1], shapes[-1]]
    with pytest.raises(ValueError, match="at least one shape"):
        ScriptedDraft([])


def test_measured_tokens_credit_what_a_graft_lands() -> None:
    """With a grafting proposer a zero-draft round can land several tokens (prompt lookup's):
    `measure_tokens` values the zero-draft arm by what it landed; the chain model would value
    plain rounds at 1 token and never pick them."""
    plain, chain = DraftChoice(0), DraftChoice(1)
    for measure, want in ((False, chain), (True, plain)):
        policy = AdaptiveDraft(1, measure_tokens=measure)
        for _ in range(3):  # warm-up rounds, then timed ones
            policy.observe(1, plain, 0.010, [2])  # lookup alone lands 3 tokens a round
            policy.observe(1, chain, 0.012, [1])  # the head's draft and nothing more
            policy.observe(1, policy.plain, 0.009, [0])  # plain steps (with grafts, an arm)
        assert policy.expected_tokens(plain) == pytest.approx(3.0 if measure else 1.0)
        assert policy.expected_tokens(chain) == pytest.approx(1.8, abs=0.05)  # the model
        assert policy.choose(1) == want
    taught = make_policy("adaptive", 2, None, True, grafts=True)
    assert isinstance(taught, AdaptiveDraft) and taught.measure_tokens
    taught.record(plain, 1, 0.01, 2.5)  # a calibration's measurement
    assert taught.expected_tokens(plain) == 2.5


def test_every_chain_round_teaches_every_chain_arm() -> None:
    """Chains are valued from acceptance per draft position pooled over the arms, plus the
    tokens a graft lands beyond each arm's length in its own rounds: an arm whose own first
    rounds were unlucky is lifted by the other arms' rounds instead of keeping its estimate
    until it runs again (the default, judging each arm on its own rounds, never ran the chain of
    one again after its exploration rounds at a response's opening, BENCHMARKS.md session 52)."""
    one, four = DraftChoice(1), DraftChoice(4)
    policy = AdaptiveDraft(4, measure_tokens=True, smoothing=0.5, forget=1.0)
    policy.observe(1, one, 0.010, [0])  # warm-up
    policy.observe(1, one, 0.010, [0])  # the chain of one's own round: nothing accepted
    low = policy.expected_tokens(one)
    for _ in range(20):  # chains of 4 whose first draft is always accepted, their second never
        policy.observe(1, four, 0.011, [1])
    assert policy.expected_tokens(one) > low + 0.3  # lifted without a round of its own
    # Beta(1, 1) prior: (20 accepted + 1) / (22 asked + 2)
    assert policy.expected_tokens(one) == pytest.approx(1 + 21 / 24)
    for _ in range(4):  # a graft's continuation: 3 tokens beyond the chain of one, every row
        policy.observe(1, one, 0.010, [4, 4])
    surplus = policy.arms[one].surplus
    assert surplus == pytest.approx(3 * (1 - 0.5**4))  # its own moving average, weight 0.5
    assert policy.arms[four].surplus == 0.0  # nothing beyond four landed in its rounds
    assert policy.expected_tokens(one) == pytest.approx(1 + policy.accept_prob(0) + surplus)
    assert policy.expected_tokens(DraftChoice(0)) == 1.0  # valued at what it landed: no round
    again = AdaptiveDraft(4, measure_tokens=True)
    again.load_state(policy.state())  # a stored calibration carries the surpluses too
    assert again.arms[one].surplus == surplus
    assert again.expected_tokens(one) == pytest.approx(policy.expected_tokens(one))


def test_gated_chains_are_modelled_by_what_they_land() -> None:
    """A head that stops its chains where it doubts them drafts fewer tokens than a chain arm
    asks: a declined position counts as not accepted, so the model values a gated chain at what
    it lands, not at what an ungated one would."""
    four = DraftChoice(4)
    policy = AdaptiveDraft(4, smoothing=0.5)
    for _ in range(30):  # the gate let one draft through and it was accepted: a = 1 of 4 asked
        policy.observe(1, four, 0.010, [1])
    assert policy.expected_tokens(four) == pytest.approx(2.0, abs=0.1)
    assert policy.expected_tokens(DraftChoice(2)) == pytest.approx(2.0, abs=0.1)


def test_margin_and_measured_zero_draft_follow_the_proposer(tiny_hf_folder) -> None:  # type: ignore[no-untyped-def]
    """The margin over plain steps stays where zero-draft rounds are plain ones (gated or not);
    with lookup grafted in, the zero-draft arm drafts lookups: measured, and no margin."""
    from eaglespec import LLM

    for min_prob, lookup, measured, margin in (
        (0.0, 0, False, PLAIN_MARGIN),
        (0.3, 0, False, PLAIN_MARGIN),
        (0.3, 2, True, PLAIN_MARGIN),
    ):
        llm = LLM(
            str(tiny_hf_folder),
            progress=False,
            draft="random",
            num_draft=3,
            lookup_tokens=lookup,
            draft_min_prob=min_prob,
        )
        policy = llm.policy
        assert isinstance(policy, AdaptiveDraft)
        assert (policy.measure_tokens, policy.margin) == (measured, margin)
        # with grafts, plain steps are an arm of their own beside lookup's candidates alone
        assert policy.plain == DraftChoice(0, graft=not measured)
        assert (policy.zero == DraftChoice(0)) == measured
        assert "chains stop below path probability" in llm.draft_report or not min_prob


def test_no_margin_over_zero_draft_rounds_that_draft_lookups() -> None:
    """A chain of 1 measured 2% faster than zero-draft rounds: without grafts the zero-draft arm
    is plain decoding and a drafting arm must beat it by the 5% margin; with lookup grafted in
    the zero-draft round drafts too, there is no margin, and the faster arm wins."""
    plain, chain = DraftChoice(0), DraftChoice(1)
    for grafts, want in ((False, plain), (True, chain)):
        policy = make_policy("adaptive", 1, None, True, grafts=grafts)
        assert isinstance(policy, AdaptiveDraft)
        policy.record(policy.plain, 1, 0.008, 1.0)  # with grafts, plain steps are an arm too
        policy.record(plain, 1, 0.010, 2.5)  # lookup alone: 2.5 tokens (plain decoding: 1)
        policy.record(chain, 1, 0.010, 3.0)
        seconds = policy.expected_tokens(chain) / (1.02 * policy.rate(plain, 1))
        policy.record(chain, 1, seconds, 3.0)
        assert policy.rate(chain, 1) == pytest.approx(1.02 * policy.rate(plain, 1))
        assert policy.choose(1) == want
        assert policy.best(1) == want  # what calibration stores and reports as the best arm


def test_plain_steps_win_a_batch_whose_grafts_cost_more_than_they_land() -> None:
    """With lookup grafted in, a zero-draft round verifies every row as wide as its longest
    graft: alone it lands more than a plain step for little more time, but in a batch of 12
    (SmolLM2, session 59) it took 4.4x a plain step for 1.7 tokens a row. Plain steps are an arm
    of their own, and win there; alone, lookup's candidates still beat them."""
    policy = make_policy("adaptive", 1, None, True, grafts=True)
    assert isinstance(policy, AdaptiveDraft)
    plain, lookups, chain = policy.plain, DraftChoice(0), DraftChoice(1)
    assert plain.name == "plain" and lookups.name == "chain0" and policy.choose(1) == plain
    policy.proposed, policy.accepted = [50.0], [24.0]  # P(accept) = 0.5
    for batch, seconds in ((1, (0.0043, 0.0050, 0.0062)), (16, (0.017, 0.075, 0.108))):
        for arm, s, tokens in zip((plain, lookups, chain), seconds, (1.0, 1.25, 0.0), strict=True):
            policy.record(arm, batch, s, tokens)
    assert policy.choose(1) == lookups  # 250 tokens/s; the chain 239, plain steps 233 (x 1.05)
    assert policy.choose(12) == plain  # 59 tokens/s a row; lookups 17, the chain 14
    assert policy.best(16) == plain


def test_probes_cost_at_most_one_in_probe_every_of_the_time() -> None:
    """While plain steps win, a probe of the head runs once the plain rounds since the last one
    have taken `probe_every` times the probe's round time: alone a chain round costs 1.25 plain
    steps (a probe every 40 rounds, not 32), in a batch of 16 nearly 6 (one every 191)."""
    policy = AdaptiveDraft(1, probe_every=32)
    plain, chain = DraftChoice(0), DraftChoice(1)
    policy.proposed, policy.accepted = [200.0], [2.0]  # nothing accepted: plain steps win
    for batch, seconds in ((1, (0.004, 0.00495)), (16, (0.018, 0.1071))):
        policy.record(plain, batch, seconds[0], 1.0)
        policy.record(chain, batch, seconds[1], 1.0)
    for batch, every in ((1, 40), (16, 191)):
        picks = [policy.choose(batch) for _ in range(3 * every)]
        probes = [i for i, c in enumerate(picks) if c == chain]
        assert probes == [every - 1, 2 * every - 1, 3 * every - 1], batch


def test_a_longer_chain_must_look_clearly_faster_and_is_probed() -> None:
    """The shortest drafting arm within LONGER_LEAN of the best runs; once its rounds have taken
    `probe_every` times a round of the next longer chain (8 x 1.08 of its rounds: 9), that chain
    runs once, so the position only it asks for stays measured."""
    zero, one, two = DraftChoice(0), DraftChoice(1), DraftChoice(2)
    policy = AdaptiveDraft(2, margin=0.0, probe_every=8)
    policy.proposed, policy.accepted = [98.0, 98.0], [59.0, 19.0]  # P = 0.6, 0.2
    policy.record(zero, 1, 0.009, 1.0)
    policy.record(one, 1, 0.010, 1.6)  # 160 tokens/s
    policy.record(two, 1, 0.0108, 1.8)  # 167 tokens/s: 4% more, within the lean
    assert policy.expected_tokens(two) == pytest.approx(1.8)
    picks = [policy.choose(1) for _ in range(18)]
    assert picks[8] == picks[17] == two  # the probes
    assert picks[:8] == picks[9:17] == [one] * 8
    policy.record(two, 1, 0.0100, 1.8)  # 180 tokens/s: 12.5% more
    assert policy.best(1) == two
    leanless = AdaptiveDraft(2, margin=0.0, lean=0.0)  # without the lean: the fastest
    leanless.proposed, leanless.accepted = [98.0, 98.0], [59.0, 19.0]
    for c, t in ((zero, 0.009), (one, 0.010), (two, 0.0108)):
        leanless.record(c, 1, t, 1.0)
    assert leanless.best(1) == two


def test_probes_alternate_longer_and_shorter_and_new_arms_take_plain_means() -> None:
    """While a chain of 2 of up to 4 wins, the probes run the chain of 3, then of 1, by turns,
    each once the chain of 2's rounds have taken `probe_every` (4) of its rounds' time: a chain
    of 3 after 8 rounds (4 x 20 ms over 11 ms each), a chain of 1 after 4 (4 x 10 ms over 11).
    An arm timed once moves halfway to its second round (a plain mean), while an arm a
    calibration measured moves by `smoothing` only."""
    one, two, three = DraftChoice(1), DraftChoice(2), DraftChoice(3)
    policy = AdaptiveDraft(4, margin=0.0, probe_every=4, smoothing=0.05)
    policy.proposed, policy.accepted = [98.0] * 4, [79.0, 59.0, 9.0, 0.0]  # P = .8 .6 .1 .01
    for k, seconds in enumerate((0.010, 0.010, 0.011, 0.020, 0.030)):
        policy.record(DraftChoice(k), 1, seconds, 1.0)
    assert policy.best(1) == two
    picks = [policy.choose(1) for _ in range(20)]
    assert picks[7] == three and picks[11] == one and picks[19] == three
    assert [p for i, p in enumerate(picks) if i not in (7, 11, 19)] == [two] * 17
    fresh = AdaptiveDraft(4)
    fresh.observe(1, one, 0.050, [1])  # warm-up: not timed
    fresh.observe(1, one, 0.010, [1])
    fresh.observe(1, one, 0.020, [1])
    assert fresh.arms[one].seconds[1] == pytest.approx(0.015)  # the mean of its two rounds
    policy.observe(1, one, 0.050, [1])  # warm-up in this process
    policy.observe(1, one, 0.020, [1])
    assert policy.arms[one].seconds[1] == pytest.approx(0.95 * 0.010 + 0.05 * 0.020)
