"""The classic draft-model and prompt-lookup proposers on the speculative engine: greedy output
equals plain greedy decoding token for token (fp32, ragged batch, chains of 1 and 4), a draft that
is the target accepts every draft token (its cache stays aligned with the target's), and the n-gram
matcher proposes what followed the latest earlier occurrence of the longest matching suffix."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eaglespec.config import SamplingParams, TreeConfig
from eaglespec.draft.draft_model import DraftModelProposer
from eaglespec.draft.hybrid import HybridProposer, HybridState
from eaglespec.draft.loader import random_eagle3
from eaglespec.draft.lookup import NgramIndex, PromptLookupProposer
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.engine import generate_speculative
from eaglespec.errors import InvalidRequestError, ModelLoadError
from eaglespec.generate import generate_stream
from eaglespec.model.llama import Transformer
from eaglespec.requests import RequestOutput, collect_outputs
from eaglespec.tree import chain_tree, graft_chain
from helpers import NullTokenizer, cycling_target, tiny_target

V = 96
PROMPTS = [[5, 17, 33, 2, 8, 5, 17], [9, 1, 4], [70, 71, 72, 73, 74, 75, 76, 77, 78]]
MAX_TOKENS = [14, 9, 21]


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_target(0, vocab=V)


def _params(lengths=MAX_TOKENS) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]


def _spec(target, proposer, k, prompts=PROMPTS, params=None, tree=None) -> list[RequestOutput]:
    params = params or _params()
    events = generate_speculative(
        target, proposer, NullTokenizer(), prompts, params, num_draft=k, tree=tree
    )
    return collect_outputs(events)


def _assert_lossless(
    target, proposer, k, prompts=PROMPTS, params=None, tree=None
) -> list[RequestOutput]:
    params = params or _params()
    plain = collect_outputs(generate_stream(target, NullTokenizer(), prompts, params))
    spec = _spec(target, proposer, k, prompts, params, tree)
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason == "length"
    return spec


# --- draft model ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("draft", ["same-object", "copy"])
def test_draft_equal_to_target_accepts_everything(target: Transformer, k: int, draft: str) -> None:
    model = target if draft == "same-object" else copy.deepcopy(target)
    spec = _assert_lossless(target, DraftModelProposer(model, target_vocab_size=V), k)
    for out in spec:
        s = out.stats
        assert s.rounds > 0
        # Every draft token accepted in every round: mean accept length k + 1 exactly. A single
        # off-by-one in the draft's positions or cache length would break this at once.
        assert s.accepted_tokens == s.draft_tokens == k * s.rounds
        assert s.mean_accept_length == k + 1


@pytest.mark.parametrize("k", [1, 4])
def test_different_draft_is_lossless(target: Transformer, k: int) -> None:
    # A smaller, differently shaped draft (2 layers, C 32, MQA) sharing only the vocabulary.
    draft = tiny_target(7, vocab=V, layers=2, hidden=32, kv_heads=1)
    spec = _assert_lossless(target, DraftModelProposer(draft, target_vocab_size=V), k)
    if k > 1:
        assert any(o.stats.accepted_tokens < o.stats.draft_tokens for o in spec)


def test_draft_model_prefill_and_catch_up_match_a_fresh_prefill(target: Transformer) -> None:
    """After a round, the draft's cache equals a fresh prefill of the accepted sequence + root."""
    draft = copy.deepcopy(target)
    proposer = DraftModelProposer(draft, target_vocab_size=V)
    prompts = torch.tensor([[5, 17, 33, 2], [9, 1, 0, 0]])
    state = proposer.start(prompts, torch.tensor([40, 41]), [], [4, 2], 16)
    assert state.cache.lengths == [5, 3]
    proposer.propose(state, 3)
    assert state.cache.lengths == [5, 3]  # scratch forgotten
    # Row 0 accepts 2 drafts (d1 d2) then root 50; row 1 accepts none, root 51.
    tokens = torch.tensor([[11, 12, 50], [51, 0, 0]])
    state = proposer.catch_up(state, tokens, [], [3, 1])
    assert state.cache.lengths == [8, 4]
    seqs = [[5, 17, 33, 2, 40, 11, 12, 50], [9, 1, 41, 51]]
    for row, seq in enumerate(seqs):
        fresh = draft.new_cache(1, 16)
        ids = torch.tensor([seq])
        out = draft(ids, torch.arange(len(seq))[None], fresh)
        n = len(seq)
        # Batched (ragged) and single-row fp32 forwards sum in different orders, and the CPU
        # kernel chosen depends on load: 1e-4 absorbs that (1.1e-5 seen once), while a wrong
        # slot or position differs by O(1).
        tol = {"rtol": 1e-4, "atol": 1e-4}
        torch.testing.assert_close(state.cache.k[:, row, :, :n], fresh.k[:, 0, :, :n], **tol)
        torch.testing.assert_close(state.cache.v[:, row, :, :n], fresh.v[:, 0, :, :n], **tol)
        assert state.first[row].item() == out.logits[0, -1].argmax().item()
    # Rows leave the batch together with their state.
    kept = proposer.select_rows(state, [1])
    assert kept.cache.lengths == [4] and kept.first.tolist() == state.first[1:].tolist()


