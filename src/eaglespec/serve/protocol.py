"""OpenAI request schemas (the subset eaglespec serves), their checks, and the response shapes.

Fields OpenAI defines that eaglespec cannot honour (echo, suffix, penalties, tools, non-text
response formats) are refused with a 400 naming the field rather than silently ignored; unknown
extra fields are ignored, as OpenAI's own server does. `top_k`, `min_p` and `ignore_eos` are
extensions, as in vLLM; `provenance: true` adds each choice's tokens marked by how they landed
(accepted draft, prompt-lookup copy, the target's bonus or correction: README.md, Serving).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from eaglespec.config import SamplingParams
from eaglespec.logprobs import MAX_TOP, TokenLogprob
from eaglespec.requests import Provenance
from eaglespec.tokenizer import Tokenizer

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


def _unicode_text(value: str) -> str:
    """JSON's \\uXXXX escapes can spell a lone UTF-16 surrogate (U+D800..U+DFFF), which is no
    Unicode character: no tokenizer can encode it, and it would fail deep in generation. Refused
    here, so the request gets a 400 naming the field."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(value[e.start])
        raise ValueError(
            f"holds a lone surrogate U+{bad:04X} at character {e.start}, which is not Unicode "
            "text (pair it, or send the character itself)"
        ) from None
    return value


Text = Annotated[str, AfterValidator(_unicode_text)]  # a string the engine can encode


class UnsupportedFieldError(ValueError):
    """A field the engine cannot honour: the app answers 400 naming it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: Text
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | Annotated[list[Text], Field(max_length=16)] | None = None
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    ignore_eos: bool = False
    provenance: bool = False  # extension: how each token landed (`provenance_json`)
    user: str | None = None

    def check_supported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise UnsupportedFieldError(name, f"{name} is not supported (only 0)")

    def logprob_count(self) -> int | None:
        """Top alternatives to report per token; None: no logprobs."""
        return None

    def sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
        """The engine's parameters for choice `choice` of n (seeded choices get seed + choice,
        so n samples differ but repeat)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0,
            seed=None if self.seed is None else (self.seed + choice) % 2**64,
            stop=tuple(s for s in stop if s),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprob_count(),
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: Text | Annotated[list[int], Field(min_length=1)] | list[Text] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP)
    echo: bool = False
    suffix: str | None = None

    def logprob_count(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise UnsupportedFieldError("echo", "echo is not supported")
        if self.suffix:
            raise UnsupportedFieldError("suffix", "suffix is not supported")


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP)
    tools: list[Any] | None = None
    response_format: ResponseFormat | None = None

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedFieldError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.tools:
            raise UnsupportedFieldError("tools", "tool calling is not supported")
        if self.response_format is not None and self.response_format.type != "text":
            raise UnsupportedFieldError(
                "response_format", "only response_format type 'text' is supported"
            )

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages for the model's chat template ("developer" is OpenAI's new name for
        "system")."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def error_body(
    message: str, *, kind: str, param: str | None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(
    lps: Sequence[TokenLogprob], tokenizer: Tokenizer, offset: int = 0
) -> dict[str, Any]:
    """The legacy completions `logprobs` object for these tokens; `offset` is the text length
    before the first of them (text_offset continues across streamed chunks)."""
    tokens = [_token_text(tokenizer, lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{_token_text(tokenizer, i): v for i, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(lps: Sequence[TokenLogprob], tokenizer: Tokenizer) -> dict[str, Any]:
    """The chat completions `logprobs` object: {"content": [per token]}."""

    def entry(tid: int, value: float) -> dict[str, Any]:
        text = _token_text(tokenizer, tid)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {
                **entry(lp.token_id, lp.logprob),
                "top_logprobs": [entry(i, v) for i, v in lp.top],
            }
            for lp in lps
        ]
    }


def _token_text(tokenizer: Tokenizer, tid: int) -> str:
    return tokenizer.decode([tid], skip_special=False)


def provenance_json(p: Provenance) -> dict[str, Any]:
    """One round's `provenance` object: {"drafted", "accepted", "tokens": [{"text", "source"}]}
    (requests.SOURCES names the sources; the texts concatenate to the chunk's text)."""
    return {
        "drafted": p.drafted,
        "accepted": p.accepted,
        "tokens": [{"text": m.text, "source": m.source} for m in p.tokens],
    }
