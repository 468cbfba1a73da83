"""The OpenAI-compatible HTTP layer: FastAPI routes, request checks, server-sent events.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health,
GET /metrics; the chat page at GET / (the files in static/, no build step); GET and POST
/eaglespec/speculation, the server-wide speculation mode (off / on / adaptive). All generation
goes through one `Scheduler` (the engine thread); a request's events come back through an
asyncio queue. A client that disconnects cancels its sequences. Every refusal is OpenAI's error
object naming the field: 400 for bad input, 404 for an unknown model, 429 when the queue is full
and 503 while shutting down (both with Retry-After).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from eaglespec.config import SamplingParams, TreeConfig
from eaglespec.draft.base import NoDraft
from eaglespec.engine import BatchRunner, check_speculation, draft_width
from eaglespec.errors import ChatTemplateError, InvalidRequestError
from eaglespec.llm import LLM
from eaglespec.methods import speculation_policy
from eaglespec.policy import SPECULATION_MODES, DraftPolicy
from eaglespec.requests import Provenance, RequestOutput, StreamEvent, check_prompt
from eaglespec.serve.metrics import ServerMetrics
from eaglespec.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    UnsupportedFieldError,
    chat_logprobs,
    completion_logprobs,
    error_body,
    new_id,
    now,
    provenance_json,
    usage,
)
from eaglespec.serve.scheduler import (
    QueueFullError,
    Scheduler,
    ServerClosingError,
    Submission,
)
from eaglespec.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ServeOptions:
    served_name: str  # the model id clients send and /v1/models lists
    max_seqs: int = 16  # sequences decoding together at most
    max_queue: int = 64  # requests waiting at most; more get 429
    max_model_len: int | None = None  # prompt + output tokens per request (default: the model's)
    speculation: str | None = None  # adaptive | on | off (policy.py); None: the LLM's policy
    shutdown_grace: float = 10.0  # seconds running requests get to finish at shutdown
    prefill_chunk: int | None = 256  # prompt tokens prefilled per engine step; None: whole


STATIC = Path(__file__).parent / "static"  # the chat page's files


class SpeculationRequest(BaseModel):
    mode: str


class HTTPError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        body = error_body(str(self), kind=kind, param=self.param, code=self.code)
        return JSONResponse(body, status_code=self.status, headers=headers)


def _union_branch(loc: object) -> bool:
    """pydantic's names for the branch of a union type a value failed ("str", "list[int]",
    "function-after[...]"), which it puts in an error's location among the field names."""
    return isinstance(loc, str) and ("[" in loc or loc in ("str", "int", "float", "bool"))


