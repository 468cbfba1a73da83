"""Per-request bookkeeping shared by plain and speculative decoding: outputs, stream events,
stop rules and timing. No tensor math.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from eaglespec.config import SamplingParams
from eaglespec.errors import InvalidRequestError, PromptTooLongError
from eaglespec.logprobs import TokenLogprob
from eaglespec.textstream import TextStream
from eaglespec.tokenizer import Tokenizer


@dataclass
class ShapeStats:
    """The rounds of one draft shape (a policy's arm: "chain1", "tree4,4,16") in a generation."""

    rounds: int = 0
    tokens: int = 0  # tokens the rounds landed: accepted drafts plus each round's bonus token
    seconds: float = 0.0  # their drafting and verification time

    def add(self, rounds: int, tokens: int, seconds: float) -> None:
        self.rounds += rounds
        self.tokens += tokens
        self.seconds += seconds


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int = 0
    prefill_seconds: float = 0.0  # prompt forward up to the first sampled token
    decode_seconds: float = 0.0  # everything after the first token
    # Speculative decoding only (rounds stays 0 for plain decoding):
    rounds: int = 0  # target verification forwards
    accepted_tokens: int = 0  # draft tokens accepted over all rounds
    draft_tokens: int = 0  # draft tokens proposed over all rounds
    accepted_by_position: list[int] = field(default_factory=list)  # [j]: rounds accepting >= j+1
    proposed_by_position: list[int] = field(default_factory=list)  # [j]: rounds proposing >= j+1
    draft_seconds: float = 0.0  # of decode_seconds: drafting and the draft's catch-up
    verify_seconds: float = 0.0  # of decode_seconds: target forwards, verification, host syncs
    # The rounds by the shape a policy chose for them (the adaptive policy's arms), by name.
    shapes: dict[str, ShapeStats] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: tokens after the first, over the time spent producing them."""
        return (self.new_tokens - 1) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def mean_accept_length(self) -> float:
        """Tokens per target verification forward, the bonus or recovered token included."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def accept_rate_by_position(self) -> list[float]:
        return [
            a / p if p else 0.0
            for a, p in zip(self.accepted_by_position, self.proposed_by_position, strict=True)
        ]

    def record_round(
        self,
        proposed: int,
        accepted: int,
        draft_seconds: float = 0.0,
        verify_seconds: float = 0.0,
        shape: str | None = None,
    ) -> None:
        if shape is not None:
            arm = self.shapes.setdefault(shape, ShapeStats())
            arm.add(1, accepted + 1, draft_seconds + verify_seconds)
        self.rounds += 1
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        grow = proposed - len(self.proposed_by_position)
        if grow > 0:
            self.proposed_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for j in range(proposed):
            self.proposed_by_position[j] += 1
            self.accepted_by_position[j] += int(j < accepted)

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {**asdict(self), "tokens_per_second": self.tokens_per_second}
        if self.rounds:
            d["mean_accept_length"] = self.mean_accept_length
            d["accept_rate_by_position"] = self.accept_rate_by_position
        return d


@dataclass
class RequestOutput:
    index: int  # the request's id: its position in the batch it came with, or the caller's id
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated ids, without a final EOS
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS, stop token or stop string) or "length"
    stats: GenerationStats = field(default_factory=lambda: GenerationStats(0))
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when asked for


# How a generated token landed (`Provenance.tokens`):
SOURCES = (
    "draft",  # the proposer drafted it (an EAGLE-3 head, a draft model) and the target accepted it
    "lookup",  # prompt lookup copied it from the context into the head's tree, and it was accepted
    "bonus",  # the target's own token after every draft on the path was accepted
    "corrected",  # the target's own token where it rejected the draft
    "target",  # the target's own token in a round without drafts (prefill, a plain step)
)


@dataclass(frozen=True, slots=True)
class TokenMark:
    text: str  # the text this token released (StreamEvent.text split by token)
    source: str  # one of SOURCES


