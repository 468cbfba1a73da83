"""After a speculation round, both caches equal a fresh prefill of the accepted sequence: the
target's K/V for prompt + accepted tokens, and the EAGLE-3 head's K/V (and its next-step output)
for the pairs (x_{p+1}, g_p) computed from the target's own states of that sequence."""

from __future__ import annotations

import pytest
import torch

from eaglespec import engine
from eaglespec.config import SamplingParams
from eaglespec.draft.loader import random_eagle3
from eaglespec.draft.proposer import DraftState, Eagle3Proposer
from eaglespec.engine import Prefill, speculate_round
from eaglespec.generate import generate_stream
from eaglespec.model import w4a8
from eaglespec.model.llama import Transformer
from eaglespec.model.quant import quantize_model
from eaglespec.requests import collect_outputs, new_states
from eaglespec.tree import graft_on_chain
from helpers import NullTokenizer, tiny_target

CAPTURE = (1, 3, 4)
PROMPTS = [[5, 17, 33, 2, 8], [9, 1, 4]]
PARAMS = [SamplingParams(max_tokens=12, ignore_eos=True)] * 2
# Same math in other chunkings (a round's T tokens vs one prefill): fp32 rounding differs slightly.
TOL = {"atol": 1e-4, "rtol": 1e-4}


class _HalfRightProposer(Eagle3Proposer):
    """The real head and its cache bookkeeping, but chains whose first `right` tokens are the
    target's greedy continuation and the rest wrong, so a known number gets accepted."""

    def __init__(self, head, continuations: list[list[int]], right: list[int]) -> None:
        super().__init__(head, CAPTURE)
        self.continuations = continuations  # per row, starting after the current root
        self.right = right

    def propose(self, state: DraftState, k: int) -> torch.Tensor:
        super().propose(state, k)  # run the real scratch steps too (they must leave no trace)
        rows = []
        for cont, r in zip(self.continuations, self.right, strict=True):
            rows.append([cont[j] if j < r else (cont[j] + 1) % 64 for j in range(k)])
        return torch.tensor(rows)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_target(0, vocab=64, hidden=32, max_position=128)


def _greedy(target: Transformer) -> list[list[int]]:
    """PROMPTS' plain greedy tokens under PARAMS."""
    plain = collect_outputs(generate_stream(target, NullTokenizer(), PROMPTS, PARAMS))
    return [o.token_ids for o in plain]


def _started(target: Transformer, proposer: Eagle3Proposer) -> engine.SpecBatch:
    """PROMPTS prefilled whole in one forward, the proposer started: the batch the rounds run."""
    seqs = new_states(PROMPTS, PARAMS, NullTokenizer(), 128, target.device)
    prefill = Prefill(target, proposer, PROMPTS, PARAMS, seqs, 32, chunk=None, started=0.0)
    prefill.step()  # the whole prompts in one forward
    return prefill.finish().batch


def test_both_caches_equal_a_fresh_prefill(target: Transformer) -> None:
    prompts, greedy = PROMPTS, _greedy(target)
    head = random_eagle3(target, seed=1)
    right = [3, 1]  # row 0 accepts 3 of 4 drafts, row 1 accepts 1
    proposer = _HalfRightProposer(head, [g[1:] for g in greedy], right)
    batch = _started(target, proposer)
    out = speculate_round(target, proposer, batch, num_draft=4, tree=None)
    assert out.accepted == right
    for row, g in enumerate(greedy):
        assert out.tokens[row] == g[1 : 2 + right[row]]  # accepted + next root
    # the sequences: prompt, first root, accepted drafts; then each row's next root
    _assert_caches_prefill(target, head, batch, prompts, greedy, [1 + r for r in right])