def create_app(
    llm: LLM,
    options: ServeOptions,
    on_stop: Callable[[], None] | None = None,
    engine: Executor | None = None,
) -> FastAPI:
    """An app serving `llm` (its proposer, num_draft and tree set the speculation). `on_stop`
    runs at shutdown once the engine thread has ended (serve keeps the adaptive policy's
    calibration there: uvicorn ends a SIGTERM'd process by re-raising the signal after its
    shutdown, so code after `uvicorn.run` never runs then). `engine`: the one-worker executor
    that loaded `llm`, to decode on the same thread (scheduler.py says why)."""
    proposer = llm.proposer or NoDraft()
    tree: TreeConfig | None = llm.tree
    check_speculation(proposer, [SamplingParams()], tree)
    max_draft = draft_width(llm.num_draft, tree, proposer) if llm.proposer is not None else 0
    limit = llm.config.context_limit
    max_len = min(limit, options.max_model_len or limit)
    metrics = ServerMetrics()
    modes = SPECULATION_MODES if llm.proposer is not None else ("off",)
    mode = (options.speculation or llm.speculation) if llm.proposer is not None else "off"
    # one policy per mode, made when first chosen and kept: switching back to adaptive keeps
    # what it measured
    policies: dict[str, DraftPolicy] = {llm.speculation: llm.policy} if llm.proposer else {}

    def policy_for(name: str) -> DraftPolicy:
        if name not in policies:
            policies[name] = speculation_policy(name, llm.num_draft, tree, llm.proposer)
        return policies[name]

    policy = policy_for(mode)
    runner = BatchRunner(llm.model, proposer, llm.tokenizer, max_draft=max_draft)
    scheduler = Scheduler(
        runner,
        policy,
        metrics,
        max_seqs=options.max_seqs,
        max_queue=options.max_queue,
        prefill_chunk=options.prefill_chunk,
        engine=engine,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop, options.shutdown_grace)
        if on_stop is not None:
            on_stop()

    app = FastAPI(title="eaglespec", lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.speculation = mode
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        # Our own checks (value errors) say more than the other branches of a union type.
        first = next(
            (x for x in errors if x.get("type") == "value_error"), errors[0] if errors else {}
        )
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _union_branch(x)]
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('msg', '')}"
            return HTTPError(400, message, param=None).response()
        field = ".".join(loc) or None
        detail = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        return HTTPError(400, f"{field}: {detail}" if field else detail, param=field).response()

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own (a body that is not UTF-8 JSON, an unknown path): OpenAI's error shape
        message = "the body is not UTF-8 JSON" if e.status_code == 400 else str(e.detail)
        return HTTPError(e.status_code, message).response()

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    def speculation_state() -> dict[str, Any]:
        return {"mode": app.state.speculation, "modes": list(modes)}

    @app.get("/eaglespec/speculation")
    async def get_speculation() -> dict[str, Any]:
        return speculation_state()

    @app.post("/eaglespec/speculation")
    async def set_speculation(body: SpeculationRequest) -> dict[str, Any]:
        if body.mode not in modes:
            why = "" if llm.proposer is not None else " (this server has no draft)"
            raise HTTPError(
                400,
                f"mode: '{body.mode}' is not one of {', '.join(modes)}{why}",
                param="mode",
            )
        scheduler.set_policy(policy_for(body.mode))
        app.state.speculation = body.mode
        return speculation_state()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        running, waiting = scheduler.load
        return {"status": "ok", "running": running, "waiting": waiting}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": options.served_name, "object": "model", "created": 0, "owned_by": "eaglespec"}
        return {"object": "list", "data": [{**card, "max_model_len": max_len}]}

    def check_model(name: str) -> None:
        if name != options.served_name:
            raise HTTPError(
                404,
                f"model '{name}' is not served here (this server serves '{options.served_name}')",
                param="model",
                code="model_not_found",
            )

    def prepare(
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        field: str,
    ) -> list[tuple[list[int], SamplingParams]]:
        """(prompt, params) per choice, in choice order: prompt i, sample j -> i * n + j."""
        check_model(body.model)
        try:
            body.check_supported()
        except UnsupportedFieldError as e:
            raise HTTPError(400, str(e), param=e.param) from None
        vocab = llm.config.vocab_size
        jobs = []
        for ids in prompts:
            try:
                check_prompt(ids, max_len)
            except InvalidRequestError as e:
                raise HTTPError(400, f"{field}: {e}", param=field) from None
            if any(not 0 <= t < vocab for t in ids):
                raise HTTPError(400, f"{field}: token ids must be in [0, {vocab})", param=field)
            room = max_len - len(ids)
            if max_tokens is not None and max_tokens > room:
                raise HTTPError(
                    400,
                    f"max_tokens {max_tokens} + the prompt's {len(ids)} tokens exceed the "
                    f"context of {max_len} tokens",
                    param="max_tokens",
                )
            for j in range(body.n):
                try:
                    params = body.sampling_params(max_tokens or room, j)
                except InvalidRequestError as e:
                    raise HTTPError(400, str(e)) from None
                jobs.append((ids, params))
        return jobs

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        prompts = _completion_prompts(body.prompt, llm)
        jobs = prepare(body, prompts, body.max_tokens, "prompt")
        run = _Run(scheduler, jobs, sum(len(p) for p in prompts))
        run.start()  # before any response: a full queue is a 429, not an error event
        meta = {"id": new_id("cmpl"), "created": now(), "model": options.served_name}
        if body.stream:
            chunks = _completion_chunks(
                run, meta, body.include_usage, body.provenance, llm.tokenizer
            )
            return _sse(chunks)
        outputs = await run.collect(request)
        choices = [
            {
                "index": i,
                "text": o.text,
                "logprobs": None
                if o.logprobs is None
                else completion_logprobs(o.logprobs, llm.tokenizer),
                "finish_reason": o.finish_reason,
                **run.provenance(i, body.provenance),
            }
            for i, o in enumerate(outputs)
        ]
        return {"object": "text_completion", **meta, "choices": choices, "usage": run.usage()}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        if not llm.tokenizer.chat_template:
            raise HTTPError(
                400,
                "messages: this model has no chat template; send plain text to /v1/completions",
                param="messages",
            )
        try:
            ids = llm.tokenizer.encode_chat(body.chat_messages())
        except ChatTemplateError as e:
            raise HTTPError(400, f"messages: {e}", param="messages") from None
        jobs = prepare(body, [ids], body.requested_max_tokens, "messages")
        run = _Run(scheduler, jobs, len(ids))
        run.start()
        meta = {"id": new_id("chatcmpl"), "created": now(), "model": options.served_name}
        if body.stream:
            return _sse(_chat_chunks(run, meta, body.include_usage, body.provenance, llm.tokenizer))
        outputs = await run.collect(request)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": o.text},
                "logprobs": None
                if o.logprobs is None
                else chat_logprobs(o.logprobs, llm.tokenizer),
                "finish_reason": o.finish_reason,
                **run.provenance(i, body.provenance),
            }
            for i, o in enumerate(outputs)
        ]
        return {"object": "chat.completion", **meta, "choices": choices, "usage": run.usage()}

    return app


