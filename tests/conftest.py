"""Shared fixtures: tiny seeded random models built from configs, no downloads.

`tiny_hf_folder` is a complete Hugging Face model folder (config.json, model.safetensors,
tokenizer.json with a small byte-level BPE trained here, tokenizer_config.json with a ChatML
template), so every load path, the CLI and the API run on it in milliseconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from browser import find_browser

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


@pytest.fixture(scope="session")
def default_plain():
    """The default model at the commands' default precision (`--dtype auto --quant auto`), to
    decode plainly in this process: what each command's answers are compared with."""
    from eaglespec import LLM
    from eaglespec.registry import pull

    path = pull("smollm2-135m", progress=False)
    return LLM(str(path), dtype="auto", quant="auto", draft="none", progress=False)


@pytest.fixture(autouse=True)
def _calibration_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    """Stored calibrations (calibration.py) and ranked tokenizer merges (merge_cache.py) go to a
    per-session temporary folder, never the user's cache: a test run must not leave a machine's
    draft-shape choice behind, nor test what an earlier run left there."""
    import eaglespec.calibration as calibration
    import eaglespec.tokenizer.merge_cache as merge_cache

    folder = tmp_path_factory.getbasetemp() / "eaglespec-cache"
    monkeypatch.setattr(calibration, "cache_dir", lambda: folder)
    monkeypatch.setattr(merge_cache, "cache_dir", lambda: folder)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one thread, so OpenMP never spins against a busy machine (10-100x slower).
    A test module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- The run's own summary: which commands ran end to end at their defaults, and what did not run.

COMMANDS = ("generate", "chat", "serve", "bench", "train", "pull")
_COMMAND_OF: dict[str, str] = {}  # test id -> the command it runs
_OUTCOMES: dict[str, tuple[str, float]] = {}  # test id -> (passed / failed / skipped, seconds)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `command("generate")` etc. run that command as a user types it, in its own
    process, on the default model at its defaults."""
    for item in items:
        mark = item.get_closest_marker("command")
        if mark is not None:
            assert mark.args and mark.args[0] in COMMANDS, f"{item.nodeid}: command {mark.args}"
            _COMMAND_OF[item.nodeid] = mark.args[0]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # A test's outcome: failed or skipped in any phase, else passed.
    seen, took = _OUTCOMES.get(report.nodeid, ("passed", 0.0))
    if report.failed or report.skipped:
        seen = "failed" if report.failed else "skipped"
    _OUTCOMES[report.nodeid] = (seen, took + report.duration)


def _kernel_line() -> str:
    from eaglespec.model import w4a8

    missing = w4a8.available()
    if missing is None:
        # use_avx2(False) is the default setting, and says whether the CPU still takes AVX2
        path = "AVX2" if torch.ops.eaglespec_w4a8.use_avx2(False) else "AVX-512 VNNI"
        return (
            f"w4a8 kernel: runs on this CPU ({path} path), so the default-precision tests ran "
            "bf16 w4a8"
        )
    return (
        f"w4a8 kernel: NOT available ({missing}); the commands' default precision here is fp32, "
        "so the tests of the default precision ran the fp32 fallback instead of bf16 w4a8"
    )


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    command_of, outcomes = _COMMAND_OF, _OUTCOMES
    tr = terminalreporter
    tr.section("what this run covered")
    tr.write_line("commands run end to end in their own process, default model, default settings:")
    for command in COMMANDS:
        ids = [n for n, c in command_of.items() if c == command]
        ran = [outcomes[n] for n in ids if n in outcomes]
        if not ran:
            tr.write_line(f"  {command:9s} not run ({'deselected' if ids else 'no test'})")
            continue
        counts = {k: sum(1 for o, _ in ran if o == k) for k in ("passed", "failed", "skipped")}
        said = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
        tr.write_line(f"  {command:9s} {said} ({sum(t for _, t in ran):.0f} s)")
    tr.write_line(_kernel_line())
    if importlib.util.find_spec("llama_cpp") is None:
        tr.write_line(
            "llama-cpp-python: not installed (not in the test extras: installing it compiles "
            "llama.cpp for many minutes), so the bench's llama.cpp comparison did not run"
        )
    browser = find_browser()
    if browser.missing:
        tr.write_line(f"chat page in a headless browser: not run here: {browser.missing}")
    markexpr = config.getoption("markexpr", "")
    if markexpr:
        tr.write_line(
            f"selected by -m {markexpr!r}: `python -m pytest -m compile` runs the torch.compile "
            "tests, `-m slow` the slow real-model ones (Qwen2's); .ci/run runs both after this"
        )
    skipped = sum(1 for o, _ in outcomes.values() if o == "skipped")
    if skipped:
        tr.write_line(
            f"{skipped} tests skipped here; each with its reason in the short test summary (-ra)"
        )
    tr.write_line(f"test time: {sum(t for _, t in outcomes.values()):.0f} s")