@dataclass(frozen=True, slots=True)
class Provenance:
    """One event's tokens by how they landed: a speculation round's accepted drafts, then the
    target's own token. The marks' texts concatenate to the event's text; text released by a
    token that is not kept (an EOS flushing held-back text) joins the mark before it."""

    drafted: int  # draft positions the round offered (chain length or tree depth; 0 = none)
    accepted: int  # of them accepted (the round's first `accepted` marks, when all were kept)
    tokens: list[TokenMark]


@dataclass
class StreamEvent:
    index: int  # which request
    text: str  # newly released text (may be empty while a stop string could still form)
    token_ids: list[int]  # newly generated ids
    output: RequestOutput | None = None  # set on the request's last event
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when asked for
    provenance: Provenance | None = None  # speculative generation's events (engine.py)


@dataclass
class RequestState:
    out: RequestOutput
    params: SamplingParams
    stream: TextStream
    generator: torch.Generator | None
    started: float = 0.0  # perf_counter when its prefill began: the origin of its timings


def check_prompt(prompt: Sequence[int], limit: int) -> None:
    if not prompt:
        raise InvalidRequestError("empty prompt: at least one token is needed")
    if len(prompt) >= limit:
        raise PromptTooLongError(
            f"prompt has {len(prompt)} tokens; the model's context is {limit}, "
            "so no room is left to generate"
        )


def collect_outputs(events: Iterable[StreamEvent]) -> list[RequestOutput]:
    """Run an event stream to the end; each request's final output, in request order."""
    outputs = {e.index: e.output for e in events if e.output is not None}
    return [outputs[i] for i in sorted(outputs)]


def new_states(
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    tokenizer: Tokenizer,
    limit: int,
    device: torch.device,
    indices: Iterable[int] | None = None,
) -> list[RequestState]:
    """`indices` name the requests in their events (default 0 .. n-1, the batch order)."""
    for p in prompts:
        check_prompt(p, limit)
    ids = range(len(prompts)) if indices is None else list(indices)
    return [
        RequestState(
            out=RequestOutput(
                i,
                list(p),
                stats=GenerationStats(len(p)),
                logprobs=None if sp.logprobs is None else [],
            ),
            params=sp,
            stream=TextStream(tokenizer.stream_decoder(p), sp.stop),
            generator=None if sp.seed is None else torch.Generator(device).manual_seed(sp.seed),
        )
        for i, p, sp in zip(ids, prompts, params, strict=True)
    ]


def account_time(stats: GenerationStats, start: float, now: float) -> None:
    if stats.new_tokens == 0:
        stats.prefill_seconds = now - start
    else:
        stats.decode_seconds = now - start - stats.prefill_seconds


def append_token(
    seq: RequestState,
    tid: int,
    eos: set[int],
    context_full: bool,
    logprob: TokenLogprob | None = None,
) -> StreamEvent:
    """Record one sampled token (and its log-probability, when the request asked for them);
    finish the request when it ends generation."""
    out, sp = seq.out, seq.params
    ends = not sp.ignore_eos and tid in eos or tid in sp.stop_token_ids
    text = ""
    if not ends:
        out.token_ids.append(tid)
        out.stats.new_tokens += 1
        text = seq.stream.push(tid)
        if out.logprobs is not None:
            assert logprob is not None and logprob.token_id == tid, "logprobs asked, none given"
            out.logprobs.append(logprob)
    if ends or seq.stream.stopped:
        out.finish_reason = "stop"
    elif len(out.token_ids) >= sp.max_tokens or context_full:
        out.finish_reason = "length"
        text += seq.stream.finish()
    if out.finish_reason == "stop" and not seq.stream.stopped:
        text += seq.stream.finish()
    out.text = seq.stream.text
    new_ids = [] if ends else [tid]
    lps = None if out.logprobs is None else out.logprobs[len(out.logprobs) - len(new_ids) :]
    return StreamEvent(out.index, text, new_ids, out if out.finish_reason else None, lps)
