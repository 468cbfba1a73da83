"""`eaglespec bench`: the harness on the tiny model (results schema, report, plots), the
losslessness check, statistics on hand-made generations, multi-turn context, argument checks."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from eaglespec.bench.aggregate import (
    check_lossless,
    first_difference,
    method_stats,
    shape_shares,
    summarize,
)
from eaglespec.bench.command import command_line
from eaglespec.bench.lineup import BenchMethod, DraftSources, check_methods, default_methods
from eaglespec.bench.memory import memory_meter
from eaglespec.bench.questions import Question, read_all
from eaglespec.bench.report import ab_table, fmt_lossless, summary_table
from eaglespec.bench.runner import Generation, RunSettings, run_conversation
from eaglespec.cli import build_parser, main
from eaglespec.cliargs import tree_config
from eaglespec.config import TreeConfig
from eaglespec.errors import InvalidRequestError
from eaglespec.model.loader import load_model
from eaglespec.requests import GenerationStats, RequestOutput

METHODS = [
    "plain",
    "lookup",
    "eagle3-chain",
    "eagle3-tree",
    "eagle3-chain+lookup",
    "eagle3-tree+lookup",
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_questions(folder: Path) -> list[Path]:
    """Two tiny files: one with categories and a two-turn question, one without categories."""
    chat = folder / "chat_question.jsonl"
    rows = [
        {"question_id": 1, "category": "story", "turns": ["Once upon a time", "And then?"]},
        {"question_id": 2, "category": "code", "turns": ["def add(a, b):"]},
    ]
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = folder / "fox_question.jsonl"
    plain.write_text(
        json.dumps({"question_id": 7, "category": "", "turns": ["The quick brown fox"]}) + "\n"
    )
    return [chat, plain]


@pytest.fixture(scope="module")
def bench_run(tiny_hf_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bench")
    files = _write_questions(folder)
    out = folder / "out"
    args = ["bench", "--model", str(tiny_hf_folder), "--questions", *map(str, files)]
    args += ["--methods", *METHODS, "--draft", "random", "--max-tokens", "8"]
    args += ["--tree", "2,2,3", "--num-draft", "3", "--threads", "1", "--out", str(out), "--quiet"]
    assert main(args) == 0
    return out


def _results(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "results.json").read_text())
    return data


def test_results_schema_and_values(bench_run: Path) -> None:
    data = _results(bench_run)
    assert data["schema"] == "eaglespec-bench/1"
    assert data["command"].startswith("eaglespec bench --questions")
    env = data["environment"]
    for key in ("torch", "threads", "device", "dtype", "quant", "compile", "python", "cpu", "date"):
        assert key in env
    assert env["threads"] == 1 and env["device"] == "cpu" and env["dtype"] == "float32"
    hashes = env["model"]["sha256"]
    assert "model.safetensors" in hashes and all(len(h) == 64 for h in hashes.values())
    assert env["drafts"]["eagle3"]["path"] == "random"
    assert list(data["methods"]) == METHODS
    summary = data["summary"]
    assert list(summary) == METHODS
    assert summary["plain"]["mean_accept_length"] is None
    for name in METHODS:
        s = summary[name]
        assert s["generations"] == 4  # 3 questions, one with two turns
        assert s["lossless"]["lossless"] is True and s["lossless"]["compared"] == 4
        assert s["new_tokens"] > 0 and s["tokens_per_second"] > 0 and s["peak_memory_bytes"] > 0
    for name in METHODS[1:]:
        s = summary[name]
        assert s["forwards"] > 0
        assert all(0.0 <= r <= 1.0 for r in s["accept_rate_by_position"])
        t = s["round_time"]
        # draft and verify are timed apart from the round's wall time: they must fit inside it
        # (other_ms is the rest by subtraction, so it is never negative when they do)
        assert t["draft_ms"] > 0 and t["verify_ms"] > 0
        assert t["draft_ms"] + t["verify_ms"] <= t["total_ms"] * (1 + 1e-9)
        assert t["other_ms"] >= 0
    assert len(summary["eagle3-tree"]["accept_rate_by_position"]) <= 2  # tree depth 2
    # Categories from the file, the file name where a question has none.
    assert list(data["groups"]) == ["story", "code", "fox"]
    gens = data["generations"]
    assert len(gens) == 4 * len(METHODS)
    # The summary recomputed from the per-generation records (the definitions in settings):
    # tokens per second, speedup against plain's, and tokens per target forward.
    plain_rate = summary["plain"]["tokens_per_second"]
    for name in METHODS:
        mine = [g for g in gens if g["method"] == name]
        seconds = sum(g["prefill_seconds"] + g["decode_seconds"] for g in mine)
        rate = sum(g["new_tokens"] for g in mine) / seconds
        assert summary[name]["tokens_per_second"] == pytest.approx(rate)
        assert summary[name]["speedup"] == pytest.approx(rate / plain_rate)
        if name != "plain":
            rounds = sum(g["rounds"] for g in mine)
            accepted = sum(g["accepted_tokens"] for g in mine)
            assert summary[name]["mean_accept_length"] == pytest.approx(
                (accepted + rounds) / rounds
            )
            # each round lands its accepted drafts and one target token after the prefill's
            assert all(g["new_tokens"] <= 1 + g["rounds"] + g["accepted_tokens"] for g in mine)
            # every round is counted under the one shape a fixed method runs
            shape = "tree2,2,3" if "tree" in name else "chain3"
            for g in mine:
                one = g["shapes"][shape]
                assert list(g["shapes"]) == [shape] and one["rounds"] == g["rounds"]
                assert one["tokens"] == g["accepted_tokens"] + g["rounds"]
                assert one["seconds"] == pytest.approx(g["draft_seconds"] + g["verify_seconds"])
            share = summary[name]["shapes"][shape]
            assert share["share"] == 1.0 and share["rounds"] == rounds
            assert share["tokens_per_round"] == pytest.approx((accepted + rounds) / rounds)
    assert summary["plain"]["shapes"] == {}
    assert all(g["matches_plain"] for g in gens)
    assert [g["turn"] for g in gens if g["question_id"] == 1 and g["method"] == "plain"] == [0, 1]


def test_report_and_plots_are_written(bench_run: Path) -> None:
    report = (bench_run / "report.md").read_text()
    assert "## Summary" in report and "## By category" in report
    assert _results(bench_run)["command"] in report
    for name in METHODS:
        assert f"| {name} |" in report
    assert (
        "### Rounds by draft shape" in report and "| eagle3-tree | tree2,2,3 | 100.0% |" in report
    )
    for png in ("speedup.png", "accept_length.png", "accept_rate.png"):
        data = (bench_run / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
        assert f"]({png})" in report


def _gen(method: str, question: int, turn: int, ids: list[int], **stats: Any) -> Generation:
    s = GenerationStats(prompt_tokens=3, new_tokens=len(ids), **stats)
    out = RequestOutput(0, [1, 2, 3], token_ids=ids, finish_reason="length", stats=s)
    return Generation(method, question, turn, [1, 2, 3], out, 1000)


QUESTIONS = [Question("set", 5, "math", ("a", "b")), Question("set", 6, "code", ("c",))]


def test_lossless_check_reports_the_first_difference() -> None:
    plain = [_gen("plain", 0, 0, [1, 2, 3]), _gen("plain", 0, 1, [4, 5]), _gen("plain", 1, 0, [6])]
    same = [_gen("x", q, t, g.output.token_ids) for q, t, g in [(0, 0, plain[0]), (0, 1, plain[1])]]
    same.append(_gen("x", 1, 0, [6]))
    assert check_lossless(same, plain, QUESTIONS, greedy=True).lossless is True
    differ = [_gen("x", 0, 0, [1, 2, 3]), _gen("x", 0, 1, [4, 9]), _gen("x", 1, 0, [6, 7])]
    check = check_lossless(differ, plain, QUESTIONS, greedy=True)
    assert check.lossless is False and check.mismatches == 2 and check.compared == 3
    m = check.first_mismatch
    assert m is not None and (m.source, m.question_id, m.turn, m.position) == ("set", 5, 1, 1)
    assert "**no**: 2 of 3 differ" in fmt_lossless(check, "x")
    sampled = check_lossless(differ, plain, QUESTIONS, greedy=False)
    assert sampled.lossless is None and fmt_lossless(sampled, "x") == "n/a (sampling)"
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1], [1]) is None


def test_an_injected_mismatch_shows_in_the_summary() -> None:
    gens = [_gen("plain", 0, 0, [1, 2], prefill_seconds=0.5, decode_seconds=0.5)]
    gens.append(_gen("lookup", 0, 0, [1, 3], prefill_seconds=0.5, decode_seconds=0.5, rounds=1))
    summary = summarize(gens, QUESTIONS[:1], ["plain", "lookup"], group_by="category", greedy=True)
    assert summary.overall["lookup"].lossless.lossless is False
    assert summary.groups["math"]["lookup"].lossless.lossless is False
    assert "**no**: 1 of 1 differ" in summary_table(summary.overall)


def test_ab_table_rows() -> None:
    """The benchmarks/ scripts' A/B table: plain left out, tokens a round, speed over plain and
    turns equal to plain's, and an extra column by method name."""
    gens = [_gen("plain", 0, 0, [1, 2], prefill_seconds=0.5, decode_seconds=0.5)]
    kw = {"prefill_seconds": 0.25, "decode_seconds": 0.25, "rounds": 1, "accepted_tokens": 1}
    gens.append(_gen("lookup", 0, 0, [1, 3], **kw))  # 2 tokens in 1 round: 1 draft taken
    summary = summarize(gens, QUESTIONS[:1], ["plain", "lookup"], group_by="category", greedy=True)
    lines = ab_table(summary.overall).splitlines()
    assert lines[0] == "| method | tokens a round | x plain | lossless |"
    assert lines[2:] == ["| lookup | 2.000 | 2.000x | 0/1 |"]
    extra = ab_table(summary.overall, ("note", lambda name: name.upper())).splitlines()
    assert extra[0].endswith("| lossless | note |") and extra[2].endswith("| 0/1 | LOOKUP |")


