"""An oracle proposer for tests: drafts the target's own greedy continuation, known in advance,
optionally corrupted, so tests control the acceptance rate. Duck-types Eagle3Proposer."""

from __future__ import annotations

import torch

from eaglespec.tree import DraftTree, build_tree


class OracleProposer:
    """Every `wrong_every`-th draft position gets a wrong token (0 = never)."""

    capture: tuple[int, ...] = (1,)

    def __init__(self, sequences: list[list[int]], vocab: int, wrong_every: int = 0) -> None:
        self.sequences = sequences  # full greedy sequences (prompt + continuation) per row
        self.vocab = vocab
        self.wrong_every = wrong_every

    def start(self, prompt_ids, roots, aux, counts, capacity):
        return {"rows": list(range(len(counts))), "len": list(counts)}

    def catch_up(self, state, tokens, aux, counts):
        state["len"] = [n + c for n, c in zip(state["len"], counts, strict=True)]
        return state

    def propose(self, state, k):
        out = []
        for row, n in zip(state["rows"], state["len"], strict=True):
            seq = self.sequences[row]
            toks = [seq[n + 1 + j] if n + 1 + j < len(seq) else 0 for j in range(k)]
            if self.wrong_every:
                toks = [
                    (t + 1) % self.vocab if (n + j) % self.wrong_every == 0 else t
                    for j, t in enumerate(toks)
                ]
            out.append(toks)
        return torch.tensor(out, dtype=torch.long)

    def select_rows(self, state, rows):
        return {key: [state[key][r] for r in rows] for key in state}

    def concat(self, states):
        return {key: [x for s in states for x in s[key]] for key in states[0]}

    def propose_tree(self, state, roots, shape) -> DraftTree:
        """A ladder: at every depth a wrong sibling first, then the right token, whose children are
        the next rung. Accepted paths skip every other node, so the target cache must gather
        non-contiguous entries. Uses shape.depth rungs (num_nodes and top_k are ignored)."""
        right = self.propose(state, shape.depth)  # (B, depth)
        B, D = right.shape
        dev = right.device  # a subclass may draft on a GPU (tests/test_gpu.py)
        tokens, parents = [roots], [torch.full((B,), -1, device=dev)]
        parent = torch.zeros(B, dtype=torch.long, device=dev)
        for d in range(D):
            wrong = (right[:, d] + 1) % self.vocab
            tokens += [wrong, right[:, d]]
            parents += [parent, parent]
            parent = torch.full((B,), 2 + 2 * d, device=dev)
        return build_tree(
            torch.stack(tokens, 1), torch.stack(parents, 1), max_depth=D, max_children=2
        )
