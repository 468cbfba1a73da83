"""`eaglespec generate`, `bench` and `pull` as a user types them: each its own process with nothing
but the prompt (or the questions) given, so the model is the default one at the GGUF's own
precision, drafting with the shipped EAGLE-3 head and prompt lookup under adaptive speculation.
Their answers equal plain greedy decoding of the same model at the same precision in this
process; the streamed text arrives in pieces while the command runs; the reports say what ran.
(`serve` and `chat`: tests/test_serve_process.py; `train`: tests/test_train_real.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commands import DEFAULT_MODEL, command_env, eaglespec, plain_output, plain_text, user_home
from eaglespec import LLM
from eaglespec.bench.lineup import DraftSources, default_methods
from eaglespec.model import w4a8

pytestmark = pytest.mark.real

# A request whose answer quotes its context (lookup grafts) and one that does not.
PROMPTS = [
    "Repeat this list, then add one more item: apples, pears, plums, cherries, apricots, figs.",
    "Write a Python function that reverses a string.",
]
PRECISION = "bfloat16, quant w4a8" if w4a8.available() is None else "float32, quant none"


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return user_home(tmp_path_factory.mktemp("home"))


def _streamed(args: list[str], home: Path) -> tuple[list[str], str, int]:
    """stdout's pieces as they were read while the process ran, its stderr, its status."""
    # Python buffers a pipe's writes unless told otherwise: the command must flush them itself.
    env = {k: v for k, v in command_env(home).items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "eaglespec", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    pieces = []
    deadline = time.monotonic() + 300
    while chunk := os.read(proc.stdout.fileno(), 65536):
        pieces.append(chunk)
        assert time.monotonic() < deadline, "generate did not finish within 300 s"
    err = proc.stderr.read().decode()
    status = proc.wait(timeout=60)
    return [p.decode() for p in pieces], err, status


@pytest.mark.command("generate")
@pytest.mark.parametrize("prompt", PROMPTS, ids=["quoting", "code"])
def test_generate_streams_the_plain_answer_and_compares(
    prompt: str, home: Path, default_plain: LLM
) -> None:
    """No option but --max-tokens: the text streams in pieces (a token or a few at a time, not
    one write at the end), equals plain greedy decoding's, and the report names the default
    precision, the shipped head with lookup, adaptive speculation and the comparison with plain
    decoding of the same prompt ("same output")."""
    pieces, err, status = _streamed(["generate", "--max-tokens", "48", prompt], home)
    assert status == 0, err
    want = plain_text(default_plain, default_plain.encode(prompt), 48)
    assert "".join(pieces) == want + "\n"
    assert len(pieces) >= 4, f"stdout came in {len(pieces)} piece(s): not streamed"
    assert f"{DEFAULT_MODEL_FILE}: {PRECISION}" in err
    assert "[eagle3: EAGLE-3 head smollm2-135m" in err and "prompt-lookup tokens a round" in err
    assert "adaptive speculation" in err
    assert re.search(r"\[\d+ tokens, [\d.]+ tok/s decode", err), err
    assert "plain decoding of the same prompt" in err
    assert "same output" in err and "speculative speedup" in err


DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.command("generate")
def test_generate_json_at_its_defaults(home: Path, default_plain: LLM) -> None:
    """`--json`: one object, the plain greedy tokens, the method and speculation it ran and the
    round statistics that make its acceptance (rounds, drafts, accepted by position)."""
    proc = eaglespec(["generate", "--json", "--max-tokens", "40", PROMPTS[0]], home)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    ids = default_plain.encode(PROMPTS[0])
    assert result["prompt_token_ids"] == ids
    want = plain_output(default_plain, ids, 40)
    assert (result["text"], result["token_ids"]) == (want.text, want.token_ids)
    assert result["finish_reason"] == want.finish_reason
    assert (result["method"], result["speculation"]) == ("eagle3", "adaptive")
    precision = result["precision"]
    assert f"{precision['dtype']}, quant {precision['quant']}" == PRECISION
    stats = result["stats"]
    n = len(want.token_ids)
    assert stats["new_tokens"] == n
    # The prefill's token, then each round's accepted drafts and the target's own token (the
    # last round's cut at the end): the counts add up.
    assert 1 + stats["rounds"] + stats["accepted_tokens"] >= n > stats["rounds"]
    assert sum(stats["accepted_by_position"]) == stats["accepted_tokens"]
    assert stats["mean_accept_length"] == pytest.approx(
        1 + stats["accepted_tokens"] / stats["rounds"]
    )


@pytest.mark.command("generate")
def test_generate_never_imports_the_compiler(home: Path) -> None:
    """A command that does not compile never imports torch's compiler front end (dynamo, 1.5 s
    of every start on the 2-core machine): `generate` at its defaults, in a process of its own,
    loads the model and the head, drafts and answers without it."""
    code = (
        "import sys\n"
        "from eaglespec.cli import main\n"
        "try:\n"
        "    main(['generate', '--max-tokens', '8', '--no-compare', 'Name a colour.'])\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "print('dynamo imported:', 'torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=command_env(home), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("dynamo imported: False"), done.stdout


@pytest.mark.command("bench")
def test_bench_at_its_defaults(home: Path, tmp_path: Path) -> None:
    """`eaglespec bench` on one two-turn question: every default method (plain, the head's chain
    and default 4,4,16 tree, with and without lookup, adaptive, lookup) ran at the default
    precision with the shipped head, each lossless on both turns; the round split adds up."""
    questions = tmp_path / "q.jsonl"
    turns = [PROMPTS[1], "Now make it reverse the words of a sentence instead."]
    questions.write_text(json.dumps({"question_id": 1, "category": "code", "turns": turns}) + "\n")
    out = tmp_path / "bench"
    args = ["bench", "--questions", str(questions), "--max-tokens", "32", "--out", str(out)]
    proc = eaglespec([*args, "--quiet"], home)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    env = results["environment"]
    assert f"{env['dtype']}, quant {env['quant']}" == PRECISION
    summary = results["summary"]
    # every method that can run with a shipped head (tests/test_bench.py lists them)
    assert list(summary) == default_methods(DraftSources(eagle3="shipped", draft_model=None))
    assert "eagle3-adaptive" in summary and "eagle3-tree" in summary
    assert "EAGLE-3 head smollm2-135m" in results["methods"]["eagle3-chain"]
    assert "tree depth 4, top-k 4, 16 nodes" in results["methods"]["eagle3-tree"]
    assert "prompt-lookup tokens" in results["methods"]["eagle3-adaptive"]
    for name, row in summary.items():
        if name == "plain":  # the reference the others are compared with
            continue
        assert row["lossless"]["compared"] == 2 and row["lossless"]["lossless"], name
        split = row["round_time"]
        if split["draft_ms"] is not None:
            assert split["draft_ms"] + split["verify_ms"] <= split["total_ms"] + 1e-6, name
    assert (out / "report.md").is_file()


@pytest.mark.command("pull")
def test_pull_names_and_verifies_the_default_model(home: Path) -> None:
    """`eaglespec pull smollm2-135m` with the model already downloaded: status 0 and the file's
    path on stdout (its hash was checked when it was fetched: registry.py's marker); `--list`
    names every registry model."""
    proc = eaglespec(["pull", DEFAULT_MODEL], home)
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path.name == DEFAULT_MODEL_FILE and path.is_file()
    listing = eaglespec(["pull", "--list"], home)
    for name in (DEFAULT_MODEL, "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"):
        assert name in listing.stdout
