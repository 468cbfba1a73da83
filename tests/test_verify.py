"""Verification: greedy picks the longest argmax path; sampled verification is lossless.

p = target, q = draft. Deterministic inputs use +-100 logits; distribution tests use many rows
sharing one seeded generator and a chi-square bound at p = 0.001."""

from __future__ import annotations

import torch

from eaglespec.sampling import RowRandom
from eaglespec.tree import build_tree, chain_tree
from eaglespec.verify import verify_greedy, verify_greedy_host, verify_sampled

CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32}  # chi-square critical values, p = 0.001


def _logits_pointing_at(next_tokens: list[list[int]], vocab: int = 8) -> torch.Tensor:
    """(B, N, V) logits whose argmax at node i is next_tokens[b][i]."""
    out = torch.full((len(next_tokens), len(next_tokens[0]), vocab), -100.0)
    for b, row in enumerate(next_tokens):
        for i, tok in enumerate(row):
            out[b, i, tok] = 100.0
    return out


def _tree():
    #   root(0) ─┬─ 3 (1) ── 5 (3)
    #            └─ 4 (2) ── 6 (4)
    tokens = torch.tensor([[0, 3, 4, 5, 6]])
    parents = torch.tensor([[-1, 0, 0, 1, 2]])
    return build_tree(tokens, parents, max_depth=2, max_children=2)


def test_greedy_accepts_second_branch_and_takes_bonus() -> None:
    # target says: after root 4, after node 2 ("4") 6, after node 4 ("6") 7
    r = verify_greedy(_tree(), _logits_pointing_at([[4, 1, 6, 1, 7]]))
    assert r.path.tolist() == [[0, 2, 4]] and r.num_accepted.tolist() == [2]
    assert r.next_token.tolist() == [7] and r.bonus.tolist() == [True]


def test_greedy_rejects_all_children_and_recovers() -> None:
    r = verify_greedy(_tree(), _logits_pointing_at([[2, 0, 0, 0, 0]]))
    assert r.path.tolist() == [[0, -1, -1]] and r.num_accepted.tolist() == [0]
    assert r.next_token.tolist() == [2] and r.bonus.tolist() == [False]


def test_greedy_partial_path() -> None:
    r = verify_greedy(_tree(), _logits_pointing_at([[3, 2, 0, 0, 0]]))
    assert r.path.tolist() == [[0, 1, -1]] and r.next_token.tolist() == [2]


def test_sampled_with_one_hot_targets_equals_greedy() -> None:
    gen = torch.Generator().manual_seed(0)
    accepted = 0
    for _ in range(20):
        B, N, V = 4, 7, 8
        parents = torch.stack(
            [
                torch.tensor(
                    [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, N)]
                )
                for _ in range(B)
            ]
        )
        # siblings carry distinct tokens, as a draft's top-k do (with two equal siblings the
        # walk takes the first and greedy the deeper; the target cannot tell them apart)
        tokens = torch.stack([torch.randperm(V, generator=gen)[:N] for _ in range(B)])
        tree = build_tree(tokens, parents, max_depth=N - 1, max_children=N - 1)
        logits = torch.randn(B, N, V, generator=gen)
        one_hot = torch.zeros(B, N, V).scatter_(2, logits.argmax(-1, keepdim=True), 1.0)
        g = verify_greedy(tree, logits)
        s = verify_sampled(tree, one_hot, RowRandom(gen))
        assert torch.equal(g.num_accepted, s.num_accepted)
        assert torch.equal(g.next_token, s.next_token) and torch.equal(g.bonus, s.bonus)
        accepted += int(g.num_accepted.sum())
    assert accepted >= 10  # the walks went down the trees, not only rejected at the root


