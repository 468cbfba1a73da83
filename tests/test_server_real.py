"""The server on the default model (SmolLM2-135M-Instruct with its shipped EAGLE-3 head, adaptive
speculation, fp32), driven by the real `openai` client over loopback: chat and completions,
streaming and not, stop strings and usage counts; 16 simultaneous streaming requests each equal
their solo plain greedy run (what `eaglespec generate` prints), nothing lost or duplicated, and
/metrics accounts for all of them."""

from __future__ import annotations

import threading

import httpx
import pytest

from commands import plain_output, plain_text
from eaglespec import LLM
from eaglespec.heads import packaged_head
from eaglespec.methods import DEFAULT_LOOKUP_TOKENS
from eaglespec.registry import pull
from eaglespec.serve.app import ServeOptions, create_app
from server_fixtures import running_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.real

NAME = "smollm2-135m"


@pytest.fixture(scope="module")
def llm() -> LLM:
    path = pull(NAME, progress=False)
    head = packaged_head(NAME)
    assert head is not None
    return LLM(
        str(path), dtype="float32", quant="none", progress=False, method="eagle3", draft=str(head),
        speculation="adaptive", lookup_tokens=0,
    )  # fmt: skip


@pytest.fixture(scope="module")
def llm_default() -> LLM:
    """As `eaglespec serve` loads the model by default (LLM's defaults are the commands'): the
    GGUF's own precision (bf16 w4a8 on a CPU with the kernels), the shipped head with prompt
    lookup grafted into its rounds, adaptive speculation."""
    llm = LLM(str(pull(NAME, progress=False)), progress=False)
    assert llm.draft == str(packaged_head(NAME)) and llm.lookup_tokens == DEFAULT_LOOKUP_TOKENS
    assert llm.speculation == "adaptive"
    return llm


@pytest.fixture(scope="module")
def server(llm: LLM):
    app = create_app(llm, ServeOptions(served_name=NAME, max_seqs=16))
    with running_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_models_and_health(client, server: str) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


def test_chat_equals_plain_generate(client, llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
    ids = llm.tokenizer.encode_chat(messages)
    want = plain_output(llm, ids, 24)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == len(ids) + len(want.token_ids)


def test_chat_stream_equals_non_stream(client) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=20, temperature=0
    )
    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completion_stop_string(client, llm: LLM) -> None:
    prompt = "The days of the week are Monday, Tuesday,"
    full = client.completions.create(model=NAME, prompt=prompt, max_tokens=30, temperature=0)
    text = full.choices[0].text
    assert "," in text
    r = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=30, temperature=0, stop=[","]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(",")]  # the text before the stop string
    assert "," not in r.choices[0].text


@pytest.mark.parametrize("precision", ["float32", "default"])
def test_sixteen_concurrent_streams_equal_their_solo_runs(
    precision: str, request: pytest.FixtureRequest
) -> None:
    """Greedy answers do not depend on what else the server runs: at the default precision
    (bf16 over w4a8, where a last bit can turn an int8 activation code) this holds because every
    kernel computes a row alone, whatever the batch, prefill or verification around it."""
    llm: LLM = request.getfixturevalue("llm" if precision == "float32" else "llm_default")
    app = create_app(llm, ServeOptions(served_name=NAME, max_seqs=16))
    questions = [
        "What is 2 + 2?", "Name a fruit.", "Say hello.", "What colour is the sky?",
        "Count to five.", "Name a planet.", "What is water made of?", "Give me a verb.",
        "What is the opposite of hot?", "Name an ocean.", "Spell cat.", "What day follows Monday?",
        "Name a metal.", "What is 3 times 3?", "Name a bird.", "What is the capital of Italy?",
    ]  # fmt: skip
    lengths = [4 + (i * 5) % 23 for i in range(16)]
    got: dict[int, list[str]] = {}

    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        start = threading.Barrier(16)

        def one(i: int) -> None:
            start.wait()
            stream = client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": questions[i]}],
                max_tokens=lengths[i], temperature=0, stream=True,
            )  # fmt: skip
            got[i] = [c.choices[0].delta.content or "" for c in stream if c.choices]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        metrics = httpx.get(f"{url}/metrics").text

    total = 0
    for i in range(16):
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": questions[i]}])
        want = plain_output(llm, ids, lengths[i])
        assert "".join(got[i]) == want.text, i
        total += len(want.token_ids)
    finished = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("eaglespec_requests_total{")
    )
    assert finished == 16
    lines = metrics.splitlines()
    generated = [x for x in lines if x.startswith("eaglespec_generation_tokens_total")]
    assert float(generated[0].rsplit(" ", 1)[1]) == total


def test_prompts_past_the_prefill_chunk_are_answered_as_alone(llm_default: LLM) -> None:
    """At the default precision, prompts of 413 and 697 tokens, prefilled by the server in
    chunks of 256 while another stream decodes, get the greedy answers of one whole prefill,
    token for token. Before a CPU prefill went through the attention kernel (2026-11-25) both
    were answered differently: the first chunk's attention (SDPA) and the next chunks' (the
    kernel) rounded otherwise than one whole prefill."""
    app = create_app(llm_default, ServeOptions(served_name=NAME, max_seqs=4))
    prompts = []
    for topic, facts in (("the history of the printing press", 14), ("how bees make honey", 26)):
        notes = " ".join(
            f"Fact {j}: this note is about {topic}, and it adds detail number {j} to the topic."
            for j in range(facts)
        )
        prompts.append(
            [{"role": "user", "content": f"{notes}\nSummarize the notes above in two sentences."}]
        )
    got: dict[int, str] = {}
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        def ask(key: int, msgs: list[dict[str, str]]) -> None:
            r = client.chat.completions.create(
                model=NAME, messages=msgs, max_tokens=40, temperature=0
            )  # fmt: skip
            got[key] = r.choices[0].message.content or ""

        other = threading.Thread(
            target=ask, args=(-1, [{"role": "user", "content": "Count to ten."}])
        )
        other.start()
        for i, msgs in enumerate(prompts):
            ask(i, msgs)
        other.join()
    for i, msgs in enumerate(prompts):
        ids = llm_default.tokenizer.encode_chat(msgs)
        assert len(ids) > 400, len(ids)  # two or three chunks of 256
        assert got[i] == plain_text(llm_default, ids, 40), i
