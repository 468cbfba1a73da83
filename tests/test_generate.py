"""Plain decoding through the public API on a tiny random model: greedy equals a hand-written argmax
loop, batches equal solo runs, seeded sampling repeats, and limits are honoured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eaglespec import LLM, SamplingParams
from eaglespec.errors import InvalidRequestError, PromptTooLongError


@pytest.fixture(scope="module")
def llm(tiny_hf_folder: Path) -> LLM:
    return LLM(str(tiny_hf_folder), progress=False)


def _reference_greedy(llm: LLM, prompt: list[int], n: int) -> list[int]:
    """No cache: the full sequence through the model at every step."""
    ids = list(prompt)
    for _ in range(n):
        x = torch.tensor([ids])
        pos = torch.arange(len(ids))[None]
        logits = llm.model(x, pos, llm.model.new_cache(1, len(ids))).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_greedy_equals_uncached_argmax_loop(llm: LLM) -> None:
    prompt = llm.encode("Once upon a time", chat=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == _reference_greedy(llm, prompt, 12)
    assert out.finish_reason == "length" and out.stats.new_tokens == 12
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_ragged_batch_equals_solo_runs(llm: LLM) -> None:
    prompts = ["The quick brown fox", "def add(a, b):", "Speculative"]
    lengths = [5, 9, 3]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    batch = llm.generate(prompts, params, chat=False)
    for prompt, p, out in zip(prompts, params, batch, strict=True):
        solo = llm.generate(prompt, p, chat=False)[0]
        assert out.token_ids == solo.token_ids and len(out.token_ids) == p.max_tokens


def test_seeded_sampling_repeats_and_ignores_batch_neighbours(llm: LLM) -> None:
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    a = llm.generate("Once", p, chat=False)[0].token_ids
    assert a == llm.generate("Once", p, chat=False)[0].token_ids
    other = SamplingParams(max_tokens=4, temperature=0.5, seed=1, ignore_eos=True)
    assert llm.generate(["Once", "The"], [p, other], chat=False)[0].token_ids == a


def test_stream_chunks_add_up_to_text(llm: LLM) -> None:
    events = list(llm.stream("hello", SamplingParams(max_tokens=15, ignore_eos=True)))
    final = events[-1].output
    assert final is not None
    assert "".join(e.text for e in events) == final.text
    assert sum(len(e.token_ids) for e in events) == len(final.token_ids) == 15


def test_eos_ends_generation_and_is_not_returned(llm: LLM) -> None:
    prompt = llm.encode("Once upon a time", chat=False)
    first = _reference_greedy(llm, prompt, 3)
    out = llm.generate([prompt], SamplingParams(max_tokens=10, stop_token_ids=(first[2],)))[0]
    assert out.token_ids == first[:2] and out.finish_reason == "stop"


def test_stop_string_cuts_text(llm: LLM) -> None:
    full = llm.generate("Once", SamplingParams(max_tokens=20, ignore_eos=True), chat=False)[0]
    stop = full.text[5:8]
    assert stop and stop not in full.text[:5]
    out = llm.generate("Once", SamplingParams(max_tokens=20, stop=(stop,)), chat=False)[0]
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop)]


def test_chat_template_is_applied(llm: LLM) -> None:
    ids = llm.encode("hi", chat=True)
    assert llm.tokenizer.decode(ids, skip_special=False).endswith("<|im_start|>assistant\n")
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3))
    assert out.prompt_token_ids == ids


def test_context_limit(llm: LLM) -> None:
    limit = llm.config.context_limit  # 128
    with pytest.raises(PromptTooLongError, match="128"):
        llm.generate([[5] * limit], SamplingParams(max_tokens=1))
    out = llm.generate([[5] * (limit - 3)], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], SamplingParams())


def test_repetition_penalty_changes_greedy_output(llm: LLM) -> None:
    plain = llm.generate("Once", SamplingParams(max_tokens=30, ignore_eos=True), chat=False)[0]
    pen = SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=5.0)
    out = llm.generate("Once", pen, chat=False)[0]
    assert len(set(out.token_ids)) >= len(set(plain.token_ids))
    assert out.token_ids != plain.token_ids