def test_vocab_mismatch_is_a_load_error(target: Transformer) -> None:
    draft = tiny_target(3, vocab=V + 32, layers=1)
    with pytest.raises(ModelLoadError, match=r"128 tokens.*96 tokens"):
        DraftModelProposer(draft, target_vocab_size=target.cfg.vocab_size)


# --- prompt lookup -------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 4])
def test_lookup_is_lossless(target: Transformer, k: int) -> None:
    _assert_lossless(target, PromptLookupProposer(), k)


@pytest.mark.parametrize("k", [1, 4])
def test_lookup_accepts_a_repeating_pattern(k: int) -> None:
    bigram, prompts = cycling_target(PROMPTS, V)
    spec = _assert_lossless(bigram, PromptLookupProposer(), k, prompts, _params([25, 30, 31]))
    for out in spec:
        assert out.stats.accepted_tokens == out.stats.draft_tokens == k * out.stats.rounds


# --- EAGLE-3 chains stopped where the head doubts them (min_prob) -------------------------------


def _started(proposer: Eagle3Proposer, target: Transformer, seed: int):  # type: ignore[no-untyped-def]
    """A head state after a 2-row prompt, from seeded stand-in target states."""
    g = torch.Generator().manual_seed(seed)
    Ct = target.cfg.hidden_size
    aux = [torch.randn(2, 5, Ct, generator=g) for _ in range(3)]
    prompts = torch.tensor([[5, 6, 7, 8, 9], [9, 10, 11, 0, 0]])
    return proposer.start(prompts, torch.tensor([3, 4]), aux, [5, 3], 32)