def _completion_prompts(
    prompt: str | list[int] | list[str] | list[list[int]], llm: LLM
) -> list[list[int]]:
    if isinstance(prompt, str):
        return [llm.tokenizer.encode(prompt)]
    if not prompt:
        raise HTTPError(400, "prompt: at least one prompt is needed", param="prompt")
    if isinstance(prompt[0], int):
        return [[int(t) for t in prompt]]
    return [llm.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


class _Run:
    """The choices of one HTTP request in the scheduler, and their events on this event loop."""

    def __init__(
        self,
        scheduler: Scheduler,
        jobs: Sequence[tuple[list[int], SamplingParams]],
        prompt_tokens: int,  # for usage: each prompt once, however many samples it has
    ) -> None:
        self.scheduler = scheduler
        self.jobs = jobs
        self.prompt_tokens = prompt_tokens
        self.subs: list[Submission] = []
        self.outputs: dict[int, RequestOutput] = {}
        self.rounds: dict[int, list[Provenance]] = {}  # per choice, for a non-streamed answer
        self.queue: asyncio.Queue[tuple[int, StreamEvent | None, Exception | None]] | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, StreamEvent | None, Exception | None]] = asyncio.Queue()
        self.queue = queue
        try:
            for choice, (ids, params) in enumerate(self.jobs):

                def deliver(
                    event: StreamEvent | None, error: Exception | None, choice: int = choice
                ) -> None:
                    loop.call_soon_threadsafe(queue.put_nowait, (choice, event, error))

                self.subs.append(self.scheduler.submit(ids, params, deliver))
        except QueueFullError as e:
            self.cancel()
            raise HTTPError(429, str(e), code="queue_full") from None
        except ServerClosingError as e:
            self.cancel()
            raise HTTPError(503, str(e)) from None

    def cancel(self) -> None:
        for sub in self.subs:
            self.scheduler.cancel(sub)

    async def events(
        self, request: Request | None = None
    ) -> AsyncIterator[tuple[int, StreamEvent]]:
        """(choice, event) until every choice has finished; cancels what is left on exit.
        `request`, when given, is polled for a disconnect (non-streaming responses; a streaming
        response is cancelled by the server when its client goes)."""
        assert self.queue is not None, "start() first"
        try:
            while len(self.outputs) < len(self.jobs):
                try:
                    choice, event, error = await asyncio.wait_for(self.queue.get(), 1.0)
                except TimeoutError:
                    if request is not None and await request.is_disconnected():
                        return
                    continue
                if error is not None:
                    if isinstance(error, InvalidRequestError):
                        raise HTTPError(400, str(error))
                    raise HTTPError(500, f"generation failed: {error}")
                assert event is not None
                if event.output is not None:
                    self.outputs[choice] = event.output
                if event.provenance is not None:
                    self.rounds.setdefault(choice, []).append(event.provenance)
                yield choice, event
        finally:
            self.cancel()

    async def collect(self, request: Request) -> list[RequestOutput]:
        async for _ in self.events(request):
            pass
        if len(self.outputs) < len(self.jobs):
            raise HTTPError(499, "client disconnected")
        return [self.outputs[i] for i in range(len(self.jobs))]

    def provenance(self, choice: int, asked: bool) -> dict[str, Any]:
        """{"provenance": [one object per round]} for a non-streamed choice, when asked."""
        if not asked:
            return {}
        return {"provenance": [provenance_json(p) for p in self.rounds.get(choice, [])]}

    def usage(self) -> dict[str, int]:
        completion = sum(len(o.token_ids) for o in self.outputs.values())
        return usage(self.prompt_tokens, completion)


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except HTTPError as e:  # after the 200 went out: an error event, as OpenAI streams do
            err = error_body(str(e), kind="server_error", param=e.param, code=e.code)
            yield f"data: {json.dumps(err)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _round_field(event: StreamEvent, asked: bool) -> dict[str, Any]:
    """A streamed chunk's {"provenance": this round's object}, when asked and the event has
    one (speculative generation's events)."""
    if not asked or event.provenance is None or not event.provenance.tokens:
        return {}
    return {"provenance": provenance_json(event.provenance)}