def test_greedy_chain_closed_form_equals_the_general_walk() -> None:
    """verify_greedy's chain path (closed form) against the same chain built as a general tree
    (max_children 2, so the mask-and-score walk runs): every field, over random drafts whose
    tokens often match the argmax (small vocabulary), chains of 0 to 4 drafts."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        B, k, V = 5, trial % 5, 3
        chain = chain_tree(
            torch.randint(0, V, (B,), generator=gen), torch.randint(0, V, (B, k), generator=gen)
        )
        general = build_tree(chain.tokens, chain.parents, max_depth=k, max_children=2)
        assert chain.is_chain and not general.is_chain
        logits = torch.randn(B, k + 1, V, generator=gen)
        fast, walk = verify_greedy(chain, logits), verify_greedy(general, logits)
        assert torch.equal(fast.path, walk.path) and torch.equal(fast.last_node, walk.last_node)
        assert torch.equal(fast.num_accepted, walk.num_accepted)
        assert torch.equal(fast.next_token, walk.next_token) and torch.equal(fast.bonus, walk.bonus)


def test_greedy_host_walk_equals_verify_greedy() -> None:
    """The engine's greedy rounds verify on the host (verify_greedy_host, one row's lists):
    the same path, next token and bonus as verify_greedy over random topological trees and
    chains, with a small vocabulary so that walks go deep and siblings often carry equal tokens
    (the deepest accepted node wins, ties at equal depth to the lowest index)."""
    gen = torch.Generator().manual_seed(0)
    deep = 0
    for trial in range(200):
        B, N, V = 3, 1 + trial % 9, 3
        if trial % 3 == 0:
            tree = chain_tree(
                torch.randint(0, V, (B,), generator=gen),
                torch.randint(0, V, (B, N - 1), generator=gen),
            )
        else:
            parents = torch.tensor(
                [[-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, N)]] * B
            )
            tokens = torch.randint(0, V, (B, N), generator=gen)
            tree = build_tree(tokens, parents, max_depth=N - 1, max_children=N - 1)
        logits = torch.randn(B, N, V, generator=gen)
        want = verify_greedy(tree, logits)
        argmax = logits.argmax(-1)
        for b in range(B):
            got = verify_greedy_host(
                tree.tokens[b].tolist(), argmax[b].tolist(), tree.parents[b].tolist()
            )
            path = [n for n in want.path[b].tolist() if n >= 0]
            assert got.path == path, (trial, b)
            assert got.next_token == int(want.next_token[b]) and got.bonus == bool(want.bonus[b])
            deep += len(got.path) > 2
    assert deep >= 20  # many walks accepted two or more nodes


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    n = counts.sum()
    keep = p > 0
    return float((((counts - n * p) ** 2)[keep] / (n * p)[keep]).sum())


def test_acceptance_is_min_one_p_over_q_and_recovery_is_the_residual() -> None:
    """One drafted token x drawn from q: accepted w.p. min(1, p(x)/q(x)); on rejection the
    recovered token follows norm(max(0, p - q))."""
    p = torch.tensor([0.1, 0.5, 0.2, 0.2])
    q = torch.tensor([0.4, 0.1, 0.4, 0.1])
    n, x = 40_000, 2  # draft token 2: p/q = 0.5
    tree = chain_tree(
        torch.zeros(n, dtype=torch.long),
        torch.full((n, 1), x),
        draft_probs=torch.stack([q, q]).expand(n, 2, 4),
    )
    target = torch.stack([p, torch.tensor([0.25] * 4)]).expand(n, 2, 4)
    r = verify_sampled(tree, target, RowRandom(torch.Generator().manual_seed(1)))
    rate = r.num_accepted.float().mean().item()
    assert abs(rate - 0.5) < 0.015
    rejected = r.next_token[r.num_accepted == 0]
    residual = (p - q).clamp(min=0)
    residual /= residual.sum()
    assert _chi2(torch.bincount(rejected, minlength=4).double(), residual.double()) < CHI2_999[3]


def test_tree_sampling_reproduces_the_target_distribution() -> None:
    """Top-3 deterministic children at the root, a grandchild under the first: the first emitted
    token must follow p_root, and the second (given the first was the tree's child c) p_c."""
    V = 6
    gen = torch.Generator().manual_seed(2)
    node_p = torch.softmax(torch.randn(5, V, generator=gen) * 1.5, -1)  # p at each of the 5 nodes
    tokens = torch.tensor([0, 1, 2, 3, 4])
    parents = torch.tensor([-1, 0, 0, 0, 1])
    n = 60_000
    tree = build_tree(tokens.expand(n, 5), parents.expand(n, 5), max_depth=2, max_children=3)
    r = verify_sampled(tree, node_p.expand(n, 5, V), RowRandom(gen))
    first = torch.where(
        r.num_accepted >= 1, tree.tokens[torch.arange(n), r.path[:, 1].clamp(min=0)], r.next_token
    )
    counts = torch.bincount(first, minlength=V).double()
    assert _chi2(counts, node_p[0].double()) < CHI2_999[5]
    # Given the first token is 1 (node 1 accepted), the next emitted token follows p at node 1.
    after_one = r.num_accepted >= 1
    after_one &= r.path[:, 1] == 1
    second = torch.where(
        r.num_accepted[after_one] >= 2,
        torch.full_like(r.next_token[after_one], 4),
        r.next_token[after_one],
    )
    assert _chi2(torch.bincount(second, minlength=V).double(), node_p[1].double()) < CHI2_999[5]


def test_seeded_rows_repeat_bitwise() -> None:
    gen = torch.Generator().manual_seed(3)
    tree = build_tree(
        torch.tensor([[0, 1, 2, 3]] * 3),
        torch.tensor([[-1, 0, 0, 1]] * 3),
        max_depth=2,
        max_children=2,
    )
    probs = torch.softmax(torch.randn(3, 4, 5, generator=gen), -1)

    def run() -> tuple[list[int], list[int]]:
        rng = RowRandom([torch.Generator().manual_seed(s) for s in (7, 8, 9)])
        r = verify_sampled(tree, probs, rng)
        return r.num_accepted.tolist(), r.next_token.tolist()

    assert run() == run()