def test_min_prob_keeps_the_chain_prefix_some_row_is_sure_of(
    target: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gated chain is the ungated chain cut after the last draft j at which some row's
    product of pick probabilities p_1 .. p_j is still >= min_prob: the probabilities are read
    here from the logits the ungated chain picks from, for bounds around every row's path."""
    import eaglespec.draft.proposer as proposer_module

    head = random_eagle3(target, seed=3)
    picked: list[torch.Tensor] = []
    greedy = proposer_module.greedy_tokens

    def recording(logits: torch.Tensor) -> torch.Tensor:
        picked.append(logits.float().softmax(-1).amax(-1))  # (B,)
        return greedy(logits)

    monkeypatch.setattr(proposer_module, "greedy_tokens", recording)
    full = Eagle3Proposer(head, (1, 3, 4)).propose(
        _started(Eagle3Proposer(head, (1, 3, 4)), target, 0), 5
    )
    monkeypatch.undo()
    paths = torch.stack(picked, 1).cumprod(1)  # (B, 5) product of the picks' probabilities
    best = paths.amax(0)  # (5,) the surest row's, non-increasing
    bounds = [float(best[0]) * 1.01, *(float(b) * 0.99 for b in best), 1e-12]
    for bound in bounds:
        if not 0 < bound < 1:
            continue
        proposer = Eagle3Proposer(head, (1, 3, 4), min_prob=bound)
        state = _started(proposer, target, 0)
        lengths = list(state.cache.lengths)
        got = proposer.propose(state, 5)
        want = int((best >= bound).sum())
        assert got.shape == (2, want), (bound, best.tolist())
        assert torch.equal(got, full[:, :want])
        assert state.cache.lengths == lengths  # scratch entries forgotten
    assert picked and float(best[0]) < 1.0  # the bounds above span no-drafts .. the full chain


def test_min_prob_is_checked() -> None:
    head = random_eagle3(tiny_target(0, vocab=V, layers=4), seed=0)
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(InvalidRequestError, match="draft min prob"):
            Eagle3Proposer(head, (1, 2, 3), min_prob=bad)


@pytest.mark.parametrize(("lookup", "tree"), [(0, None), (3, None), (3, TreeConfig(3, 2, 5))])
def test_gated_chains_are_lossless_and_vary_in_length(
    target: Transformer, lookup: int, tree: TreeConfig | None
) -> None:
    """Rounds draft 0 .. k tokens as the head's confidence goes; the output is plain greedy
    decoding's all the same (a tree is not gated: it ranks by the same probabilities)."""
    head = random_eagle3(target, seed=3)
    probe = Eagle3Proposer(head, (1, 3, 4))
    first = probe.propose(_started(probe, target, 0), 1)
    assert first.shape == (2, 1)
    gated = Eagle3Proposer(head, (1, 3, 4), min_prob=0.02)
    proposer = HybridProposer(gated, lookup, min_ngram=1) if lookup else gated
    k = 4
    spec = _assert_lossless(target, proposer, 0 if tree else k, tree=tree)
    if tree is None:
        drafted = sum(o.stats.draft_tokens for o in spec)
        rounds = sum(o.stats.rounds for o in spec)
        if lookup == 0:
            assert 0 < drafted < k * rounds, (drafted, rounds)


# --- EAGLE-3 with prompt lookup grafted in -------------------------------------------------------


def _hybrid(target: Transformer, lookup_tokens: int = 3, min_ngram: int = 1) -> HybridProposer:
    head = Eagle3Proposer(random_eagle3(target, seed=3), (1, 3, 4))
    return HybridProposer(head, lookup_tokens, min_ngram=min_ngram)


@pytest.mark.parametrize(
    ("k", "tree"), [(1, None), (3, None), (0, TreeConfig(depth=3, top_k=2, num_nodes=5))]
)
def test_hybrid_is_lossless(target: Transformer, k: int, tree: TreeConfig | None) -> None:
    # A random head rarely agrees with the target and unigram matches often mislead: grafts are
    # verified, mostly rejected, sometimes accepted, and the output never changes.
    spec = _assert_lossless(target, _hybrid(target), k, tree=tree)
    assert sum(o.stats.accepted_tokens for o in spec) > 0


@pytest.mark.parametrize(
    ("k", "tree"), [(1, None), (2, None), (0, TreeConfig(depth=2, top_k=2, num_nodes=4))]
)
def test_hybrid_accepts_what_the_context_repeats(k: int, tree: TreeConfig | None) -> None:
    # On a cycle lookup is always right: each round accepts the head's drafts that happen to be
    # right and then the whole graft of 3, whatever the random head drafted. Alone the head
    # accepts next to nothing.
    bigram, prompts = cycling_target(PROMPTS, V)
    params = _params([25, 30, 31])
    head = Eagle3Proposer(random_eagle3(bigram, seed=3), (1, 2, 2))
    alone = _assert_lossless(bigram, head, k, prompts, params, tree)
    both = _assert_lossless(bigram, HybridProposer(head, 3), k, prompts, params, tree)
    for a, b in zip(alone, both, strict=True):
        assert b.stats.rounds < a.stats.rounds
        # every round but the last few (the request's own end cuts them) accepts >= 3 tokens
        assert b.stats.accepted_tokens >= 3 * (b.stats.rounds - 2)


@pytest.mark.parametrize(
    ("drafts", "chain"),
    [
        ([[]], True),  # no drafts: the graft hangs from the root, a chain
        ([[3]], True),  # the lookup goes on from the draft: a chain of 1 + 2
        ([[3, 4]], True),
        ([[9]], False),  # it does not: a branch under the root
        ([[3], [9]], False),  # one row of two continues: a tree for both
        ([[3], [3]], True),
    ],
)
def test_a_graft_that_continues_a_chain_stays_a_chain(
    target: Transformer, drafts: list[list[int]], chain: bool
) -> None:
    """Rounds whose lookup continues the drafted chain verify a chain (cheaper than a tree's mask,
    walk and cache gather); the tokens, depths and root paths are graft_chain's all the same."""
    hybrid = _hybrid(target, lookup_tokens=2, min_ngram=2)
    B = len(drafts)
    history = torch.tensor([[1, 2, 3, 4, 5, 6, 1]] * B)  # root 2 after ... 1: "1 2" -> 3 4 5
    state = hybrid.lookup.start(history, torch.tensor([2] * B), (), [7] * B, 64)
    tree = chain_tree(torch.tensor([2] * B), torch.tensor(drafts, dtype=torch.long).view(B, -1))
    got = hybrid.graft(HybridState(None, state), tree, room=16)
    width = tree.max_depth + 2
    want = graft_chain(tree, torch.tensor([[3, 4, 5, 6][:width]] * B), 2)
    assert got.is_chain == chain
    for name in ("tokens", "parents", "depth", "mask", "paths"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_a_graft_that_would_leave_the_drafts_looks_up_what_follows_them(
    target: Transformer,
) -> None:
    """Where the continuation of the history's suffix leaves the head's draft (or there is
    none), the graft is what followed the suffix with the draft appended, hung below the draft:
    the round stays a chain. Row 0: "5 6 7" was followed by 1 2 9, but the head drafts 3, and
    "7 3" was followed by 8 4 0; row 1: the same history, a draft nothing followed (6): the
    suffix's own continuation as a branch of the root, a tree for both rows."""
    hybrid = _hybrid(target, lookup_tokens=3, min_ngram=2)
    history = [7, 3, 8, 4, 0, 5, 6, 7, 1, 2, 9, 5, 6]
    for drafts, want_chain, want_tokens in (
        ([[3]], True, [[7, 3, 8, 4, 0]]),
        ([[1]], True, [[7, 1, 2, 9, 5]]),  # the suffix's continuation goes on from the draft
        ([[3], [6]], False, [[7, 3, 8, 4, 0], [7, 6, 1, 2, 9]]),
    ):
        B = len(drafts)
        ids = torch.tensor([history] * B)
        state = hybrid.lookup.start(ids, torch.tensor([7] * B), (), [len(history)] * B, 64)
        tree = chain_tree(torch.tensor([7] * B), torch.tensor(drafts))
        got = hybrid.graft(HybridState(None, state), tree, room=16)
        assert got.is_chain == want_chain
        assert got.tokens.tolist() == want_tokens
        if not want_chain:  # row 1's branch hangs from the root, row 0's below its draft
            assert got.parents.tolist() == [[-1, 0, 1, 2, 3], [-1, 0, 0, 2, 3]]


def test_hybrid_refuses_no_lookup_tokens(target: Transformer) -> None:
    with pytest.raises(ValueError, match="lookup_tokens"):
        _hybrid(target, lookup_tokens=0)


def _index(history: list[int], max_ngram: int = 3, min_ngram: int = 1) -> NgramIndex:
    index = NgramIndex(min_ngram, max_ngram)
    index.extend(history)
    return index


@pytest.mark.parametrize(
    ("history", "k", "want"),
    [
        ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),  # n = 2 suffix [1, 2] at 0
        ([1, 2, 3, 9, 2, 3, 5, 1, 2, 3], 2, [9, 2]),  # n = 3 wins over the later n = 2 match
        ([4, 7, 1, 4, 8, 2, 4], 2, [8, 2]),  # n = 1: the most recent earlier 4, not the first
        ([7, 8, 7, 8], 3, [7, 8, 7]),  # runs past the end: continues into its own proposal
        ([5, 5], 4, [5, 5, 5, 5]),  # overlapping match
        ([1, 2, 3], 2, [3, 3]),  # no match: the last token repeated
        ([6], 3, [6, 6, 6]),  # just a root
    ],
)
def test_ngram_match(history: list[int], k: int, want: list[int]) -> None:
    assert _index(history).propose(k) == want


def test_ngram_sizes_bound_the_match() -> None:
    history = [1, 2, 3, 9, 2, 3, 5, 1, 2, 3]
    assert _index(history, max_ngram=2).propose(2) == [5, 1]  # latest earlier [2, 3] is at 4
    assert _index([1, 2, 3, 1], min_ngram=2).propose(2) == [1, 1]  # n = 1 would match [1] at 0
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupProposer(max_ngram=1, min_ngram=2)


def _naive(history: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix = history[-n:]
        for i in range(len(history) - n - 1, -1, -1):
            if len(history) > n and history[i : i + n] == suffix:
                seq = list(history)
                for j in range(k):
                    seq.append(seq[i + n + j])
                return seq[len(history) :]
    return [history[-1]] * k


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=40),
    st.lists(st.integers(0, 4), max_size=10),
    st.integers(1, 6),
    st.integers(1, 4),
)
def test_incremental_index_matches_a_naive_search(
    history: list[int], more: list[int], k: int, max_ngram: int
) -> None:
    index = _index(history, max_ngram)
    assert index.propose(k) == _naive(history, k, max_ngram, 1)
    index.extend(more)  # catch-up appends to a live index
    assert index.propose(k) == _naive(history + more, k, max_ngram, 1)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=30),
    st.lists(st.integers(0, 3), min_size=1, max_size=5),
    st.integers(1, 5),
    st.integers(1, 4),
)
def test_a_lookup_after_drafts_is_the_lookup_of_the_history_they_would_make(
    history: list[int], after: list[int], k: int, max_ngram: int
) -> None:
    """find(k, after): what `find` would give had the drafts been appended, including matches
    that reach into them and the history's own last n-gram, without indexing them."""
    index = _index(history, max_ngram)
    want = _naive(history + after, k, max_ngram, 1)
    found = index.find(k, after)
    assert (found if found is not None else [after[-1]] * k) == want
    assert index.tokens == history  # the drafts stay out of the index
    assert index.find(k) == _index(history, max_ngram).find(k)


