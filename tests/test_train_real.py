"""`eaglespec train` end to end on the real default model at its defaults (the GGUF's own
precision, bf16 w4a8): answering, feature capture, training from the shipped head, the held-out
evaluation and the report's per-stage throughput, and a run stopped after some answers resumes
with them, answering only the rest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglespec.draft.loader import load_eagle3
from eaglespec.heads import packaged_head
from eaglespec.model.loader import load_model
from eaglespec.train.pipeline import PipelineConfig, run
from eaglespec.train.regen import RegenConfig, read_samples
from eaglespec.train.trainer import TrainConfig

pytestmark = pytest.mark.real


def test_train_end_to_end_resumes_and_reports_throughput(real_gguf: Path, tmp_path: Path) -> None:
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
    cfg = PipelineConfig(
        target=str(real_gguf),
        data=(str(data),),
        out=out,
        regen=RegenConfig(max_new_tokens=24, max_samples=2),
        init_from=head,
        heldout=0.3,
        eval_prompts=2,
        eval_max_tokens=16,
        stop_after="regen",
        train=TrainConfig(epochs=1, ttt_steps=2, batch_tokens=512, warmup_steps=1),
    )
    logs: list[str] = []
    first = run(cfg, log=logs.append, progress=False)
    assert first["target_precision"]["quant"] == "w4a8"  # the commands' default precision
    responses = out / "work" / "responses.jsonl"
    kept = responses.read_text().splitlines()
    assert len(kept) == 2  # stopped there (an interrupted run keeps what it wrote)

    full = PipelineConfig(
        **{**_fields(cfg), "regen": RegenConfig(max_new_tokens=24), "stop_after": "eval"}
    )
    report = run(full, log=logs.append, progress=False)
    lines = responses.read_text().splitlines()
    assert lines[:2] == kept and len(lines) == len(questions)  # resumed: only the rest answered
    assert report["regen"]["new"] == len(questions) - 2
    for stage in ("regen", "features", "train"):
        rate = report["throughput"][stage]
        assert rate["tokens"] > 0 and rate["seconds"] > 0
        assert rate["tokens_per_s"] == pytest.approx(rate["tokens"] / rate["seconds"], rel=0.1)
    samples = read_samples(responses)
    assert report["throughput"]["regen"]["tokens"] == sum(
        len(s.response) for s in samples if s.key not in {json.loads(k)["key"] for k in kept}
    )
    assert report["heldout_acceptance"]["prompts"] >= 1
    assert report["heldout_acceptance"]["mean_accept_length"] >= 1.0
    target = load_model(real_gguf, dtype="auto", quant="auto")
    loaded = load_eagle3(out, target.model)  # the written head loads against its target
    assert loaded.capture == load_eagle3(head, target.model).capture
    assert any("tokens/s" in line for line in logs)


def _fields(cfg: PipelineConfig) -> dict[str, object]:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}
