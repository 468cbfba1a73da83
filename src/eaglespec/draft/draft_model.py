"""Classic two-model speculative decoding: a small model of the same family (same tokenizer, e.g.
Qwen2.5-Coder-0.5B for the 1.5B) drafts greedy chains for the target.

Dims: B batch rows, T new tokens, A catch-up tokens, k draft tokens, V vocab.

Alignment. The draft keeps its own KV cache holding the target's committed tokens plus the current
root (the token the target just chose, which the target itself has not cached yet), so its logits
at the root already give the first draft token. Worked example, prompt x0 x1 x2, root r sampled by
the target, k = 3:

    start       draft runs x0 x1 x2 r (commits 4 entries; target has 3); argmax at r -> d1
    propose     d1 is known; feed d1 -> d2, feed d2 -> d3 (scratch, truncated back) -> d1 d2 d3
    verify      the target runs r d1 d2 d3, accepts d1, samples y; target keeps r d1 (5 entries)
    catch up    draft runs d1 y (the engine's `tokens`: accepted then next root), commits both
                (6 entries = target's 5 + root y); argmax at y -> the next round's d1

Cost per round: k draft forwards of the small model (k - 1 single-token proposal steps plus one
catch-up over accepted + 1 <= k + 1 tokens), then the target's one verification forward of k + 1
tokens. Feeding the root in the catch-up rather than at the start of the proposal saves a forward
per round over the textbook schedule (k proposal steps + a separate catch-up).

Drafting never samples: draft tokens are argmax picks, so the verifier treats each as a point mass
(q one-hot) and stays lossless for sampled rows too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eaglespec.cache import KVCache
from eaglespec.errors import ModelLoadError
from eaglespec.model.llama import ForwardOutput, Transformer


@dataclass
class DraftModelState:
    cache: KVCache  # the draft's KV cache: the target's committed tokens + the current root
    first: torch.Tensor  # (B,) int64 the draft's argmax after the root: the next first draft token

    def select_rows(self, rows: Sequence[int]) -> DraftModelState:
        idx = torch.tensor(list(rows), device=self.first.device)
        return DraftModelState(self.cache.select_rows(rows), self.first[idx])

    @staticmethod
    def concat(parts: Sequence[DraftModelState]) -> DraftModelState:
        return DraftModelState(
            KVCache.concat([p.cache for p in parts]), torch.cat([p.first for p in parts])
        )


class DraftModelProposer:
    """Greedy chains of k tokens from a small draft Transformer sharing the target's vocabulary.

    The caller guarantees the two models share a tokenizer; here only the vocabulary sizes are
    checked (draft ids index the target's embedding, and a size mismatch almost always means a
    different tokenizer)."""

    capture: tuple[int, ...] = ()  # the draft reads tokens only, no target states

    def __init__(self, model: Transformer, *, target_vocab_size: int) -> None:
        draft_vocab = model.cfg.vocab_size
        if draft_vocab != target_vocab_size:
            raise ModelLoadError(
                f"draft model vocabulary ({draft_vocab} tokens) differs from the target's "
                f"({target_vocab_size} tokens): the two models must share a tokenizer"
            )
        self.model = model

    def start(
        self,
        prompt_ids: torch.Tensor,  # (B, T) right-padded prompts
        roots: torch.Tensor,  # (B,) the target's first sampled tokens
        aux: Sequence[torch.Tensor],  # unused: capture is ()
        counts: Sequence[int],  # prompt length per row
        capacity: int,  # the target's cache slots per row
    ) -> DraftModelState:
        """Prefill prompt + root in one ragged forward."""
        B, T = prompt_ids.shape
        dev = prompt_ids.device
        n = torch.tensor(list(counts), device=dev)[:, None]  # (B, 1) prompt lengths
        # Row b gets its root at column counts[b]: prompt [5, 6] + pad, root 9 -> [5, 6, 9, pad].
        ids = torch.cat([prompt_ids, prompt_ids[:, :1]], 1).scatter(1, n, roots[:, None])
        # One slot more than the target: the draft also holds the root the target has not cached.
        cache = self.model.new_cache(B, capacity + 1)
        positions = torch.arange(T + 1, device=dev).expand(B, T + 1)
        return self._advance(cache, ids, positions, [c + 1 for c in counts])

    def propose(self, state: DraftModelState, k: int) -> torch.Tensor:
        """(B, k) draft tokens. The k - 1 proposal steps write scratch entries past the committed
        length and are forgotten afterwards (the cache is truncated back)."""
        cache = state.cache
        committed = list(cache.lengths)
        token = state.first  # (B,)
        drafts = [token]
        for _ in range(k - 1):
            # Positions equal cache slots: the draft runs no tree.
            positions = torch.tensor(cache.lengths, device=token.device)[:, None]  # (B, 1)
            out: ForwardOutput = self.model(token[:, None], positions, cache)
            cache.advance([1] * len(committed))
            token = out.logits[:, -1].argmax(-1)
            drafts.append(token)
        cache.truncate(committed)
        return torch.stack(drafts, dim=1)[:, :k]

    def catch_up(
        self,
        state: DraftModelState,
        tokens: torch.Tensor,  # (B, A) accepted draft tokens then the next root, right-padded
        aux: Sequence[torch.Tensor],  # unused: capture is ()
        counts: Sequence[int],  # accepted + 1 per row
    ) -> DraftModelState:
        """Commit the accepted drafts and the next root (the previous root is already cached)."""
        B, A = tokens.shape
        start = torch.tensor(state.cache.lengths, device=tokens.device)[:, None]  # (B, 1)
        positions = start + torch.arange(A, device=tokens.device)  # (B, A)
        return self._advance(state.cache, tokens, positions, counts)

    def select_rows(self, state: DraftModelState, rows: Sequence[int]) -> DraftModelState:
        return state.select_rows(rows)

    def concat(self, states: Sequence[DraftModelState]) -> DraftModelState:
        return DraftModelState.concat(states)

    def _advance(
        self,
        cache: KVCache,
        tokens: torch.Tensor,  # (B, T) right-padded
        positions: torch.Tensor,  # (B, T)
        counts: Sequence[int],  # real tokens per row; the rest is padding written to scratch
    ) -> DraftModelState:
        """Run the ragged batch, commit counts[b] entries per row, keep the argmax at each row's
        last real token."""
        last = torch.tensor(list(counts), device=tokens.device)[:, None] - 1  # (B, 1)
        out: ForwardOutput = self.model(tokens, positions, cache, logit_index=last)
        cache.advance(counts)
        return DraftModelState(cache, out.logits[:, 0].argmax(-1))