def test_lookup_proposer_tracks_rows_through_rounds() -> None:
    proposer = PromptLookupProposer(max_ngram=2)
    prompts = torch.tensor([[1, 2, 3, 4, 1], [8, 9, 0, 0, 0]])
    state = proposer.start(prompts, torch.tensor([2, 8]), [], [5, 2], 32)
    # Row 0: [1 2 3 4 1 2] -> [3 4 1]; row 1: [8 9 8] -> suffix [8] at 0 -> [9 8 9].
    assert proposer.propose(state, 3).tolist() == [[3, 4, 1], [9, 8, 9]]
    # Row 0 accepts 3 and 4, root 7; row 1 accepts nothing, root 5.
    state = proposer.catch_up(state, torch.tensor([[3, 4, 7], [5, 0, 0]]), [], [3, 1])
    assert state.rows[0].tokens == [1, 2, 3, 4, 1, 2, 3, 4, 7]
    assert state.rows[1].tokens == [8, 9, 8, 5]
    state = proposer.select_rows(state, [1])
    assert proposer.propose(state, 2).tolist() == [[5, 5]]


# --- both proposers ------------------------------------------------------------------------------

PROPOSERS = {
    "self-draft": lambda t: DraftModelProposer(t, target_vocab_size=V),
    "small-draft": lambda t: DraftModelProposer(
        tiny_target(7, vocab=V, layers=2, hidden=32), target_vocab_size=V
    ),
    "lookup": lambda t: PromptLookupProposer(),
    "eagle3+lookup": lambda t: _hybrid(t),
}


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_context_limit_shrinks_the_last_rounds(target: Transformer, name: str) -> None:
    # A 24-token context: rounds near the end draft fewer than k tokens (or none), and the rows
    # stop at the context limit exactly as plain decoding does.
    short = Transformer(dataclasses.replace(target.cfg, max_position=24)).eval()
    short.load_state_dict(target.state_dict())
    short.requires_grad_(False)
    spec = _assert_lossless(short, PROPOSERS[name](short), 4, params=_params([40, 40, 40]))
    assert [len(p) + len(o.token_ids) for p, o in zip(PROMPTS, spec, strict=True)] == [24] * 3


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_sampled_rows_repeat_and_greedy_rows_stay_exact(target: Transformer, name: str) -> None:
    params = [
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=12, ignore_eos=True),
    ]
    a = _spec(target, PROPOSERS[name](target), 3, PROMPTS[:2], params)
    b = _spec(target, PROPOSERS[name](target), 3, PROMPTS[:2], params)
    assert a[0].token_ids == b[0].token_ids
    plain = collect_outputs(generate_stream(target, NullTokenizer(), PROMPTS[1:2], params[1:]))
    assert a[1].token_ids == plain[0].token_ids