def test_statistics_from_hand_made_generations() -> None:
    # plain: 10 tokens in 1 s; the method: 20 tokens in 1 s over 4 rounds accepting 2, 2, 1, 2
    # of 3 drafts -> 7 accepted, tau (7 + 4) / 4; position rates 4/4, 3/4, 0/4.
    plain = [_gen("plain", 0, 0, list(range(10)), prefill_seconds=0.1, decode_seconds=0.9)]
    spec_stats = {
        "prefill_seconds": 0.2,
        "decode_seconds": 0.8,
        "rounds": 4,
        "accepted_tokens": 7,
        "draft_tokens": 12,
        "accepted_by_position": [4, 3, 0],
        "proposed_by_position": [4, 4, 4],
        "draft_seconds": 0.2,
        "verify_seconds": 0.4,
    }
    spec = [_gen("m", 0, 0, list(range(20)), **spec_stats)]
    s = method_stats(spec, plain, QUESTIONS, drafting=True, greedy=True)
    assert s.tokens_per_second == pytest.approx(20.0) and s.speedup == pytest.approx(2.0)
    assert s.decode_tokens_per_second == pytest.approx(19 / 0.8)
    assert s.mean_accept_length == pytest.approx(11 / 4)
    assert s.accept_rate_by_position == pytest.approx((1.0, 0.75, 0.0))
    t = s.round_time
    assert t is not None and t.total_ms == pytest.approx(200.0)
    assert (t.draft_ms, t.verify_ms, t.other_ms) == pytest.approx((50.0, 100.0, 50.0))
    p = method_stats(plain, plain, QUESTIONS, drafting=False, greedy=True)
    assert p.speedup == pytest.approx(1.0) and p.forwards == 9 and p.mean_accept_length is None
    assert p.round_time is not None and p.round_time.total_ms == pytest.approx(100.0)
    assert p.round_time.draft_ms is None


