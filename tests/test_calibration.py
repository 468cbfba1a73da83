"""The adaptive policy's stored calibration (calibration.py), adaptive speculation through the
engine and the LLM, and the commands built on them: `generate --compare`, `chat`,
`bench --calibrate`."""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

import eaglespec
from eaglespec.calibration import (
    CalibrationStore,
    calibrate,
    calibration_key,
    draft_fingerprint,
    load_calibration,
    save_calibration,
)
from eaglespec.chat import chat_loop, lines_of
from eaglespec.cli import main
from eaglespec.config import SamplingParams
from eaglespec.draft import random_eagle3, save_eagle3
from eaglespec.draft.config import default_capture
from eaglespec.engine import generate_speculative
from eaglespec.generate import generate_stream
from eaglespec.llm import LLM
from eaglespec.policy import AdaptiveDraft, DraftChoice
from eaglespec.requests import collect_outputs
from helpers import TINY_TREE, NullTokenizer, tiny_adaptive_llm, tiny_target
from oracle import OracleProposer

TREE = TINY_TREE


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm(tiny_hf_folder: Path) -> LLM:
    return tiny_adaptive_llm(tiny_hf_folder)


def _taught(policy: AdaptiveDraft) -> AdaptiveDraft:
    """Rounds where short chains pay: plain steps cost 10 ms, each draft 4 ms more."""
    for rnd in range(40):
        for c in policy.choices:
            secs = 0.010 + 0.004 * (c.num_draft or (3 if c.tree else 0))
            accepted = [min(c.num_draft, 1 + rnd % 2)] if c.tree is None else [2]
            policy.observe(1, c, secs, accepted)
    return policy


def test_policy_state_round_trips_through_json() -> None:
    taught = _taught(AdaptiveDraft(3, TREE))
    fresh = AdaptiveDraft(3, TREE)
    fresh.load_state(json.loads(json.dumps(taught.state())))
    assert fresh.state() == taught.state()
    assert fresh.best(1) == taught.best(1) and fresh.best(1) is not None
    assert fresh.choose(1) == taught.best(1)  # measured arms: no exploring
    assert AdaptiveDraft(3, TREE).best(1) is None  # nothing measured yet
    shorter = AdaptiveDraft(2)  # a stored longer chain and tree still seed a shorter policy
    shorter.load_state(taught.state())
    assert shorter.accept_prob(1) == taught.accept_prob(1)
    assert shorter.best(1) in shorter.choices


def test_record_replaces_the_moving_averages() -> None:
    policy = _taught(AdaptiveDraft(2, TREE))
    policy.record(DraftChoice(2), 1, 0.5, 0.0)
    policy.record(DraftChoice(0, TREE), 1, 0.001, 3.0)
    assert policy.arms[DraftChoice(2)].seconds[1] == 0.5
    assert policy.best(1) == DraftChoice(0, TREE)  # 3 tokens in 1 ms


def test_adaptive_rounds_through_the_engine_are_lossless() -> None:
    """An adaptive policy changes the draft length between rounds (exploring, then the best
    arm, then probes): every row still equals its plain greedy output."""
    target = tiny_target(0, vocab=96, layers=2)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] * 3
    plain = collect_outputs(generate_stream(target, NullTokenizer(), prompts, params))
    sequences = [p + o.token_ids for p, o in zip(prompts, plain, strict=True)]
    policy = AdaptiveDraft(3, probe_every=2)
    oracle = OracleProposer(sequences, 96, wrong_every=3)
    spec = collect_outputs(
        generate_speculative(
            target, oracle, NullTokenizer(), prompts, params, num_draft=3, policy=policy
        )
    )
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert policy.best(4) is not None  # every arm was measured at this batch size


def test_calibrate_stores_what_generate_starts_from(llm: LLM, tiny_hf_folder: Path) -> None:
    prompts = [llm.encode("Once upon a time"), llm.encode("def add(a, b):")]
    policy, arms = calibrate(llm, prompts, max_tokens=6)
    assert [a.choice for a in arms] == ["plain", "chain1", "chain2", "tree2,2,3"]
    for a in arms:
        assert a.rounds >= 2 and a.seconds_per_round > 0 and a.tokens_per_round >= 1.0
        assert a.tokens_per_second == pytest.approx(a.tokens_per_round / a.seconds_per_round)
    assert arms[0].tokens_per_round == 1.0  # plain steps: one token per round
    key = calibration_key(llm)
    path = save_calibration(key, policy, "calibrate")
    assert path.is_file() and json.loads(path.read_text())["key"]["draft"] == "random"

    again = tiny_adaptive_llm(tiny_hf_folder)
    assert calibration_key(again) == key
    lines: list[str] = []
    store = CalibrationStore.open(again, lines.append)
    assert "calibration of" in lines[0] and "(calibrate)" in lines[0]
    assert isinstance(again.policy, AdaptiveDraft) and again.policy.best(1) == policy.best(1)
    store.save()
    assert json.loads(path.read_text())["source"] == "generate"

    # Another machine setting is another calibration: nothing stored for it; so is another
    # build of the engine (its kernels decide what a round costs).
    assert load_calibration(replace(key, threads=key.threads + 1), AdaptiveDraft(2, TREE)) is None
    assert key.engine.startswith(eaglespec.__version__ + "+")
    assert load_calibration(replace(key, engine=key.engine + "x"), AdaptiveDraft(2, TREE)) is None


