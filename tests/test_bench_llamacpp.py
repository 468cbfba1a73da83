"""llama.cpp as a reference engine in `eaglespec bench`: the errors before any load (no package, not
a GGUF, sampling, a GPU target), the report's "n/a (another engine)" treatment on hand-made
generations, and one real run on SmolLM2 when llama-cpp-python and the model are both here."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from eaglespec.bench.aggregate import summarize
from eaglespec.bench.lineup import DraftSources, check_methods, default_methods
from eaglespec.bench.llamacpp import check_gguf
from eaglespec.bench.questions import Question
from eaglespec.bench.report import render_report, summary_table
from eaglespec.bench.runner import Generation
from eaglespec.cli import main
from eaglespec.errors import InvalidRequestError
from eaglespec.requests import GenerationStats, RequestOutput

NO_DRAFTS = DraftSources(eagle3=None, draft_model=None)


@pytest.fixture
def no_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError


@pytest.fixture
def fake_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    """An importable stand-in (CPU-only build), so the checks after the import run without it."""
    module = types.ModuleType("llama_cpp")
    module.__version__ = "0.0.0-fake"  # type: ignore[attr-defined]
    module.llama_supports_gpu_offload = lambda: False  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp", module)


def _questions_file(folder: Path) -> Path:
    path = folder / "q.jsonl"
    path.write_text(json.dumps({"question_id": 1, "turns": ["hi"]}) + "\n")
    return path


def test_llama_cpp_is_opt_in() -> None:
    both = DraftSources(eagle3="head", draft_model="small")
    assert "llama.cpp" not in default_methods(NO_DRAFTS)
    assert "llama.cpp" not in default_methods(both)


def test_missing_package_is_a_clear_error_before_any_load(
    no_llama_cpp: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(InvalidRequestError, match="pip install llama-cpp-python"):
        check_methods(["llama.cpp"], NO_DRAFTS)
    out = tmp_path / "out"
    argv = ["bench", "--questions", str(_questions_file(tmp_path)), "--methods", "llama.cpp"]
    assert main([*argv, "--model", "no-such-model", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "needs the llama-cpp-python package" in err and "pip install llama-cpp-python" in err
    assert not out.exists()


def test_a_folder_model_is_not_a_gguf(
    fake_llama_cpp: None, tiny_hf_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["bench", "--questions", str(_questions_file(tmp_path)), "--methods", "llama.cpp"]
    assert main([*argv, "--model", str(tiny_hf_folder), "--out", str(out)]) == 2
    assert "needs a GGUF model file" in capsys.readouterr().err and not out.exists()
    weights = tiny_hf_folder / "model.safetensors"
    with pytest.raises(InvalidRequestError, match="is not a GGUF file"):
        check_gguf(weights)


def test_sampling_and_a_gpu_target_are_refused(fake_llama_cpp: None) -> None:
    with pytest.raises(InvalidRequestError, match="greedy only"):
        check_methods(["llama.cpp"], NO_DRAFTS, temperature=0.7)
    with pytest.raises(InvalidRequestError, match="runs on the CPU only"):
        check_methods(["llama.cpp"], NO_DRAFTS, device="cuda")
    assert check_methods(["llama.cpp"], NO_DRAFTS) == ["plain", "llama.cpp"]


def _gen(method: str, turn: int, ids: list[int], seconds: float) -> Generation:
    # Prefill takes a tenth of the time; the rest decodes the tokens after the first.
    stats = GenerationStats(3, len(ids), prefill_seconds=seconds / 10, decode_seconds=seconds * 0.9)
    out = RequestOutput(0, [1, 2, 3], token_ids=ids, finish_reason="length", stats=stats)
    return Generation(method, 0, turn, [1, 2, 3], out, 1000)


def test_a_reference_engine_is_not_applicable_for_losslessness() -> None:
    # llama.cpp: twice plain's speed; turn 0 equals plain's, turn 1 differs at token 2.
    question = Question("set", 5, "math", ("a", "b"))
    gens = [
        _gen("plain", 0, [1, 2, 3, 4], 1.0),
        _gen("plain", 1, [5, 6, 7, 8], 1.0),
        _gen("llama.cpp", 0, [1, 2, 3, 4], 0.5),
        _gen("llama.cpp", 1, [5, 6, 9, 8], 0.5),
    ]
    summary = summarize(gens, [question], ["plain", "llama.cpp"], group_by="category", greedy=True)
    ref = summary.overall["llama.cpp"]
    check = ref.lossless
    assert check.lossless is None and check.reference
    assert (check.compared, check.mismatches, check.mean_first_difference) == (2, 1, 2.0)
    assert ref.speedup == pytest.approx(2.0)
    assert ref.mean_accept_length is None and ref.accept_rate_by_position == ()
    assert ref.round_time is not None and ref.round_time.draft_ms is None  # per decode step
    assert not summary.overall["plain"].lossless.reference
    table = summary_table(summary.overall)
    assert "n/a (another engine): 1/2 match plain" in table and "**no**" not in table
    report = render_report(
        summary,
        command="eaglespec bench ...",
        settings={"temperature": 0.0, "questions": ["set.jsonl"], "max_tokens": 4},
        environment=_environment(),
        descriptions={"plain": "plain decoding", "llama.cpp": "llama.cpp plain decoding"},
        memory_scope="rss",
        plots=[],
    )
    assert "eaglespec plain / llama.cpp decode ratio **0.50**" in report
    assert "### Mean acceptance length" in report
    acceptance = report.split("### Mean acceptance length")[1].split("###")[0]
    assert "llama.cpp" not in acceptance  # no draft, no acceptance column


def _environment() -> dict[str, Any]:
    keys = ("date", "torch", "threads", "device", "dtype", "quant", "compile", "cpu")
    return {
        **dict.fromkeys(keys, "x"),
        "gpu": None,
        "eaglespec": {"git": None},
        "model": {"path": "m.gguf"},
    }


@pytest.mark.real
def test_real_run_on_smollm2(tmp_path: Path) -> None:
    """1 question, 8 tokens: llama.cpp's tokens are text, and its row reaches both outputs."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from eaglespec.bench.llamacpp import LlamaCppMethod
    from eaglespec.config import SamplingParams
    from eaglespec.model.loader import load_model
    from eaglespec.registry import is_pulled, model_path

    if not is_pulled("smollm2-135m"):
        pytest.skip("smollm2-135m is not in the cache (eaglespec pull smollm2-135m)")
    path = model_path("smollm2-135m")
    questions = tmp_path / "q.jsonl"
    turn = "What is the capital of France? Answer in one sentence."
    questions.write_text(json.dumps({"question_id": 1, "category": "fact", "turns": [turn]}) + "\n")
    out = tmp_path / "out"
    argv = ["bench", "--questions", str(questions), "--model", str(path), "--quiet"]
    argv += ["--methods", "llama.cpp", "--max-tokens", "8", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    assert list(data["summary"]) == ["plain", "llama.cpp"]
    ref = data["summary"]["llama.cpp"]
    assert ref["lossless"]["lossless"] is None and ref["lossless"]["reference"] is True
    assert ref["new_tokens"] > 0 and ref["tokens_per_second"] > 0 and ref["speedup"] > 0
    assert data["environment"]["llama_cpp"]["version"] == llama_cpp.__version__
    report = (out / "report.md").read_text()
    assert "| llama.cpp |" in report and "eaglespec plain / llama.cpp decode ratio" in report
    assert (out / "speedup.png").exists() and not (out / "accept_length.png").exists()

    # The ids it generates are text in eaglespec's vocabulary, and the same as llama.cpp's own.
    target = load_model(path)
    method = LlamaCppMethod(path, target.model.device)
    prompt = target.tokenizer.encode_chat([{"role": "user", "content": turn}])
    first = method.generate(target, prompt, SamplingParams(max_tokens=8))
    again = method.generate(target, prompt, SamplingParams(max_tokens=8))
    assert first.token_ids == again.token_ids  # each pays its own prefill: same state, same tokens
    assert 0 < len(first.token_ids) <= 8 and first.stats.prefill_seconds > 0
    text = target.tokenizer.decode(first.token_ids)
    assert text == first.text and sum(c.isalpha() for c in text) >= 5
    assert method._llama.detokenize(first.token_ids).decode() == text
