"""Plain (non-speculative) decoding of a batch of requests: ragged prefill, then one token per step.

Each request has its own sampling parameters and generator; finished rows leave the batch (their
cache rows are dropped) so the others do not pay for them. One host sync per step hands the new
tokens back for streaming and stop checks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch

from eaglespec.cache import KVCache
from eaglespec.config import SamplingParams
from eaglespec.errors import InvalidRequestError, PromptTooLongError
from eaglespec.model.llama import ForwardOutput, Transformer
from eaglespec.sampling import SamplingTensors, apply_repetition_penalty, probs_from_logits, sample
from eaglespec.textstream import TextStream
from eaglespec.tokenizer import Tokenizer


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int = 0
    prefill_seconds: float = 0.0  # prompt forward up to the first sampled token
    decode_seconds: float = 0.0  # everything after the first token

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: tokens after the first, over the time spent producing them."""
        return (self.new_tokens - 1) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}


@dataclass
class RequestOutput:
    index: int  # position of the request in the batch it came with
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated ids, without a final EOS
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS, stop token or stop string) or "length"
    stats: GenerationStats = field(default_factory=lambda: GenerationStats(0))


@dataclass
class StreamEvent:
    index: int  # which request
    text: str  # newly released text (may be empty while a stop string could still form)
    token_ids: list[int]  # newly generated ids
    output: RequestOutput | None = None  # set on the request's last event


@dataclass
class _Sequence:
    out: RequestOutput
    params: SamplingParams
    stream: TextStream
    generator: torch.Generator | None


def check_prompt(prompt: Sequence[int], limit: int) -> None:
    if not prompt:
        raise InvalidRequestError("empty prompt: at least one token is needed")
    if len(prompt) >= limit:
        raise PromptTooLongError(
            f"prompt has {len(prompt)} tokens; the model's context is {limit}, "
            "so no room is left to generate"
        )


def generate_stream(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
) -> Iterator[StreamEvent]:
    """Yields events as tokens arrive; each request's last event carries its `RequestOutput`."""
    limit = model.cfg.context_limit
    for p in prompts:
        check_prompt(p, limit)
    device = model.device
    seqs = [
        _Sequence(
            out=RequestOutput(i, list(p), stats=GenerationStats(len(p))),
            params=sp,
            stream=TextStream(tokenizer.stream_decoder(p), sp.stop),
            generator=None if sp.seed is None else torch.Generator(device).manual_seed(sp.seed),
        )
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    capacity = min(
        limit, max(len(p) + sp.max_tokens for p, sp in zip(prompts, params, strict=True))
    )
    cache = model.new_cache(len(seqs), capacity)
    st = SamplingTensors.from_params(params, device)
    seen = _seen_mask(prompts, model.cfg.vocab_size, device) if st.any_penalty else None
    eos = set(tokenizer.eos_ids)

    start = time.perf_counter()
    logits = _prefill(model, cache, prompts)
    active = list(seqs)
    while True:
        tokens = _next_tokens(logits, st, seen, [s.generator for s in active])
        ids = tokens.tolist()  # sync: the step's tokens, for streaming and stop checks
        now = time.perf_counter()
        keep = []
        for row, (seq, tid) in enumerate(zip(active, ids, strict=True)):
            _account_time(seq.out.stats, start, now)
            event = _append(seq, tid, eos, cache.lengths[row] + 1 >= limit)
            yield event
            if event.output is None:
                keep.append(row)
        if not keep:
            return
        if len(keep) < len(active):
            active = [active[r] for r in keep]
            cache = cache.select_rows(keep)
            rows = torch.tensor(keep, device=device)
            tokens, st = tokens[rows], st.select(rows)
            seen = None if seen is None else seen[rows]
        if seen is not None:
            seen[torch.arange(len(keep), device=device), tokens] = True
        positions = torch.tensor(cache.lengths, device=device)[:, None]  # (B, 1)
        logits = model(tokens[:, None], positions, cache).logits[:, 0]  # (B, V)
        cache.advance([1] * len(active))


def _prefill(model: Transformer, cache: KVCache, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Right-padded ragged prefill; returns each row's last-position logits (B, V)."""
    device = model.device
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(list(p))
    positions = torch.arange(T)[None].expand(len(prompts), T)
    last = torch.tensor([[len(p) - 1] for p in prompts])  # (B, 1)
    out: ForwardOutput = model(
        ids.to(device), positions.to(device), cache, logit_index=last.to(device)
    )
    cache.advance([len(p) for p in prompts])
    return out.logits[:, 0]


def _seen_mask(prompts: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    seen = torch.zeros(len(prompts), vocab, dtype=torch.bool, device=device)  # (B, V)
    for b, p in enumerate(prompts):
        seen[b, torch.tensor(list(p), device=device)] = True
    return seen


def _next_tokens(
    logits: torch.Tensor,
    st: SamplingTensors,
    seen: torch.Tensor | None,
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """logits (B, V) -> tokens (B,)."""
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, st.repetition_penalty)
    if st.all_greedy:
        return logits.argmax(-1)
    return sample(probs_from_logits(logits, st), generators, greedy=False)


def _account_time(stats: GenerationStats, start: float, now: float) -> None:
    if stats.new_tokens == 0:
        stats.prefill_seconds = now - start
    else:
        stats.decode_seconds = now - start - stats.prefill_seconds


def _append(seq: _Sequence, tid: int, eos: set[int], context_full: bool) -> StreamEvent:
    """Record one sampled token; finish the request when it ends generation."""
    out, sp = seq.out, seq.params
    ends = not sp.ignore_eos and tid in eos or tid in sp.stop_token_ids
    text = ""
    if not ends:
        out.token_ids.append(tid)
        out.stats.new_tokens += 1
        text = seq.stream.push(tid)
    if ends or seq.stream.stopped:
        out.finish_reason = "stop"
    elif len(out.token_ids) >= sp.max_tokens or context_full:
        out.finish_reason = "length"
        text += seq.stream.finish()
    if out.finish_reason == "stop" and not seq.stream.stopped:
        text += seq.stream.finish()
    out.text = seq.stream.text
    new_ids = [] if ends else [tid]
    return StreamEvent(out.index, text, new_ids, out if out.finish_reason else None)