def test_second_turn_continues_with_the_first_answer(tiny_hf_folder: Path) -> None:
    target = load_model(tiny_hf_folder)
    plain = BenchMethod("plain", None, 0, None, "plain decoding")
    question = Question("chat", 1, "story", ("Once upon a time", "And then?"))
    gens = run_conversation(
        target, plain, question, 0, RunSettings(8, 0.0, 0), memory_meter(target.model.device)
    )
    assert [g.turn for g in gens] == [0, 1]
    answer = target.tokenizer.decode(gens[0].output.token_ids)
    assert answer.strip()
    second = target.tokenizer.decode(gens[1].prompt_token_ids, skip_special=False)
    assert (
        "Once upon a time" in second and answer in second and second.rstrip().endswith("assistant")
    )
    assert second.index(answer) < second.index("And then?")


def test_command_line_reproduces_the_arguments(tmp_path: Path) -> None:
    argv = ["bench", "--questions", "a b.jsonl", "c.jsonl", "--methods", "plain", "lookup"]
    argv += ["--draft", "random", "--limit", "2", "--temperature", "0.5", "--tree", "3,2,4"]
    argv += ["--out", str(tmp_path / "o"), "--compile", "block", "--quiet"]
    parser = build_parser()
    args = parser.parse_args(argv)
    again = parser.parse_args(shlex.split(command_line(args))[1:])
    assert vars(again) == vars(args)