def test_a_head_retrained_into_the_same_folder_is_another_calibration(
    llm: LLM, tiny_hf_folder: Path, tmp_path: Path
) -> None:
    """The key holds the head's content, not only its path: a stored calibration of the old head
    (its acceptance, its round times) must not seed the new one."""
    bounds = default_capture(llm.config.num_layers)
    folder = save_eagle3(random_eagle3(llm.model, seed=1), tmp_path / "head", bounds)
    with_head = LLM(str(tiny_hf_folder), progress=False, draft=str(folder), num_draft=2,
                    speculation="adaptive")  # fmt: skip
    key = calibration_key(with_head)
    assert key.draft_content is not None and key.draft_content == draft_fingerprint(str(folder))
    save_calibration(key, _taught(AdaptiveDraft(2)), "calibrate")
    assert load_calibration(calibration_key(with_head), AdaptiveDraft(2)) is not None

    (folder / "work").mkdir()  # a training run's features beside the head change nothing
    (folder / "work" / "shard-00000.safetensors").write_bytes(b"features")
    assert calibration_key(with_head) == key

    copy = tmp_path / "clone" / "head"  # the same head in another clone of the package
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("work"))
    elsewhere = LLM(str(tiny_hf_folder), progress=False, draft=str(copy), num_draft=2,
                    speculation="adaptive")  # fmt: skip
    assert calibration_key(elsewhere) == key

    save_eagle3(random_eagle3(llm.model, seed=2), folder, bounds)  # same path, new weights
    assert calibration_key(with_head).draft_content != key.draft_content
    assert load_calibration(calibration_key(with_head), AdaptiveDraft(2)) is None
    assert draft_fingerprint("random") is None and draft_fingerprint(None) is None


def test_generate_compares_with_plain_decoding(
    tiny_hf_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--model", str(tiny_hf_folder), "--draft", "random", "--max-tokens", "6"]
    assert main([*args, "--ignore-eos", "Once upon a time"]) == 0
    err = capsys.readouterr().err
    assert "adaptive speculation" in err
    assert "plain decoding of the same prompt" in err and "same output" in err
    assert main([*args, "--json", "--compare", "Once"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["plain"]["identical"] is True and result["plain"]["speedup"] > 0
    assert result["speculation"] == "adaptive"
    assert main([*args, "--json", "Once"]) == 0  # --json alone skips the comparison
    assert json.loads(capsys.readouterr().out)["plain"] is None


def test_compare_warm_up_leaves_the_adaptive_policy_alone(tiny_hf_folder: Path) -> None:
    """LLM.warm_up's rounds (generate --compare, --compile) are cold (first-call setup): they
    draft with fixed shapes and never enter the policy's averages."""
    llm = tiny_adaptive_llm(tiny_hf_folder)
    assert isinstance(llm.policy, AdaptiveDraft)
    before = json.dumps(llm.policy.state(), sort_keys=True)
    llm.warm_up("Once upon a time", batch_sizes=(1, 2))
    assert json.dumps(llm.policy.state(), sort_keys=True) == before
    llm.generate(["Once upon a time"], SamplingParams(max_tokens=8))
    assert json.dumps(llm.policy.state(), sort_keys=True) != before  # real runs do enter


def test_generate_with_repetition_penalty_decodes_plainly(
    tiny_hf_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--model", str(tiny_hf_folder), "--max-tokens", "4", "--json"]
    assert main([*args, "--repetition-penalty", "1.2", "Once"]) == 0
    assert json.loads(capsys.readouterr().out)["speculation"] == "off"


def test_chat_loop_keeps_the_conversation(llm: LLM) -> None:
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    said: list[str] = []
    out = io.StringIO()
    stdin = io.StringIO("Once upon a time\n/bogus\n\ndef add(a, b):\n")
    messages = chat_loop(llm, params, "be brief", lines_of(stdin), out, said.append)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    # Each answer is what the model says to the whole conversation so far, through the template.
    first = llm.generate([llm.tokenizer.encode_chat(messages[:2])], params)[0]
    assert messages[2]["content"] == first.text
    assert any("unknown command /bogus" in s for s in said)
    assert sum("5 tokens" in s and "tok/s" in s for s in said) == 2
    stdin = io.StringIO("Once\n/reset\ndef\n/exit\nnever read\n")
    messages = chat_loop(llm, params, None, lines_of(stdin), io.StringIO(), said.append)
    assert [m["content"] for m in messages if m["role"] == "user"] == ["def"]


def test_bench_calibrate_prints_and_stores(
    tiny_hf_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["Once"]}) + "\n")
    argv = ["bench", "--calibrate", "--questions", str(questions), "--model", str(tiny_hf_folder)]
    argv += ["--draft", "random", "--max-tokens", "6", "--num-draft", "2", "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| plain |" in out and "| chain2 |" in out and "best at batch 1:" in out
    stored = Path(out.strip().rsplit("stored in ", 1)[1])
    record = json.loads(stored.read_text())
    assert record["source"] == "calibrate" and record["key"]["num_draft"] == 2
