"""Speculative decoding is lossless: greedy output equals plain greedy decoding token for token
(fp32), whatever the draft proposes, for chains of several lengths, ragged batches, stops and
sampled rows mixed in; seeded sampled runs repeat exactly.

Drafts: the random EAGLE-3 head (almost every draft rejected) and an oracle proposer that drafts
the target's own greedy continuation, optionally corrupted (almost all / some accepted), so both
the rejection and the bonus paths run."""

from __future__ import annotations

import pytest
import torch

from eaglespec.config import SamplingParams, TreeConfig
from eaglespec.draft.loader import random_eagle3
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.engine import BatchRunner, generate_speculative
from eaglespec.generate import generate_stream
from eaglespec.model.llama import Transformer
from eaglespec.requests import RequestOutput, collect_outputs
from helpers import NullTokenizer, tiny_target
from oracle import OracleProposer

V = 96


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_target(0, vocab=V)


PROMPTS = [[5, 17, 33, 2, 8], [9, 1, 4], [70, 71, 72, 73, 74, 75, 76, 77, 78], [3]]


def _plain(target, prompts, params):
    return collect_outputs(generate_stream(target, NullTokenizer(), prompts, params))


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("draft", ["random-head", "oracle", "oracle-noisy"])
def test_greedy_equals_plain(target: Transformer, k: int, draft: str) -> None:
    lengths = [12, 7, 20, 1]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    plain = _plain(target, PROMPTS, params)
    if draft == "random-head":
        head = random_eagle3(target, seed=1)
        proposer = Eagle3Proposer(head, (1, 3, 4))
    else:
        seqs = [p + o.token_ids + [0] * 8 for p, o in zip(PROMPTS, plain, strict=True)]
        proposer = OracleProposer(seqs, V, wrong_every=3 if draft == "oracle-noisy" else 0)
    spec = collect_outputs(
        generate_speculative(target, proposer, NullTokenizer(), PROMPTS, params, num_draft=k)
    )
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason == "length"
    stats = [o.stats for o in spec if o.stats.rounds]
    if draft == "oracle":
        # Everything drafted is right: every round but the last accepts all k drafts.
        assert all(s.mean_accept_length > 0.8 * (k + 1) for s in stats if s.rounds > 2)
    if draft == "random-head":
        assert all(s.mean_accept_length < 1.5 for s in stats)


def test_stop_token_inside_an_accepted_run(target: Transformer) -> None:
    params = [SamplingParams(max_tokens=30, ignore_eos=True)]
    plain = _plain(target, PROMPTS[:1], params)
    stop = plain[0].token_ids[9]
    stopped = [SamplingParams(max_tokens=30, stop_token_ids=(stop,))]
    want = _plain(target, PROMPTS[:1], stopped)[0]
    seqs = [PROMPTS[0] + plain[0].token_ids + [0] * 8]
    got = collect_outputs(
        generate_speculative(
            target, OracleProposer(seqs, V), NullTokenizer(), PROMPTS[:1], stopped, num_draft=5
        )
    )[0]
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"


def test_seeded_sampling_repeats_and_mixed_batch(target: Transformer) -> None:
    head = random_eagle3(target, seed=2)
    proposer = Eagle3Proposer(head, (1, 3, 4))
    params = [
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=10, ignore_eos=True),
    ]

    def run() -> list[RequestOutput]:
        events = generate_speculative(
            target, proposer, NullTokenizer(), PROMPTS[:2], params, num_draft=3
        )
        return collect_outputs(events)

    a, b = run(), run()
    assert a[0].token_ids == b[0].token_ids
    # The greedy row in a mixed batch still equals plain greedy.
    plain = _plain(target, PROMPTS[1:2], params[1:])
    assert a[1].token_ids == plain[0].token_ids


SEEDED = [
    SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.3, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=9, ignore_eos=True),  # greedy, in the same batch
]


@pytest.mark.parametrize(
    "how", ["random-head", "oracle", "oracle-noisy", "tree", "changing-lengths"]
)
def test_seeded_sampling_gives_the_plain_tokens_under_any_speculation(
    target: Transformer, how: str
) -> None:
    """A seeded request's tokens do not depend on what speculation ran: each emitted token is
    the target's draw from the uniform a plain step would use (verify.py), whether drafts were
    all rejected, all accepted, some, in a tree, or the draft length changed from round to
    round (as under adaptive speculation)."""
    prompts = PROMPTS[:3]
    plain = _plain(target, prompts, SEEDED)
    assert plain[0].token_ids != _plain(target, prompts[:1], [SEEDED[1]])[0].token_ids
    tree = TREES["eagle-like"] if how == "tree" else None
    if how == "random-head":  # every draft rejected
        proposer = Eagle3Proposer(random_eagle3(target, seed=2), (1, 3, 4))
    else:  # the plain sampled tokens, some made wrong; in a tree, the oracle's ladder (accepted
        # paths skip a wrong sibling at every depth)
        seqs = [p + o.token_ids + [0] * 8 for p, o in zip(prompts, plain, strict=True)]
        noisy = how in ("oracle-noisy", "changing-lengths")
        proposer = OracleProposer(seqs, V, wrong_every=3 if noisy else 0)
    if how == "changing-lengths":
        runner = BatchRunner(target, proposer, NullTokenizer(), max_draft=4)
        events = runner.join(prompts, SEEDED, range(3))
        k = 0
        while runner.seqs:
            events += runner.round(k % 5, None).events
            k += 1
        spec = sorted((e.output for e in events if e.output), key=lambda o: o.index)
    else:
        spec = collect_outputs(
            generate_speculative(
                target, proposer, NullTokenizer(), prompts, SEEDED, num_draft=3, tree=tree
            )
        )
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids
    # Accepted drafts went through the sampled rows (the random head's are all rejected).
    least = {"random-head": 1.0, "oracle": 3.0, "tree": 2.5}.get(how, 1.5)
    assert spec[0].stats.mean_accept_length >= least, how