def test_methods_need_their_drafts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    none = DraftSources(eagle3=None, draft_model=None)
    both = DraftSources(eagle3="head", draft_model="small")
    assert default_methods(none) == ["plain", "lookup"]
    assert default_methods(both) == [
        "plain",
        "eagle3-chain",
        "eagle3-tree",
        "eagle3-chain+lookup",
        "eagle3-tree+lookup",
        "eagle3-adaptive",
        "draft-model",
        "lookup",
    ]
    assert check_methods(["lookup", "lookup"], none) == ["plain", "lookup"]  # plain always runs
    with pytest.raises(InvalidRequestError, match="needs --draft-model"):
        check_methods(["draft-model"], none)
    with pytest.raises(InvalidRequestError, match="needs an EAGLE-3 head"):
        check_methods(["eagle3-tree"], none)
    # From the command line: a one-line error before anything loads, nothing written.
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "turns": ["hi"]}) + "\n")
    out = tmp_path / "out"
    argv = ["bench", "--questions", str(questions), "--methods", "draft-model", "--out", str(out)]
    assert main(argv) == 2
    assert "needs --draft-model MODEL" in capsys.readouterr().err and not out.exists()


def test_questions_files(tmp_path: Path) -> None:
    files = _write_questions(tmp_path)
    qs = read_all(files)
    assert [(q.source, q.question_id, q.category) for q in qs] == [
        ("chat", 1, "story"),
        ("chat", 2, "code"),
        ("fox", 7, "fox"),
    ]
    assert qs[0].turns == ("Once upon a time", "And then?") and qs[0].group("file") == "chat"
    assert len(read_all(files, limit=1)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": []}\n')
    with pytest.raises(InvalidRequestError, match=r"bad.jsonl:1: 'turns' must be"):
        read_all([bad])


def test_tree_shape_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tree_config("4,4,16", "--tree") == TreeConfig(depth=4, top_k=4, num_nodes=16)
    with pytest.raises(InvalidRequestError, match="--tree takes DEPTH,TOPK,NODES, got '4,4'"):
        tree_config("4,4", "--tree")
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "turns": ["hi"]}) + "\n")
    argv = ["bench", "--questions", str(questions), "--tree", "4,x,2", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "--tree takes comma-separated integers, got '4,x,2'" in capsys.readouterr().err


def test_rounds_are_counted_by_the_shape_that_ran_them() -> None:
    # An adaptive run: chain1 lands 2, 1, 2 tokens in 10, 10, 12 ms; chain0 lands 1 in 6 ms,
    # over two generations whose shapes are summed.
    a, b = GenerationStats(3), GenerationStats(3)
    a.record_round(1, 1, 0.004, 0.006, "chain1")
    a.record_round(1, 0, 0.004, 0.006, "chain1")
    a.record_round(0, 0, 0.001, 0.005, "chain0")
    b.record_round(1, 1, 0.004, 0.008, "chain1")
    assert a.shapes["chain1"].rounds == 2 and a.shapes["chain1"].tokens == 3
    assert a.rounds == 3 and a.accepted_tokens == 1  # the totals are counted as before
    shares = shape_shares([a.shapes, b.shapes])
    assert list(shares) == ["chain1", "chain0"]  # most rounds first
    assert shares["chain1"].rounds == 3 and shares["chain1"].share == pytest.approx(0.75)
    assert shares["chain1"].tokens_per_round == pytest.approx(5 / 3)
    assert shares["chain1"].ms_per_round == pytest.approx(32 / 3)
    assert shares["chain0"].tokens_per_round == 1.0 and shares["chain0"].ms_per_round == 6.0
    assert shape_shares([{}, {}]) == {}  # plain decoding: no rounds