def test_plain_rounds_then_a_drafting_round_leave_both_caches_as_a_prefill(
    target: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rounds that draft nothing (greedy rows, no logprobs) take the plain decoding step, not
    the verification: their tokens are the greedy ones, and the head catch-ups they leave pending
    are fed by the next drafting round, after which both caches again equal a fresh prefill."""
    prompts, greedy = PROMPTS, _greedy(target)
    head = random_eagle3(target, seed=1)
    right = [2, 1]
    proposer = _HalfRightProposer(head, [g[4:] for g in greedy], right)  # after three roots
    batch = _started(target, proposer)
    verified: list[int] = []  # one entry per row walked by the (host) greedy verification
    real = engine.verify_greedy_host
    monkeypatch.setattr(engine, "verify_greedy_host", lambda *a: verified.append(1) or real(*a))
    for j in range(3):
        out = speculate_round(target, proposer, batch, num_draft=0, tree=None)
        assert out.tokens == [[g[1 + j]] for g in greedy] and out.accepted == [0, 0]
        assert out.sources == [["target"], ["target"]] and out.drafted == 0
    assert not verified and len(batch.draft.pending) == 3
    assert batch.cache.lengths == [len(p) + 3 for p in prompts]
    out = speculate_round(target, proposer, batch, num_draft=3, tree=None)
    assert verified == [1, 1] and out.accepted == right and not batch.draft.pending
    _assert_caches_prefill(target, head, batch, prompts, greedy, [4 + r for r in right])


def _assert_caches_prefill(
    target: Transformer,
    head: torch.nn.Module,
    batch: engine.SpecBatch,
    prompts: list[list[int]],
    greedy: list[list[int]],
    taken: list[int],  # per row: greedy tokens in the target's cache after the prompt
) -> None:
    """Both caches of `batch` equal a fresh prefill of each row's prompt + its first `taken`
    greedy tokens (the head's: the pairs (x_{p+1}, g_p), x_n being the next root)."""
    for row, (prompt, g) in enumerate(zip(prompts, greedy, strict=True)):
        seq = prompt + g[: taken[row]]
        n = len(seq)
        fresh = target.new_cache(1, 32)
        ref = target(torch.tensor([seq]), torch.arange(n)[None], fresh, capture=CAPTURE)
        assert batch.cache.lengths[row] == n
        torch.testing.assert_close(batch.cache.k[:, row, :, :n], fresh.k[:, 0, :, :n], **TOL)
        torch.testing.assert_close(batch.cache.v[:, row, :, :n], fresh.v[:, 0, :, :n], **TOL)
        nxt = torch.tensor([seq[1:] + [g[taken[row]]]])
        head_cache = head.new_cache(1, 32)
        hd = head(nxt, head.combine(ref.hidden), torch.arange(n)[None], head_cache)
        state = batch.draft
        assert state.cache.lengths[row] == n
        torch.testing.assert_close(state.cache.k[:, row, :, :n], head_cache.k[:, 0, :, :n], **TOL)
        torch.testing.assert_close(state.logits[row], hd.logits[0, -1], **TOL)
        torch.testing.assert_close(state.prenorm[row], hd.prenorm[0, -1], **TOL)


class _GraftingHalfRight(_HalfRightProposer):
    """_HalfRightProposer's chains with a lookup-like continuation of the root grafted in
    (tree.graft_on_chain, as HybridProposer builds it on the CPU): the target's greedy
    continuation for rows in `graft_right`, wrong tokens for the others."""

    graft_tokens = 2

    def __init__(self, head, continuations, right, graft_right: list[bool]) -> None:
        super().__init__(head, continuations, right)
        self.graft_right = graft_right

    def graft(self, state: DraftState, tree, room: int):  # type: ignore[no-untyped-def]
        width = tree.max_depth + self.graft_tokens
        chains = [
            cont[:width] if ok else [(t + 2) % 64 for t in cont[:width]]
            for cont, ok in zip(self.continuations, self.graft_right, strict=True)
        ]
        return graft_on_chain(tree.tokens.tolist(), chains, self.graft_tokens, torch.device("cpu"))


@pytest.mark.parametrize(
    ("right", "graft_right", "in_order"),
    [
        ([1, 0], [False, False], True),  # the head's first draft, or nothing: nodes 0 .. a
        ([0, 2], [True, False], False),  # row 0 through the graft: its path is gathered
        ([1, 0], [True, True], False),
    ],
)
def test_a_tree_round_commits_in_place_or_gathered_as_a_prefill(
    target: Transformer,
    monkeypatch: pytest.MonkeyPatch,
    right: list[int],
    graft_right: list[bool],
    in_order: bool,
) -> None:
    """A chain with a graft branching off is a tree; where every row accepted its first nodes in
    order (the head's drafts precede the graft) the round commits in place as a chain does, else
    each row's path is gathered. Either way both caches equal a fresh prefill."""
    prompts, greedy = PROMPTS, _greedy(target)
    head = random_eagle3(target, seed=1)
    proposer = _GraftingHalfRight(head, [g[1:] for g in greedy], right, graft_right)
    batch = _started(target, proposer)
    gathered: list[int] = []
    real = engine._path_nodes
    monkeypatch.setattr(engine, "_path_nodes", lambda *a: gathered.append(1) or real(*a))
    out = speculate_round(target, proposer, batch, num_draft=3, tree=None)
    # a row whose graft is right accepts the head's right drafts, then the graft's 2 nodes
    want = [r + 2 * ok for r, ok in zip(right, graft_right, strict=True)]
    assert out.accepted == want
    assert bool(gathered) != in_order
    for row, g in enumerate(greedy):
        assert out.tokens[row] == g[1 : 2 + want[row]]
    _assert_caches_prefill(target, head, batch, prompts, greedy, [1 + a for a in want])


def test_a_round_without_grafts_is_a_plain_step(
    target: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`graft=False` (the adaptive policy's plain arm beside lookup's candidates alone) keeps a
    grafting proposer's candidates out: a zero-draft round is then the plain decoding step, one
    token a row, nothing verified; with the graft, the same round lands the graft's tokens."""
    prompts, greedy = PROMPTS, _greedy(target)
    head = random_eagle3(target, seed=1)
    proposer = _GraftingHalfRight(head, [g[1:] for g in greedy], [0, 0], [True, True])
    batch = _started(target, proposer)
    verified: list[int] = []
    real = engine.verify_greedy_host
    monkeypatch.setattr(engine, "verify_greedy_host", lambda *a: verified.append(1) or real(*a))
    out = speculate_round(target, proposer, batch, num_draft=0, tree=None, graft=False)
    assert out.tokens == [g[1:2] for g in greedy] and out.accepted == [0, 0] and not verified
    assert out.sources == [["target"], ["target"]]
    proposer.continuations = [g[2:] for g in greedy]  # after the new roots
    out = speculate_round(target, proposer, batch, num_draft=0, tree=None)  # grafted
    assert out.accepted == [2, 2] and verified == [1, 1]
    assert out.tokens == [g[2:5] for g in greedy]
    _assert_caches_prefill(target, head, batch, prompts, greedy, [4, 4])


@pytest.mark.parametrize("chunk", [None, 2])
def test_prompts_of_different_lengths_prefill_row_by_row_as_alone(chunk: int | None) -> None:
    """A group of prompts of different lengths is prefilled one row at a time (engine.Prefill),
    whole or in chunks: the target computes only the prompts' own positions (no padding), and,
    at the commands' default precision (bf16 w4a8, whose kernels compute every row the same
    whatever the others), the cache, the first logits and the head's start are each row's
    prefill alone, bit for bit. The head's start goes row by row too."""
    missing = w4a8.available()
    if missing is not None:
        pytest.skip(f"the w4a8 kernel does not run here: {missing}")
    target = quantize_model(tiny_target(3, vocab=96, hidden=128, layers=3).bfloat16(), "w4a8")
    head = quantize_model(random_eagle3(target, seed=1), "w4a8")
    prompts = [[5, 17, 33, 2, 8], [9, 1, 4], [3, 3, 7, 1, 60, 2, 11]]
    params = [SamplingParams(max_tokens=4, ignore_eos=True)] * 3
    rows: list[int] = []
    hook = target.register_forward_pre_hook(lambda _m, a: rows.append(a[0].numel()))
    head_rows: list[int] = []
    feed = head.feed_last  # the proposer's catch-ups and prefill
    head.feed_last = lambda ids, *a: head_rows.append(ids.numel()) or feed(ids, *a)

    def started(group: list[list[int]], chunk: int | None) -> engine.StartedBatch:
        proposer = Eagle3Proposer(head, (1, 1, 2))
        seqs = new_states(group, params[: len(group)], NullTokenizer(), 128, target.device)
        prefill = Prefill(target, proposer, group, params, seqs, 32, chunk=chunk, started=0.0)
        while not prefill.step():
            pass
        return prefill.finish()

    try:
        together = started(prompts, chunk)
        assert sum(rows) == sum(head_rows) == sum(len(p) for p in prompts)  # no padding
        alone = [started([p], None) for p in prompts]
    finally:
        hook.remove()
    for b, (p, solo) in enumerate(zip(prompts, alone, strict=True)):
        n = len(p)
        assert torch.equal(together.logits[b], solo.logits[0])
        assert together.batch.cache.lengths[b] == n
        assert torch.equal(together.batch.cache.k[:, b, :, :n], solo.batch.cache.k[:, 0, :, :n])
        assert torch.equal(together.batch.cache.v[:, b, :, :n], solo.batch.cache.v[:, 0, :, :n])
        draft, solo_draft = together.batch.draft, solo.batch.draft
        assert torch.equal(draft.logits[b], solo_draft.logits[0])
        assert draft.cache.lengths[b] == solo_draft.cache.lengths[0]
        assert torch.equal(draft.cache.k[:, b, :, :n], solo_draft.cache.k[:, 0, :, :n])
        assert torch.equal(draft.prenorm[b], solo_draft.prenorm[0])
