"""Shared fixtures: tiny seeded random models built from configs, no downloads.

`tiny_hf_folder` is a complete Hugging Face model folder (config.json, model.safetensors,
tokenizer.json with a small byte-level BPE trained here, tokenizer_config.json with a ChatML
template), so every load path, the CLI and the API run on it in milliseconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

CORPUS = [
    "Once upon a time there was a little model that wanted to decode faster.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens and the target verifies them in one pass.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _train_tokenizer(path: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": CHATML,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return int(tok.get_vocab_size())


@pytest.fixture(scope="session")
def tiny_hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny-llama")
    vocab = _train_tokenizer(path)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=2,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def real_gguf() -> Path:
    """`EAGLESPEC_TEST_GGUF` if set (skip when absent), else the registry's SmolLM2-135M-Instruct,
    pulled into the cache on first use so these tests run wherever the registry is reachable."""
    from eaglespec.registry import pull

    override = os.environ.get("EAGLESPEC_TEST_GGUF")
    if override is None:
        return pull("smollm2-135m", progress=False)
    if not Path(override).is_file():
        pytest.skip(f"EAGLESPEC_TEST_GGUF={override} not present")
    return Path(override)


@pytest.fixture(autouse=True)
def _calibration_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    """Stored calibrations (calibration.py) go to a per-session temporary folder, never the
    user's cache: a test run must not leave a machine's draft-shape choice behind."""
    import eaglespec.calibration as calibration

    folder = tmp_path_factory.getbasetemp() / "eaglespec-cache"
    monkeypatch.setattr(calibration, "cache_dir", lambda: folder)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one thread, so OpenMP never spins against a busy machine (10-100x slower).
    A test module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