TREES = {
    "chain-as-tree": TreeConfig(depth=4, top_k=1, num_nodes=4),
    "wide": TreeConfig(depth=2, top_k=6, num_nodes=12),
    "deep": TreeConfig(depth=6, top_k=2, num_nodes=10),
    "eagle-like": TreeConfig(depth=4, top_k=4, num_nodes=20),
}


@pytest.mark.parametrize("shape", sorted(TREES))
def test_tree_drafting_greedy_equals_plain(target: Transformer, shape: str) -> None:
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 7, 20, 1)]
    plain = _plain(target, PROMPTS, params)
    proposer = Eagle3Proposer(random_eagle3(target, seed=3), (1, 3, 4))
    events = generate_speculative(
        target, proposer, NullTokenizer(), PROMPTS, params, num_draft=1, tree=TREES[shape]
    )
    for a, b in zip(plain, collect_outputs(events), strict=True):
        assert b.token_ids == a.token_ids


def test_tree_is_well_formed_and_top1_tree_is_the_chain(target: Transformer) -> None:
    proposer = Eagle3Proposer(random_eagle3(target, seed=4), (1, 3, 4))
    ids = torch.tensor([PROMPTS[0], PROMPTS[0][::-1]])
    roots = torch.tensor([7, 9])
    out = target(ids, torch.arange(5).expand(2, 5), target.new_cache(2, 64), capture=(1, 3, 4))
    state = proposer.start(ids, roots, out.hidden, [5, 5], 64)
    shape = TreeConfig(depth=4, top_k=3, num_nodes=15)
    tree = proposer.propose_tree(state, roots, shape)
    assert state.cache.lengths == [5, 5]  # scratch forgotten
    assert tree.tokens.shape == (2, 16) and bool((tree.depth <= 4).all())
    idx = torch.arange(16)
    assert bool((tree.parents[:, 1:] < idx[1:]).all()) and bool((tree.parents[:, 1:] >= 0).all())
    chain = proposer.propose(state, 4)
    top1 = proposer.propose_tree(state, roots, TreeConfig(depth=4, top_k=1, num_nodes=4))
    assert torch.equal(top1.tokens[:, 1:], chain)


def test_tree_with_accepted_paths_that_skip_nodes(target: Transformer) -> None:
    """The oracle's ladder tree puts the right token second at every depth: everything is
    accepted along a path of every other node, so `cache.keep` gathers non-contiguous entries."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 7, 20, 1)]
    plain = _plain(target, PROMPTS, params)
    seqs = [p + o.token_ids + [0] * 8 for p, o in zip(PROMPTS, plain, strict=True)]
    shape = TreeConfig(depth=3, top_k=2, num_nodes=6)
    events = generate_speculative(
        target, OracleProposer(seqs, V), NullTokenizer(), PROMPTS, params, num_draft=1, tree=shape
    )
    spec = collect_outputs(events)
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids
    assert spec[2].stats.mean_accept_length > 3.0  # 20 tokens: full ladders of 3 + bonus


def test_decoding_runs_in_inference_mode_without_leaking_it(
    target: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every target forward of plain and speculative decoding runs under inference_mode; the
    caller's code between events does not (the generators enter and leave it per resumption)."""
    modes: list[bool] = []
    forward = Transformer.forward

    def spy(self: Transformer, *args, **kwargs):  # type: ignore[no-untyped-def]
        modes.append(torch.is_inference_mode_enabled())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", spy)
    params = [SamplingParams(max_tokens=6, ignore_eos=True)]
    head = Eagle3Proposer(random_eagle3(target, seed=1), (1, 3, 4))
    for events in (
        generate_stream(target, NullTokenizer(), [[5, 17, 33]], params),
        generate_speculative(target, head, NullTokenizer(), [[5, 17, 33]], params, num_draft=2),
    ):
        for _ in events:
            assert not torch.is_inference_mode_enabled()
    assert len(modes) >= 4 and all(modes)
