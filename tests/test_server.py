"""The OpenAI-compatible server on a tiny random model (fast): continuous batching keeps every
greedy output equal to its solo run, bad input gets OpenAI's error object naming the field and
never a 500, a full queue answers 429 with Retry-After, a client that disconnects frees its
sequence, /metrics accounts for every request, and a bounded hypothesis fuzz of the request
schema finds no 500."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eaglespec.config import SamplingParams
from eaglespec.llm import LLM
from eaglespec.serve.app import ServeOptions, create_app
from server_fixtures import running_server

NAME = "tiny"


@pytest.fixture(scope="module")
def llm(tiny_hf_folder: Path) -> LLM:
    return LLM(
        str(tiny_hf_folder),
        progress=False,
        method="eagle3",
        draft="random",
        num_draft=3,
        speculation="adaptive",
        lookup_tokens=0,
        draft_min_prob=0.0,  # a random head doubts every chain: draft them all the same
    )


@pytest.fixture(scope="module")
def client(llm: LLM):
    app = create_app(llm, ServeOptions(served_name=NAME, max_seqs=4, max_queue=32))
    with TestClient(app) as c:
        yield c


def _solo(llm: LLM, ids: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([ids], params)[0].token_ids


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_completion_equals_solo_generate(client: TestClient, llm: LLM) -> None:
    ids = [5, 9, 17, 3, 11]
    body = {"model": NAME, "prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    expected = llm.tokenizer.decode(_solo(llm, ids, 12))
    assert out["choices"][0]["text"] == expected


def _stream(client: TestClient, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed response, [DONE] checked and dropped."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]


def _solo_logprobs(llm: LLM, ids: list[int], max_tokens: int, top: int):  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=top)
    out = llm.generate([ids], params)[0]
    assert out.logprobs is not None
    return out.logprobs


def test_completion_logprobs_legacy_format(client: TestClient, llm: LLM) -> None:
    body = {"model": NAME, "prompt": [4, 5, 6], "max_tokens": 6, "temperature": 0}
    body |= {"logprobs": 2, "ignore_eos": True}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    want = _solo_logprobs(llm, [4, 5, 6], 6, 2)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(want) == 6
    assert lp["tokens"] == [llm.tokenizer.decode([w.token_id], skip_special=False) for w in want]
    assert lp["token_logprobs"] == pytest.approx([w.logprob for w in want], abs=1e-4)
    assert [len(d) <= 2 for d in lp["top_logprobs"]] == [True] * 6
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == choice["text"]
    # Streamed: the chunks' logprobs add up to the same lists, offsets continuing.
    chunks = _stream(client, "/v1/completions", {**body, "stream": True})
    parts = [
        c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
    ]
    assert sum((p["tokens"] for p in parts), []) == lp["tokens"]
    assert sum((p["text_offset"] for p in parts), []) == lp["text_offset"]
    plain = client.post("/v1/completions", json={**body, "logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_chat_logprobs_format(client: TestClient, llm: LLM) -> None:
    messages = [{"role": "user", "content": "Once upon a time"}]
    body = {"model": NAME, "messages": messages, "max_tokens": 5, "temperature": 0}
    body |= {"logprobs": True, "top_logprobs": 3, "ignore_eos": True}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    want = _solo_logprobs(llm, llm.tokenizer.encode_chat(messages), 5, 3)
    assert [c["logprob"] for c in content] == pytest.approx([w.logprob for w in want], abs=1e-4)
    for c, w in zip(content, want, strict=True):
        assert c["token"] == llm.tokenizer.decode([w.token_id], skip_special=False)
        assert c["bytes"] == list(c["token"].encode()) and len(c["top_logprobs"]) == 3
        assert c["top_logprobs"][0]["logprob"] >= c["top_logprobs"][-1]["logprob"]
        assert c["top_logprobs"][0]["token"] == c["token"]  # greedy: the most likely token
    chunks = _stream(client, "/v1/chat/completions", {**body, "stream": True})
    streamed = [
        x
        for c in chunks
        if c["choices"] and c["choices"][0].get("logprobs")
        for x in c["choices"][0]["logprobs"]["content"]
    ]
    assert [x["token"] for x in streamed] == [c["token"] for c in content]
    r = client.post("/v1/chat/completions", json={**body, "logprobs": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_chat_equals_solo_generate(client: TestClient, llm: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    body = {"model": NAME, "messages": messages, "max_tokens": 9, "temperature": 0}
    out = client.post("/v1/chat/completions", json=body | {"ignore_eos": True}).json()
    ids = llm.tokenizer.encode_chat(messages)
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {
        "role": "assistant",
        "content": llm.tokenizer.decode(_solo(llm, ids, 9)),
    }
    assert out["usage"]["prompt_tokens"] == len(ids)


def test_streaming_chunks_and_usage(client: TestClient, llm: LLM) -> None:
    ids = [7, 7, 8, 9]
    body = {
        "model": NAME, "prompt": ids, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == llm.tokenizer.decode(_solo(llm, ids, 10))
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] == "length" and set(finals[:-1]) <= {None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_n_choices_and_prompt_lists(llm: LLM) -> None:
    """Choices are prompt-major; seeded samples repeat under the default (adaptive) speculation,
    whatever it measured before, and equal them with speculation on or off (verify.py draws each
    emitted token from the uniform a plain step would use)."""
    body = {"model": NAME, "prompt": [[4, 5, 6], [9, 10]], "n": 2, "max_tokens": 6}
    body |= {"temperature": 0.9, "seed": 3, "ignore_eos": True}
    texts = {}
    for mode in ("adaptive", "on", "off"):
        app = create_app(llm, ServeOptions(served_name=NAME, speculation=mode))
        with TestClient(app) as client:
            out = client.post("/v1/completions", json=body).json()
            for _ in range(3):  # the policy measures rounds in between
                again = client.post("/v1/completions", json=body).json()
                assert [c["text"] for c in again["choices"]] == [c["text"] for c in out["choices"]]
        texts[mode] = [c["text"] for c in out["choices"]]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == 5 and out["usage"]["completion_tokens"] == 24
    assert texts["adaptive"] == texts["on"] == texts["off"]


def test_concurrent_requests_equal_their_solo_runs(llm: LLM) -> None:
    """12 greedy requests of different lengths at once through a real socket, 4 running at a
    time: every output is its solo run, every request is accounted for in /metrics."""
    app = create_app(llm, ServeOptions(served_name=NAME, max_seqs=4, max_queue=32))
    prompts = [[3 + i, 20 + 2 * i, 7, 40 + i][: 2 + i % 3] for i in range(12)]
    lengths = [4 + 3 * (i % 5) for i in range(12)]
    results: dict[int, str] = {}

    def one(i: int, url: str) -> None:
        body = {"model": NAME, "prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0}
        body |= {"ignore_eos": True, "stream": True}
        text = ""
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        results[i] = text

    with running_server(app) as url:
        threads = [threading.Thread(target=one, args=(i, url)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        metrics = httpx.get(f"{url}/metrics").text
    for i in range(12):
        assert results[i] == llm.tokenizer.decode(_solo(llm, prompts[i], lengths[i])), i
    assert _metric(metrics, 'eaglespec_requests_total{outcome="length"}') == 12
    assert _metric(metrics, "eaglespec_generation_tokens_total") == sum(lengths)
    assert _metric(metrics, "eaglespec_prompt_tokens_total") == sum(map(len, prompts))
    assert _metric(metrics, "eaglespec_time_to_first_token_seconds_count") == 12
    assert _metric(metrics, "eaglespec_inter_token_latency_seconds_count") == sum(lengths) - 12


def test_disconnect_cancels_and_frees_the_sequence(llm: LLM) -> None:
    app = create_app(llm, ServeOptions(served_name=NAME, max_seqs=4, max_queue=8))
    body = {"model": NAME, "prompt": [5, 6], "max_tokens": 120, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    with running_server(app) as url:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # the client goes away after its first chunk
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").json()["running"]:
            assert time.monotonic() < deadline, "the cancelled sequence was never freed"
            time.sleep(0.05)
        metrics = httpx.get(f"{url}/metrics").text
        assert _metric(metrics, 'eaglespec_requests_total{outcome="cancelled"}') == 1
        assert app.state.scheduler.runner.seqs == []  # its cache rows are gone
        # and the server keeps serving
        ok = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        assert ok.status_code == 200


def test_full_queue_is_429_with_retry_after(llm: LLM) -> None:
    app = create_app(llm, ServeOptions(served_name=NAME, max_seqs=1, max_queue=1))
    scheduler = app.state.scheduler
    with TestClient(app) as c:
        scheduler.stop(0)  # the engine thread is gone: submissions stay queued
        scheduler._closing = False
        body = {"model": NAME, "prompt": [5], "max_tokens": 2}
        scheduler.submit([5], SamplingParams(max_tokens=2), lambda e, err: None)
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        scheduler._closing = True


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "other", "prompt": "x"}, 404, "model"),
        ({"prompt": "x"}, 400, "model"),
        ({"model": NAME, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": NAME, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"model": NAME, "prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"model": NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": NAME, "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
        ({"model": NAME, "prompt": "x", "n": 0}, 400, "n"),
        ({"model": NAME, "prompt": []}, 400, "prompt"),
        ({"model": NAME, "prompt": [[]]}, 400, "prompt"),
        ({"model": NAME, "prompt": [10**9]}, 400, "prompt"),
        ({"model": NAME, "prompt": list(range(3, 200))}, 400, "prompt"),
        ({"model": NAME, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"model": NAME, "prompt": "x", "presence_penalty": 1}, 400, "presence_penalty"),
        ({"model": NAME, "prompt": "x", "stop": 3}, 400, "stop"),
        ({"model": NAME, "prompt": "x", "seed": 2**70}, 400, "seed"),
    ],
)
def test_bad_completion_requests(client: TestClient, body: dict, status: int, param: str) -> None:
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].split(".")[0] == param
    assert err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": NAME, "messages": []}, "messages"),
        ({"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"model": NAME}, "messages"),
        ({"model": NAME, "messages": [{"role": "user", "content": 5}]}, "messages"),
    ],
)
def test_bad_chat_requests(client: TestClient, body: dict, param: str) -> None:
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == param


def test_malformed_json_and_wrong_body_type(client: TestClient) -> None:
    nan = b'{"model": "tiny", "prompt": "x", "temperature": NaN}'
    inf = b'{"model": "tiny", "prompt": "x", "top_p": Infinity}'
    for raw in (b"{not json", b"[1, 2]", b'"text"', b"", nan, inf):
        r = client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, (raw, r.text)
        assert r.json()["error"]["message"]
    assert client.get("/health").json()["status"] == "ok"  # still serving


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(-5, 300), max_size=6),
    st.lists(st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=6), st.integers(), max_size=2),
)
_FIELDS = [
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream",
    "stop", "seed", "logprobs", "echo", "presence_penalty", "stream_options", "ignore_eos",
]  # fmt: skip


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(extra=st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=6))
def test_fuzzed_completion_requests_never_500(client: TestClient, extra: dict) -> None:
    body = {"model": NAME, "prompt": [5, 6], "max_tokens": 3, **extra}
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # bounded work per example; validity is unchanged
    # json.dumps writes NaN / Infinity as JavaScript does (not JSON): the server must refuse
    # those with a 400 too, so the body goes out as raw text.
    raw = json.dumps(body)
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200 and not body.get("stream"):
        assert r.json()["error"]["message"]


# What strings can hold past ordinary text: any code point, control characters, and the lone
# UTF-16 surrogates JSON's \uXXXX escapes can spell (not Unicode text: no tokenizer encodes them).
_ODD_TEXT = st.text(
    alphabet=st.one_of(
        st.characters(exclude_categories=()),
        st.integers(0xD800, 0xDFFF).map(chr),
        st.integers(0, 0x1F).map(chr),
    ),
    max_size=8,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    content=_ODD_TEXT,
    system=_ODD_TEXT,
    stop=_ODD_TEXT,
    model=st.sampled_from([NAME, NAME + "\ud800"]),
    parts=st.booleans(),
    stream=st.booleans(),
)
def test_odd_text_in_every_string_field_never_500s(
    client: TestClient, content: str, system: str, stop: str, model: str, parts: bool, stream: bool
) -> None:
    """Whatever the strings hold, the answer is a 200 or a 400 with an OpenAI error object that
    names the field (a lone surrogate once reached the tokenizer: a bare 500)."""
    user = [{"type": "text", "text": content}] if parts else content
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    body = {"model": model, "messages": messages, "max_tokens": 2, "stream": stream}
    if stop:
        body["stop"] = stop
    raw = json.dumps(body)  # ensure_ascii: a lone surrogate goes out as its \uXXXX escape
    r = client.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    lone = not _is_unicode_text(json.loads(raw))  # as the server reads it (pairs rejoin)
    assert r.status_code == (400 if lone else 200), r.text
    if lone:
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "surrogate" in err["message"]
        assert err["param"].split(".")[0] in ("model", "messages", "stop")


def _is_unicode_text(value: object) -> bool:
    """Every string in a decoded JSON value encodes as UTF-8 (holds no lone surrogate)."""
    if isinstance(value, dict):
        return all(_is_unicode_text(v) for v in value.values())
    if isinstance(value, list):
        return all(_is_unicode_text(v) for v in value)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return True


def test_a_body_that_is_not_utf8_is_an_openai_error(client: TestClient) -> None:
    for raw in (b'{"model": "tiny", "prompt": "\xe9"}', b"\xff\xfe{}", b'{"prompt": "\xc3("}'):
        r = client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, (raw, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error", r.text


def _events(got: list, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, "no events from the engine thread"
        time.sleep(0.01)


def _one_running(llm: LLM, max_tokens: int):
    """A started scheduler with one request that has produced its first event; its events
    (event, error) collect in the returned list."""
    app = create_app(llm, ServeOptions(served_name=NAME))
    scheduler = app.state.scheduler
    scheduler.start()
    got: list = []
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    scheduler.submit([5, 6], params, lambda e, err: got.append((e, err)))
    _events(got, 1)
    return scheduler, got


def test_shutdown_lets_short_work_finish_then_refuses(llm: LLM) -> None:
    from eaglespec.serve.scheduler import ServerClosingError

    scheduler, got = _one_running(llm, 6)
    scheduler.stop(grace=60)  # returns when the engine thread has ended
    assert got[-1][1] is None and got[-1][0].output.finish_reason == "length"
    with pytest.raises(ServerClosingError):
        scheduler.submit([5], SamplingParams(max_tokens=6), lambda e, err: None)


def test_shutdown_past_grace_cancels_running_work(llm: LLM) -> None:
    scheduler, got = _one_running(llm, 100)
    scheduler.stop(grace=0)
    event, error = got[-1]
    assert event is None and "cancelled" in str(error)
    assert scheduler.runner.seqs == [] and scheduler.load == (0, 0)
    assert len(got) < 100


def _wait_done(results: dict, keys: list, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(k in results for k in keys):
        assert time.monotonic() < deadline, "requests did not finish"
        time.sleep(0.01)


def test_long_prompt_is_prefilled_in_chunks_between_rounds(llm: LLM) -> None:
    """A long prompt arriving while a stream runs is prefilled 4 tokens per engine step, with a
    round of the running stream after each chunk; both outputs equal their solo runs, and a
    request cancelled mid-prefill leaves the others and the engine thread unharmed."""
    app = create_app(llm, ServeOptions(served_name=NAME, prefill_chunk=4))
    scheduler = app.state.scheduler
    order: list[str] = []
    results: dict[str, object] = {}
    long_prompt = [(7 * i) % 300 + 3 for i in range(60)]

    def track(name: str):  # type: ignore[no-untyped-def]
        def deliver(event, error) -> None:  # type: ignore[no-untyped-def]
            if error is not None:
                results[name] = error
                return
            order.append(name)
            if name == "A" and order.count("A") == 1:  # B arrives once A is streaming
                scheduler.submit(long_prompt, SamplingParams(max_tokens=4), track("B"))
            if event.output is not None:
                results[name] = event.output

        return deliver

    scheduler.start()
    try:
        scheduler.submit([5, 6], SamplingParams(max_tokens=100, ignore_eos=True), track("A"))
        _wait_done(results, ["A", "B"])
        first_b = order.index("B")
        assert order[1:first_b].count("A") >= 60 // 4 - 1  # A kept streaming while B prefilled
        assert results["A"].token_ids == _solo(llm, [5, 6], 100)  # type: ignore[attr-defined]
        b = llm.generate([long_prompt], SamplingParams(max_tokens=4))[0]
        assert results["B"].token_ids == b.token_ids  # type: ignore[attr-defined]

        # Cancelled mid-prefill (by D's third event, C needs 15 chunks): C ends with an error
        # and no tokens, D is unchanged, and the engine thread serves the next request.
        results.clear()
        order.clear()
        held: list = []

        def deliver_d(event, error) -> None:  # type: ignore[no-untyped-def]
            order.append("D")
            if order.count("D") == 1:
                held.append(scheduler.submit(long_prompt, SamplingParams(max_tokens=5), track("C")))
            if order.count("D") == 3:
                scheduler.cancel(held[0])
            if event is not None and event.output is not None:
                results["D"] = event.output

        scheduler.submit([9, 10], SamplingParams(max_tokens=40, ignore_eos=True), deliver_d)
        _wait_done(results, ["C", "D"])
        assert isinstance(results["C"], Exception) and "C" not in order
        assert results["D"].token_ids == _solo(llm, [9, 10], 40)  # type: ignore[attr-defined]
        scheduler.submit([4, 4], SamplingParams(max_tokens=3, ignore_eos=True), track("E"))
        _wait_done(results, ["E"])
        assert scheduler.runner.seqs == [] and scheduler.load == (0, 0)
    finally:
        scheduler.stop(grace=0)


def _provenance_chunks(client: TestClient, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]


def test_provenance_marks_every_streamed_token(client: TestClient, llm: LLM) -> None:
    messages = [{"role": "user", "content": "Count with me: 1 2 3"}]
    body = {
        "model": NAME, "messages": messages, "max_tokens": 24, "temperature": 0,
        "ignore_eos": True, "stream": True, "provenance": True,
    }  # fmt: skip
    chunks = _provenance_chunks(client, body)
    rounds = [c["choices"][0]["provenance"] for c in chunks if "provenance" in c["choices"][0]]
    for c in chunks:
        choice = c["choices"][0]
        if "provenance" in choice:  # the marks spell the chunk's text
            marks = choice["provenance"]["tokens"]
            assert "".join(m["text"] for m in marks) == choice["delta"]["content"]
    sources = [m["source"] for p in rounds for m in p["tokens"]]
    assert len(sources) == 24 and sources[0] == "target"  # the prefill's token
    assert set(sources) <= {"draft", "lookup", "bonus", "corrected", "target"}
    for p in rounds[1:]:  # the random head's rounds under adaptive speculation
        assert p["accepted"] <= p["drafted"]
        if len(p["tokens"]) == p["accepted"] + 1:  # a whole round: drafts, then the target's
            own = "bonus" if p["accepted"] == p["drafted"] else "corrected"
            assert p["tokens"][-1]["source"] == ("target" if p["drafted"] == 0 else own)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    ids = llm.tokenizer.encode_chat(messages)
    assert text == llm.tokenizer.decode(_solo(llm, ids, 24))
    # without the field the chunks are OpenAI's own
    plain = _provenance_chunks(client, body | {"provenance": False})
    assert all("provenance" not in c["choices"][0] for c in plain if c["choices"])
    # a whole answer carries its rounds in order (adaptive speculation may shape them anew)
    whole = client.post("/v1/chat/completions", json=body | {"stream": False}).json()
    rounds = whole["choices"][0]["provenance"]
    assert sum(len(p["tokens"]) for p in rounds) == 24
    assert "".join(m["text"] for p in rounds for m in p["tokens"]) == text


def test_speculation_mode_switches_the_whole_server(client: TestClient) -> None:
    assert client.get("/eaglespec/speculation").json() == {
        "mode": "adaptive",
        "modes": ["adaptive", "on", "off"],
    }
    body = {
        "model": NAME, "prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0,
        "ignore_eos": True, "provenance": True,
    }  # fmt: skip
    try:
        assert client.post("/eaglespec/speculation", json={"mode": "off"}).json()["mode"] == "off"
        rounds = client.post("/v1/completions", json=body).json()["choices"][0]["provenance"]
        assert [p["drafted"] for p in rounds] == [0] * 12
        assert {m["source"] for p in rounds for m in p["tokens"]} == {"target"}
        assert client.post("/eaglespec/speculation", json={"mode": "on"}).json()["mode"] == "on"
        rounds = client.post("/v1/completions", json=body).json()["choices"][0]["provenance"]
        assert [p["drafted"] for p in rounds[1:]] == [3] * (len(rounds) - 1)  # num_draft 3
        bad = client.post("/eaglespec/speculation", json={"mode": "sometimes"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"
        assert client.get("/eaglespec/speculation").json()["mode"] == "on"
    finally:
        client.post("/eaglespec/speculation", json={"mode": "adaptive"})


def test_the_chat_page_and_its_files_are_served(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name in ("chat.js", "chat.css"):
        assert f"/static/{name}" in page.text
        assert client.get(f"/static/{name}").status_code == 200
    assert client.get("/static/nothing.js").status_code == 404


def test_a_server_without_a_draft_has_only_plain_decoding(tiny_hf_folder: Path) -> None:
    plain = LLM(str(tiny_hf_folder), progress=False, draft="none")
    with TestClient(create_app(plain, ServeOptions(served_name=NAME))) as c:
        assert c.get("/eaglespec/speculation").json() == {"mode": "off", "modes": ["off"]}
        bad = c.post("/eaglespec/speculation", json={"mode": "on"})
        assert bad.status_code == 400 and "no draft" in bad.json()["error"]["message"]
        body = {"model": NAME, "prompt": [5, 6], "max_tokens": 5, "ignore_eos": True}
        out = c.post("/v1/completions", json=body | {"provenance": True}).json()["choices"][0]
        assert [m["source"] for p in out["provenance"] for m in p["tokens"]] == ["target"] * 5


def test_serve_decodes_on_the_thread_that_loaded_the_model(
    tiny_hf_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`eaglespec serve` loads the model, and runs every round, on one engine thread and never on
    the thread serving HTTP (scheduler.py: a second thread's OpenMP team made a CPU stream 0.45x
    as fast). uvicorn.run is replaced by a client that sends one completion."""
    import uvicorn

    import eaglespec.serve.command as command
    from eaglespec.cli import main

    threads: dict[str, set[int]] = {"load": set(), "round": set()}
    real_load = command.load_llm

    def load(*args, **kwargs):  # type: ignore[no-untyped-def]
        threads["load"].add(threading.get_ident())
        return real_load(*args, **kwargs)

    def run(app, **kwargs):  # type: ignore[no-untyped-def]
        runner = app.state.scheduler.runner
        real_round = runner.policy_round

        def policy_round(*a, **k):  # type: ignore[no-untyped-def]
            threads["round"].add(threading.get_ident())
            return real_round(*a, **k)

        runner.policy_round = policy_round
        with TestClient(app) as c:
            body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
            assert c.post("/v1/completions", json=body).status_code == 200

    monkeypatch.setattr(command, "load_llm", load)
    monkeypatch.setattr(uvicorn, "run", run)
    args = ["serve", "--model", str(tiny_hf_folder), "--served-name", NAME, "--port", "1"]
    assert main([*args, "--draft", "random", "--draft-tokens", "2", "--lookup-tokens", "0"]) == 0
    assert len(threads["load"]) == 1 and threads["round"] == threads["load"]
    assert threading.get_ident() not in threads["load"]
