"""Speculative decoding through the public API and the CLI: every method's greedy output equals
plain decoding, and the statistics come back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglespec import LLM, SamplingParams
from eaglespec.cli import main
from eaglespec.config import TreeConfig
from eaglespec.errors import InvalidRequestError
from oracle import OracleProposer

PROMPTS = ["Once upon a time", "def add(a, b):", "The quick brown fox"]


@pytest.fixture(scope="module")
def plain(tiny_hf_folder: Path) -> list[list[int]]:
    llm = LLM(str(tiny_hf_folder), progress=False)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True), chat=False)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"draft": "random", "draft_min_prob": 0.0},
        {"draft": "random", "tree": TreeConfig(depth=3, top_k=3, num_nodes=8)},
        {"draft": "random"},  # chains stopped at the default min prob
        {"method": "lookup"},
        {"method": "draft-model", "draft": "SELF"},
    ],
    ids=["eagle3-chain", "eagle3-tree", "eagle3-gated", "lookup", "draft-model"],
)
def test_methods_equal_plain_greedy(tiny_hf_folder: Path, plain, kwargs) -> None:
    """Each method through the LLM API equals plain greedy. The tiny model's random head has
    nothing to agree with (its drafts are all rejected), so the eagle3 cases run again with an
    oracle in the head's place (the plain tokens, every third one wrong; in the tree, a wrong
    sibling before each right token): accepted runs through LLM.generate, chain and tree."""
    if kwargs.get("draft") == "SELF":
        kwargs = {**kwargs, "draft": str(tiny_hf_folder)}
    llm = LLM(str(tiny_hf_folder), progress=False, num_draft=3, speculation="on", **kwargs)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, chat=False)
    assert [o.token_ids for o in outs] == plain
    assert all(o.stats.rounds > 0 for o in outs)
    if kwargs.get("method") == "draft-model":  # the draft is the target: everything accepted
        assert all(o.stats.mean_accept_length > 3.0 for o in outs)
    if kwargs.get("draft") == "random":
        seqs = [o.prompt_token_ids + o.token_ids + [0] * 8 for o in outs]
        tree = "tree" in kwargs
        llm.proposer = OracleProposer(seqs, llm.model.cfg.vocab_size, 0 if tree else 3)
        outs = llm.generate(PROMPTS, params, chat=False)
        assert [o.token_ids for o in outs] == plain
        assert all(o.stats.mean_accept_length > 1.5 for o in outs)


def test_bad_combinations_are_named(tiny_hf_folder: Path) -> None:
    with pytest.raises(InvalidRequestError, match="draft"):
        LLM(str(tiny_hf_folder), progress=False, method="draft-model")
    with pytest.raises(InvalidRequestError, match="method"):
        LLM(str(tiny_hf_folder), progress=False, method="medusa")
    with pytest.raises(InvalidRequestError, match="min prob .* needs method eagle3"):
        LLM(str(tiny_hf_folder), progress=False, method="lookup", draft_min_prob=0.3)


def test_cli_json_has_speculative_stats(tiny_hf_folder: Path, capsys) -> None:
    args = ["generate", "--model", str(tiny_hf_folder), "--draft", "random", "--json"]
    assert main([*args, "--max-tokens", "8", "--ignore-eos", "--raw", "Once"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["rounds"] >= 1 and stats["new_tokens"] == 8
    accept = 1 + stats["accepted_tokens"] / stats["rounds"]
    assert stats["mean_accept_length"] == pytest.approx(accept)
    assert isinstance(stats["accept_rate_by_position"], list)


def test_cli_with_a_saved_eagle3_checkpoint(tiny_hf_folder: Path, tmp_path: Path, capsys) -> None:
    """A head saved in the native format loads by path; the report states sharing and capture,
    and the output equals plain greedy."""
    from eaglespec.draft.config import default_capture
    from eaglespec.draft.loader import random_eagle3, save_eagle3

    target = LLM(str(tiny_hf_folder), progress=False)
    layers = default_capture(target.config.num_layers)
    head = random_eagle3(target.model, seed=3, draft_vocab_size=128, capture=layers)
    save_eagle3(head, tmp_path / "head", layers, num_target_layers=target.config.num_layers)
    args = ["generate", "--model", str(tiny_hf_folder), "--draft", str(tmp_path / "head")]
    assert main([*args, "--json", "--max-tokens", "10", "--ignore-eos", "--raw", "Once"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["method"] == "eagle3" and "embed_tokens" in result["draft"]
    assert "MB saved" in result["draft"] and str(layers) in result["draft"]
    plain = target.generate("Once", SamplingParams(max_tokens=10, ignore_eos=True), chat=False)
    assert result["token_ids"] == plain[0].token_ids
