"""The head shipped for Qwen2.5-Coder-1.5B (heads/qwen2.5-coder-1.5b): it loads against its target
at the commands' default precision with the output rows gathered from the target (not stored),
fits the package's 50 MB budget, drafts losslessly on a code prompt, alone and with prompt lookup
grafted in, and its drafts are accepted. Slow: the target is a 1.1 GB download and loads in about
a minute on 2 cores (`.ci/run` runs the slow tests after the default command)."""

from __future__ import annotations

import pytest

from eaglespec import LLM, SamplingParams
from eaglespec.heads import packaged_head
from eaglespec.policy import DraftChoice, FixedDraft
from eaglespec.registry import pull

pytestmark = [pytest.mark.slow, pytest.mark.real]

NAME = "qwen2.5-coder-1.5b"
PROMPT = (
    "Complete the code I provided.\n\n"
    "def is_palindrome(text: str) -> bool:\n"
    '    """Return True if text reads the same backwards, ignoring case and spaces."""\n'
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    """As `eaglespec generate --model qwen2.5-coder-1.5b` loads it."""
    return LLM(str(pull(NAME, progress=False)), progress=False)


def test_the_shipped_head_is_the_default_and_fits_its_budget(llm: LLM) -> None:
    head = packaged_head(NAME)
    assert head is not None and llm.draft == str(head) and llm.method == "eagle3"
    assert (head / "model.safetensors").stat().st_size <= 50e6
    assert "lm_head rows" in llm.draft_report  # the target's rows, not stored with the head


def test_greedy_speculation_with_it_equals_plain_and_accepts(llm: LLM) -> None:
    ids = llm.encode(PROMPT)
    params = SamplingParams(max_tokens=48)
    plain = llm.generate([ids], params, policy=FixedDraft(DraftChoice(0)))[0]
    for lookup in (False, True):
        # lookup's tokens ride on the head's proposer; without them, the head alone
        proposer = llm.proposer
        if not lookup:
            llm.proposer = proposer.head  # type: ignore[union-attr]
        try:
            spec = llm.generate([ids], params, policy=FixedDraft(DraftChoice(2)))[0]
        finally:
            llm.proposer = proposer
        assert spec.token_ids == plain.token_ids, f"lookup={lookup}"
        assert spec.stats.accepted_tokens > 0, f"lookup={lookup}: no draft accepted"
        if lookup:
            assert spec.stats.mean_accept_length > 1.5
