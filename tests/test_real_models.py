"""Real registry models (pulled once into the cache): greedy output in fp32 equals transformers' own
GGUF loading of the same file, token for token, for raw and chat prompts.

SmolLM2-135M-Instruct (the default model, Llama architecture: exercises the Q/K un-permute) and
Gemma-3-270M (gemma3: four norms a layer stored as 1 + weight, sliding-window layers, a 262K
SentencePiece vocabulary, Q4_K/Q5_0/Q6_K/Q8_0; a base model whose file carries no chat template,
so raw prompts only) run in every test run; Qwen2.5-Coder-0.5B (qwen2: QKV biases, untied head,
Q4_K/Q6_K) is marked slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eaglespec import LLM, SamplingParams
from eaglespec.registry import pull

pytestmark = pytest.mark.real
transformers = pytest.importorskip("transformers")

MODELS = [
    pytest.param("smollm2-135m", id="smollm2"),
    pytest.param("qwen2.5-coder-0.5b", id="qwen0.5b", marks=pytest.mark.slow),
    pytest.param("gemma3-270m", id="gemma3"),
]
PROMPTS = {
    "raw-story": ("Once upon a time, in a village by the sea,", False),
    "raw-code": ("def fibonacci(n):\n    ", False),
    "chat-fact": ("What is the capital of France? Answer in one sentence.", True),
    "chat-explain": ("Explain in two sentences why the sky is blue.", True),
}
NEW_TOKENS = 32
EXPECTED_DIMS = {
    "smollm2-135m": (30, 576, 9, 3, True),
    "qwen2.5-coder-0.5b": (24, 896, 14, 2, False),
    "gemma3-270m": (18, 640, 4, 1, True),
}


@pytest.fixture(scope="module", params=MODELS)
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def gguf_path(name: str) -> Path:
    return pull(name, progress=False)


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> LLM:
    return LLM(str(gguf_path), dtype="float32", quant="none", draft="none", progress=False)


@pytest.fixture(scope="module")
def reference(gguf_path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return model, tok


def test_config_read_from_the_file(name: str, ours: LLM) -> None:
    cfg = ours.config
    dims = (
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.tie_word_embeddings,
    )
    assert dims == EXPECTED_DIMS[name]


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_greedy_tokens_equal_transformers(ours: LLM, reference, prompt: str) -> None:
    model, tok = reference
    text, chat = PROMPTS[prompt]
    if chat and ours.tokenizer.chat_template is None:
        pytest.skip("the file carries no chat template (a base model)")
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


def test_greedy_tokens_equal_transformers_past_the_sliding_window(ours: LLM, reference) -> None:
    """A prompt of about 700 tokens and 24 new ones: Gemma 3's sliding layers (window 512)
    then mask keys in the prefill and in every decode step; the other models attend all."""
    model, tok = reference
    text = " ".join(f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box." for i in range(80))
    ref_ids = tok(text)["input_ids"]
    assert 600 <= len(ref_ids) <= 800, len(ref_ids)
    assert ours.encode(text, chat=False) == list(ref_ids)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ref_ids]), max_new_tokens=24, do_sample=False)
    out = ours.generate([ref_ids], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert out.token_ids == ref[0, len(ref_ids) :].tolist()
