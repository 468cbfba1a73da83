"""The command line, run as a user would: `python -m eaglespec generate ...` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eaglespec.cli import main


def test_generate_json_has_text_ids_and_stats(tiny_hf_folder: Path) -> None:
    cmd = [sys.executable, "-m", "eaglespec", "generate", "--model", str(tiny_hf_folder)]
    cmd += ["--json", "--max-tokens", "6", "--ignore-eos", "Once upon a time"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(proc.stdout)
    assert len(result["token_ids"]) == 6 and result["finish_reason"] == "length"
    assert result["prompt_token_ids"] and isinstance(result["text"], str)
    stats = result["stats"]
    for key in ("new_tokens", "tokens_per_second", "prefill_seconds", "decode_seconds"):
        assert key in stats
    assert stats["new_tokens"] == 6


def test_generate_streams_text_then_report(tiny_hf_folder: Path, capsys) -> None:
    args = ["generate", "--model", str(tiny_hf_folder), "--raw", "--max-tokens", "4", "Once"]
    assert main([*args, "--ignore-eos", "--seed", "3", "--temperature", "0.8"]) == 0
    captured = capsys.readouterr()
    assert "4 tokens" in captured.err and "tok/s" in captured.err


def test_pull_list(capsys) -> None:
    assert main(["pull", "--list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "qwen2.5-coder-1.5b" in out


def test_method_defaults_draft_with_the_shipped_head(tiny_hf_folder: Path) -> None:
    """What runs when the user leaves method, draft or lookup unset (LLM and every command):
    eagle3 with the head shipped for the model, prompt lookup grafted in; plain decoding for a
    model no head ships for; `--draft none` for none."""
    from eaglespec.heads import packaged_head
    from eaglespec.methods import DEFAULT_LOOKUP_TOKENS, resolve_method

    head = packaged_head("smollm2-135m")
    assert head is not None and (head / "config.json").is_file()
    shipped = ("eagle3", str(head), DEFAULT_LOOKUP_TOKENS)
    assert resolve_method("smollm2-135m", None, None, None) == shipped
    assert resolve_method("smollm2-135m", "eagle3", None, None) == shipped
    assert resolve_method("/x/SmolLM2-135M-Instruct.Q4_1.gguf", None, None, None) == shipped
    assert resolve_method("smollm2-135m", None, None, 0) == ("eagle3", str(head), 0)
    assert resolve_method("smollm2-135m", "eagle3", "none", None) == ("eagle3", None, 4)
    assert resolve_method("smollm2-135m", None, "none", None) == ("none", None, 0)
    assert resolve_method("smollm2-135m", "lookup", None, None) == ("lookup", None, 0)
    assert resolve_method("smollm2-135m", None, "random", None) == ("eagle3", "random", 4)
    assert resolve_method(str(tiny_hf_folder), None, None, None) == ("none", None, 0)


@pytest.mark.parametrize("command", ["train", "export"])
def test_capture_that_is_not_integers_names_the_flag(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Parsed before anything loads: a clear one-line error, nothing written.
    out = tmp_path / "out"
    args = {
        "train": ["train", "--data", str(tmp_path / "d.jsonl"), "--out", str(out)],
        "export": ["export", str(tmp_path), "--target", "smollm2-135m", "--out", str(out)],
    }[command]
    assert main([*args, "--capture", "2,x,27"]) == 2
    assert "--capture takes comma-separated integers, got '2,x,27'" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--synth-prompts", "--summaries", "--completions", "--followups"])
def test_train_refuses_a_negative_number_of_prompts(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = ["train", "--data", str(tmp_path / "d.jsonl"), "--out", str(out), flag, "-1"]
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    assert f"argument {flag}: must be 0 or more, got -1" in capsys.readouterr().err
    assert not out.exists()


def test_train_ttt_decay_reaches_the_trainer_and_is_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--ttt-decay sets the steps' loss weights (decay^j); outside (0, 1] it is a parse error."""
    import eaglespec.train.command as command

    seen = []
    monkeypatch.setattr(command, "run", lambda cfg, log: seen.append(cfg))
    base = ["train", "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "out")]
    assert main([*base, "--ttt-steps", "2", "--ttt-decay", "0.5"]) == 0
    assert main(base) == 0
    assert [(c.train.ttt_steps, c.train.decay) for c in seen] == [(2, 0.5), (7, 0.8)]
    for bad in ("0", "1.5", "-0.2"):
        with pytest.raises(SystemExit) as stop:
            main([*base, "--ttt-decay", bad])
        assert stop.value.code == 2
        assert f"argument --ttt-decay: must be in (0, 1], got {float(bad)}" in (
            capsys.readouterr().err
        )
    assert not (tmp_path / "out").exists()


def test_train_keep_vocab_needs_a_head_to_continue(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = ["train", "--data", str(tmp_path / "d.jsonl"), "--out", str(out), "--keep-vocab"]
    assert main(args) == 2
    assert (
        "--keep-vocab keeps a continued head's tokens: pass --init-from" in capsys.readouterr().err
    )
    assert not out.exists()


def test_lookup_tokens_with_another_method_or_negative_is_an_error(
    tiny_hf_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Prompt lookup is grafted into an EAGLE-3 head's drafts: asked of another method, or a
    negative count, is a one-line error naming it, not silently ignored."""
    base = ["generate", "--model", str(tiny_hf_folder), "--max-tokens", "2", "Hi"]
    assert main([*base, "--method", "lookup", "--lookup-tokens", "2"]) == 2
    assert "need method eagle3" in capsys.readouterr().err
    assert main([*base, "--draft", "random", "--lookup-tokens", "-1"]) == 2
    assert "lookup tokens (-1)" in capsys.readouterr().err
    # eagle3 with lookup (the default count) runs; --lookup-tokens 0 runs the head alone
    assert main([*base, "--draft", "random", "--no-compare"]) == 0
    assert "prompt-lookup tokens a round" in capsys.readouterr().err
    assert main([*base, "--draft", "random", "--lookup-tokens", "0", "--no-compare"]) == 0
    assert "prompt-lookup" not in capsys.readouterr().err


def test_draft_min_prob_is_checked_and_reported(
    tiny_hf_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--draft-min-prob outside [0, 1) is a one-line error naming the flag, in generate and in
    bench (before anything loads); a valid one shows in the draft's load report."""
    base = ["generate", "--model", str(tiny_hf_folder), "--max-tokens", "2", "Hi"]
    for bad in ("1", "-0.5"):
        assert main([*base, "--draft", "random", "--draft-min-prob", bad]) == 2
        assert "--draft-min-prob" in capsys.readouterr().err
    bench = ["bench", "--model", str(tiny_hf_folder), "--questions", "none.jsonl"]
    assert main([*bench, "--draft-min-prob", "1.5"]) == 2
    assert "--draft-min-prob" in capsys.readouterr().err
    assert main([*base, "--draft", "random", "--draft-min-prob", "0.2", "--no-compare"]) == 0
    assert "chains stop below path probability 0.2" in capsys.readouterr().err


def test_draft_tokens_threads_and_tree_that_cannot_run_name_the_flag(
    tiny_hf_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A negative --draft-tokens, 0 under adaptive speculation (which would silently draft 1),
    --threads below 1 and a tree of depth 0 are one-line errors naming what is wrong, not a
    traceback or a silently changed setting; --draft-tokens 0 with speculation on runs."""
    base = ["generate", "--model", str(tiny_hf_folder), "--max-tokens", "2", "--draft", "random"]
    assert main([*base, "--draft-tokens", "-2", "Hi"]) == 2
    assert "--draft-tokens must be at least 0, got -2" in capsys.readouterr().err
    assert main([*base, "--draft-tokens", "0", "Hi"]) == 2
    assert "adaptive speculation picks chains of 0 to --draft-tokens" in capsys.readouterr().err
    assert main([*base, "--draft-tokens", "0", "--speculation", "on", "--no-compare", "Hi"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main([*base, "--threads", "-2", "Hi"])
    assert exit_.value.code == 2
    assert "--threads: at least 1, got -2" in capsys.readouterr().err
    assert main([*base, "--tree", "0,4,16", "Hi"]) == 2
    assert "tree depth 0, top_k 4: both must be at least 1" in capsys.readouterr().err
