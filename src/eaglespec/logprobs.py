"""Log-probabilities of generated tokens, as OpenAI's API reports them: the target model's own
distribution, the log-softmax of its raw logits (before repetition penalty, temperature and the
top-k / top-p / min-p filters; vLLM's default), for the chosen token and the `top` most likely.

Speculative decoding reports exactly these too: token j of a round was chosen from the target's
logits at the j-th node of the accepted path, the same logits plain decoding would compute.

Dims: any leading shape (...), V vocabulary, K = top.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability, host side."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


@dataclass(frozen=True, slots=True)
class LogprobTensors:
    chosen: torch.Tensor  # (...) fp32 log p(chosen token)
    top_ids: torch.Tensor  # (..., K) int64, most likely first
    top_logprobs: torch.Tensor  # (..., K) fp32


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> LogprobTensors:
    """logits (..., V), tokens (...) int64 -> their log-probabilities and the `top` best."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (..., V)
    chosen = lp.gather(-1, tokens[..., None]).squeeze(-1)  # (...)
    values, ids = lp.topk(top, dim=-1)  # (..., K); K = 0 gives empty tensors
    return LogprobTensors(chosen, ids, values)


def to_host(
    t: LogprobTensors, tokens: list[list[int]], tops: list[int]
) -> list[list[TokenLogprob]]:
    """Per row b, the first len(tokens[b]) positions of (B, N) tensors, each with its row's own
    number of alternatives `tops[b]` (<= K)."""
    chosen = t.chosen.tolist()  # sync: the logprobs, only when a request asked for them
    ids = t.top_ids.tolist()
    values = t.top_logprobs.tolist()
    return [
        [
            TokenLogprob(
                tid, chosen[b][j], tuple(zip(ids[b][j][:k], values[b][j][:k], strict=True))
            )
            for j, tid in enumerate(row)
        ]
        for b, (row, k) in enumerate(zip(tokens, tops, strict=True))
    ]
