"""Plain (non-speculative) decoding of a batch of requests: ragged prefill, then one token per step.

Each request has its own sampling parameters and generator; finished rows leave the batch (their
cache rows are dropped) so the others do not pay for them. One host sync per step hands the new
tokens back for streaming and stop checks (a second one, only when a request asks for logprobs,
hands back their log-probabilities). Decoding runs under torch.inference_mode, without autograd's
per-op bookkeeping (eager bf16 int4 SmolLM2 decoding on the development CPU, in-process A/B over
3 runs: 46-52 -> 52-57 tok/s; compiled steps within the noise).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from eaglespec.cache import KVCache, compact_order
from eaglespec.config import SamplingParams
from eaglespec.logprobs import TokenLogprob, to_host, token_logprobs
from eaglespec.model.llama import ForwardOutput, Transformer
from eaglespec.requests import RequestState, StreamEvent, account_time, append_token, new_states
from eaglespec.sampling import (
    SamplingTensors,
    apply_repetition_penalty,
    greedy_tokens,
    probs_from_logits,
    sample,
)
from eaglespec.tokenizer import Tokenizer


@torch.inference_mode()  # per resumption of the generator, not leaking into the caller's code
def generate_stream(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
) -> Iterator[StreamEvent]:
    """Yields events as tokens arrive; each request's last event carries its `RequestOutput`."""
    limit = model.cfg.context_limit
    device = model.device
    seqs = new_states(prompts, params, tokenizer, limit, device)
    capacity = min(
        limit, max(len(p) + sp.max_tokens for p, sp in zip(prompts, params, strict=True))
    )
    cache = model.new_cache(len(seqs), capacity)
    st = SamplingTensors.from_params(params, device)
    seen = _seen_mask(prompts, model.cfg.vocab_size, device) if st.any_penalty else None
    eos = set(tokenizer.eos_ids)

    # Greedy rows without a penalty or logprobs take each step's argmax from Transformer.greedy,
    # the logits staying inside its call; the first token comes from the prefill's logits.
    argmax_only = st.all_greedy and seen is None and all(p.logprobs is None for p in params)
    start = time.perf_counter()
    logits = _prefill(model, cache, prompts)
    chosen: torch.Tensor | None = None  # (B,) the step's tokens where Transformer.greedy chose
    active = list(seqs)
    while True:
        if chosen is None:
            tokens = next_tokens(logits, st, seen, [s.generator for s in active])
        else:
            tokens = chosen
        ids = tokens.tolist()  # sync: the step's tokens, for streaming and stop checks
        lps = None if argmax_only else step_logprobs(logits, tokens, ids, active)
        now = time.perf_counter()
        keep = []
        for row, (seq, tid) in enumerate(zip(active, ids, strict=True)):
            account_time(seq.out.stats, start, now)
            lp = None if lps is None else lps[row][0]
            event = append_token(seq, tid, eos, cache.lengths[row] + 1 >= limit, lp)
            yield event
            if event.output is None:
                keep.append(row)
        if not keep:
            return
        if len(keep) < len(active):
            keep = compact_order(len(active), keep)  # rows from the end refill the gaps
            active = [active[r] for r in keep]
            cache = cache.compact(keep)
            rows = torch.tensor(keep, device=device)
            tokens, st = tokens[rows], st.select(rows)
            seen = None if seen is None else seen[rows]
        if seen is not None:
            seen[torch.arange(len(keep), device=device), tokens] = True
        if argmax_only:
            chosen = model.greedy(tokens[:, None], cache)[0][:, 0]  # (B,)
        else:
            positions = torch.tensor(cache.lengths, device=device)[:, None]  # (B, 1)
            logits = model(tokens[:, None], positions, cache).logits[:, 0]  # (B, V)
        cache.advance([1] * len(active))


def step_logprobs(
    logits: torch.Tensor,  # (B, V) the step's raw logits
    tokens: torch.Tensor,  # (B,) the chosen tokens
    ids: list[int],  # the same, on the host
    seqs: Sequence[RequestState],
) -> list[list[TokenLogprob]] | None:
    """Each row's token log-probability (one per row), or None when no request asked."""
    tops = [s.params.logprobs for s in seqs]
    if all(t is None for t in tops):
        return None
    lpt = token_logprobs(logits[:, None], tokens[:, None], max(t or 0 for t in tops))
    return to_host(lpt, [[i] for i in ids], [t or 0 for t in tops])


def pad_right(
    prompts: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, list[int]]:
    """Prompts of different lengths -> (B, T) ids padded with 0 at the end, and the lengths."""
    lengths = [len(p) for p in prompts]
    ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(list(p))
    return ids.to(device), lengths


def _prefill(model: Transformer, cache: KVCache, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Each row's prompt into the cache; returns each row's last-position logits (B, V).
    Prompts of one length go in one forward; of different lengths, one row at a time onto its own
    row of the cache (a one-row view), so no padding is computed (engine.Prefill says why)."""
    ids, lengths = pad_right(prompts, model.device)
    B, T = ids.shape
    if min(lengths) != max(lengths):
        last = []
        for b, n in enumerate(lengths):
            row = cache.row(b)
            positions = torch.arange(n, device=ids.device)[None]
            index = torch.tensor([[n - 1]], device=ids.device)
            last.append(model(ids[b : b + 1, :n], positions, row, logit_index=index).logits[0, 0])
        cache.advance(lengths)
        return torch.stack(last)
    positions = torch.arange(T, device=ids.device).expand(B, T)
    last = torch.tensor([[n - 1] for n in lengths], device=ids.device)  # (B, 1)
    out: ForwardOutput = model(ids, positions, cache, logit_index=last)
    cache.advance(lengths)
    return out.logits[:, 0]


def _seen_mask(prompts: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    seen = torch.zeros(len(prompts), vocab, dtype=torch.bool, device=device)  # (B, V)
    for b, p in enumerate(prompts):
        seen[b, torch.tensor(list(p), device=device)] = True
    return seen


def next_tokens(
    logits: torch.Tensor,
    st: SamplingTensors,
    seen: torch.Tensor | None,
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """logits (B, V) -> tokens (B,)."""
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, st.repetition_penalty)
    if st.all_greedy:
        return greedy_tokens(logits)
    return sample(probs_from_logits(logits, st), generators, greedy=False)