async def _completion_chunks(
    run: _Run,
    meta: dict[str, Any],
    include_usage: bool,
    provenance: bool,
    tokenizer: Tokenizer,
) -> AsyncIterator[dict[str, Any]]:
    offsets = [0] * len(run.jobs)  # per choice: characters of token text sent so far
    async for choice, event in run.events():
        finish = event.output.finish_reason if event.output is not None else None
        lps = None
        if event.logprobs:
            lps = completion_logprobs(event.logprobs, tokenizer, offsets[choice])
            offsets[choice] += sum(len(t) for t in lps["tokens"])
        marks = _round_field(event, provenance)
        if event.text or finish or lps or marks:
            c = {"index": choice, "text": event.text, "logprobs": lps, "finish_reason": finish}
            c.update(marks)
            yield {"object": "text_completion", **meta, "choices": [c]}
    if include_usage:
        yield {"object": "text_completion", **meta, "choices": [], "usage": run.usage()}


async def _chat_chunks(
    run: _Run,
    meta: dict[str, Any],
    include_usage: bool,
    provenance: bool,
    tokenizer: Tokenizer,
) -> AsyncIterator[dict[str, Any]]:
    base = {"object": "chat.completion.chunk", **meta}
    for choice in range(len(run.jobs)):
        c = {"index": choice, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        yield {**base, "choices": [{**c, "finish_reason": None}]}
    async for choice, event in run.events():
        finish = event.output.finish_reason if event.output is not None else None
        lps = chat_logprobs(event.logprobs, tokenizer) if event.logprobs else None
        marks = _round_field(event, provenance)
        if event.text or lps or marks:
            c = {"index": choice, "delta": {"content": event.text}, "logprobs": lps, **marks}
            yield {**base, "choices": [{**c, "finish_reason": None}]}
        if finish:
            c = {"index": choice, "delta": {}, "logprobs": None, "finish_reason": finish}
            yield {**base, "choices": [c]}
    if include_usage:
        yield {**base, "choices": [], "usage": run.usage()}
