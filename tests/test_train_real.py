"""`eaglespec train` end to end, in its own process, on the real default model at its defaults
(the GGUF's own precision, bf16 w4a8): answering (which captures the features as it goes),
training from the shipped head, the held-out evaluation and the report's per-stage throughput,
and a run stopped after some answers resumes with them, answering only the rest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from commands import eaglespec, user_home
from eaglespec.draft.loader import load_eagle3
from eaglespec.heads import packaged_head
from eaglespec.model.loader import load_model
from eaglespec.registry import pull
from eaglespec.train.regen import read_samples
from eaglespec.train.trainer import has_bf16_matmul

pytestmark = pytest.mark.real


@pytest.mark.command("train")
def test_train_end_to_end_resumes_and_reports_throughput(tmp_path: Path) -> None:
    """`eaglespec train` as a user runs it, with only the sizes a test can afford: a first run
    that stops after two answers (an interrupted run keeps what it wrote), then the whole
    command, which resumes with those two and answers only the rest."""
    home = tmp_path / "home"
    home.mkdir()
    user_home(home)
    data = tmp_path / "prompts.jsonl"
    questions = [
        "What is 12 times 7?",
        "Name three primary colors.",
        "Write a haiku about rain.",
        "What is the capital of France?",
        "Give one tip for better sleep.",
        "Translate 'good morning' to Spanish.",
    ]
    data.write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in questions))
    out = tmp_path / "head"
    head = packaged_head("smollm2-135m")
    assert head is not None
    args = ["train", "--target", "smollm2-135m", "--data", str(data), "--out", str(out)]
    args += ["--init-from", str(head), "--keep-vocab", "--max-new-tokens", "24", "--heldout", "0.3"]
    args += ["--eval-prompts", "2", "--eval-max-tokens", "16", "--epochs", "1", "--ttt-steps", "2"]
    args += ["--batch-tokens", "512", "--warmup-steps", "1"]
    first = eaglespec([*args, "--regen-max-samples", "2", "--stop-after", "regen"], home, 600)
    assert first.returncode == 0, first.stderr
    responses = out / "work" / "responses.jsonl"
    kept = responses.read_text().splitlines()
    assert len(kept) == 2  # stopped there

    whole = eaglespec(args, home, 900)
    assert whole.returncode == 0, whole.stderr
    report = json.loads((out / "train_report.json").read_text())
    assert report["target_precision"]["quant"] == "w4a8"  # the commands' default precision
    # --train-dtype auto: bf16 only where this CPU has bf16 matmul kernels (an AVX2 CPU has not)
    assert report["train_dtype"] == (
        "bfloat16" if has_bf16_matmul(torch.device("cpu")) else "float32"
    )
    lines = responses.read_text().splitlines()
    assert lines[:2] == kept and len(lines) == len(questions)  # resumed: only the rest answered
    assert report["regen"]["new"] == len(questions) - 2
    # greedy answers brought their states with them: the feature stage prefilled nothing
    assert report["features_while_answering"] == len(questions) - 2
    assert report["throughput"]["features"]["tokens"] == 0
    for stage in ("regen", "train"):
        rate = report["throughput"][stage]
        assert rate["tokens"] > 0 and rate["seconds"] > 0
        assert rate["tokens_per_s"] == pytest.approx(rate["tokens"] / rate["seconds"], rel=0.1)
    samples = read_samples(responses)
    assert report["throughput"]["regen"]["tokens"] == sum(
        len(s.response) for s in samples if s.key not in {json.loads(k)["key"] for k in kept}
    )
    assert report["heldout_acceptance"]["prompts"] >= 1
    assert report["heldout_acceptance"]["mean_accept_length"] > 1.0  # the head drafts something
    target = load_model(pull("smollm2-135m", progress=False), dtype="auto", quant="auto")
    loaded = load_eagle3(out, target.model)  # the written head loads against its target
    shipped = load_eagle3(head, target.model)
    assert loaded.capture == shipped.capture
    # --keep-vocab at the same size: the shipped head's tokens, and so all its trained rows
    assert torch.equal(loaded.head.d2t.cpu(), shipped.head.d2t.cpu())
    assert "tokens/s" in whole.stderr + whole.stdout  # each stage's rate as it runs
