"""OpenAI request schemas (the subset eaglespec serves), their checks, and the response shapes.

Fields OpenAI defines that eaglespec cannot honour (logprobs, echo, penalties, tools, non-text
response formats) are refused with a 400 naming the field rather than silently ignored; unknown
extra fields are ignored, as OpenAI's own server does. `top_k`, `min_p` and `ignore_eos` are
extensions, as in vLLM.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from eaglespec.config import SamplingParams

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


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

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    ignore_eos: bool = False
    user: str | None = None

    def check_supported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise UnsupportedFieldError(name, f"{name} is not supported (only 0)")

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
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[int], Field(min_length=1)] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise UnsupportedFieldError("logprobs", "logprobs are not supported")
        if self.echo:
            raise UnsupportedFieldError("echo", "echo is not supported")
        if self.suffix:
            raise UnsupportedFieldError("suffix", "suffix is not supported")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

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
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: ResponseFormat | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise UnsupportedFieldError("logprobs", "logprobs are not supported")
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
