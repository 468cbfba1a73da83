"""How each generated token landed (requests.Provenance): the proposer's accepted drafts, prompt
lookup's accepted copies, the target's bonus or corrected token, or the target's own token in a
round without drafts. The server streams it (test_server.py) and the chat page shows it."""

from __future__ import annotations

import pytest

from eaglespec.config import SamplingParams, TreeConfig
from eaglespec.draft.hybrid import HybridProposer
from eaglespec.draft.loader import random_eagle3
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.engine import generate_speculative
from eaglespec.generate import generate_stream
from eaglespec.model.llama import Transformer
from eaglespec.requests import SOURCES, StreamEvent, collect_outputs
from helpers import NullTokenizer, cycling_target, tiny_target
from oracle import OracleProposer

V = 96
PROMPTS = [[5, 17, 33, 2, 8], [9, 1, 4], [70, 71, 72, 73, 74, 75, 76, 77, 78]]
LENGTHS = [24, 9, 31]


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_target(0, vocab=V)


def _params(lengths: list[int], **kw) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, ignore_eos=True, **kw) for n in lengths]


def _events(target, proposer, prompts, params, k: int, tree=None) -> list[StreamEvent]:
    return list(
        generate_speculative(
            target, proposer, NullTokenizer(), prompts, params, num_draft=k, tree=tree
        )
    )


def _check_marks(events: list[StreamEvent], grafted: bool = False) -> dict[int, list[str]]:
    """Every event's marks: one per kept token, texts equal to each token's ("<id>" with
    NullTokenizer) and to the event's text; sources from SOURCES, the round's accepted drafts
    first. The target's token is a bonus when the accepted path ends at a leaf: where every leaf
    is at the full depth (chains, the oracle's ladder), exactly when all `drafted` positions were
    accepted; a grafted tree has shallower leaves. Returns each request's sources in order."""
    by_request: dict[int, list[str]] = {}
    for e in events:
        p = e.provenance
        assert p is not None
        assert [m.text for m in p.tokens] == [f"<{t}>" for t in e.token_ids]
        assert "".join(m.text for m in p.tokens) == e.text
        sources = [m.source for m in p.tokens]
        assert set(sources) <= set(SOURCES)
        assert 0 <= p.accepted <= max(p.drafted, p.accepted)
        if len(sources) == p.accepted + 1:  # a whole round: its drafts, then the target's token
            assert all(s in ("draft", "lookup") for s in sources[:-1])
            own = sources[-1]
            if p.drafted == 0:
                assert own == "target"
            elif grafted:
                assert own in ("bonus", "corrected")
            else:
                assert own == ("bonus" if p.accepted == p.drafted else "corrected")
        else:  # the request ended inside the round
            assert e.output is not None and len(sources) <= p.accepted + 1
        by_request.setdefault(e.index, []).extend(sources)
    return by_request


def _kept_drafts(events: list[StreamEvent], index: int) -> int:
    """Accepted drafts of request `index` that were kept (its last round may end it early)."""
    return sum(
        min(e.provenance.accepted, len(e.provenance.tokens))
        for e in events
        if e.index == index and e.provenance is not None
    )


TREE = TreeConfig(depth=4, top_k=4, num_nodes=20)


@pytest.mark.parametrize(
    ("k", "tree", "wrong_every"), [(4, None, 3), (1, None, 3), (0, TREE, 3), (0, TREE, 0)]
)
def test_marks_follow_the_rounds(target: Transformer, k: int, tree, wrong_every: int) -> None:
    params = _params(LENGTHS)
    plain = collect_outputs(generate_stream(target, NullTokenizer(), PROMPTS, params))
    seqs = [p + o.token_ids + [0] * 8 for p, o in zip(PROMPTS, plain, strict=True)]
    events = _events(target, OracleProposer(seqs, V, wrong_every), PROMPTS, params, k, tree)
    sources = _check_marks(events)
    outputs = collect_outputs(events)
    for i, out in enumerate(outputs):
        assert out.token_ids == plain[i].token_ids
        s = sources[i]
        assert len(s) == len(out.token_ids)
        assert s[0] == "target"  # the prefill's token
        # the drafts it accepted, the bonus tokens of fully accepted rounds, the corrections
        assert s.count("draft") == _kept_drafts(events, i) > 0
        assert out.stats.accepted_tokens - k - 4 <= s.count("draft") <= out.stats.accepted_tokens
        assert "lookup" not in s
        # wrong drafts are corrected; a round whose drafts are all right ends in a bonus token
        # (with every third position wrong, a chain of 1 often, 4 rungs of a ladder never)
        assert (s.count("corrected") > 0) == (wrong_every > 0)
        assert (s.count("bonus") > 0) == (k == 1 or wrong_every == 0)


def test_a_plain_round_is_the_targets_own(target: Transformer) -> None:
    head = Eagle3Proposer(random_eagle3(target, seed=1), (1, 3, 4))
    events = _events(target, head, PROMPTS, _params(LENGTHS), 0)
    for i, s in _check_marks(events).items():
        assert s == ["target"] * LENGTHS[i]


def test_lookup_copies_are_marked_lookup() -> None:
    # On a cycle prompt lookup is always right, the random head next to never: the accepted
    # tokens are nearly all copies, and the head alone accepts no copies.
    prompts = [[5, 17, 33, 2, 8, 5, 17], [9, 1, 4]]
    bigram, laps = cycling_target(prompts, V)
    params = _params([25, 30])
    head = Eagle3Proposer(random_eagle3(bigram, seed=3), (1, 2, 2))
    alone = _check_marks(_events(bigram, head, laps, params, 2))
    both_events = _events(bigram, HybridProposer(head, 3), laps, params, 2)
    both = _check_marks(both_events, grafted=True)
    for i, out in enumerate(collect_outputs(both_events)):
        assert "lookup" not in alone[i]
        assert both[i].count("lookup") + both[i].count("draft") == _kept_drafts(both_events, i)
        assert both[i].count("lookup") >= 3 * (out.stats.rounds - 2)


def test_held_back_text_joins_the_mark_before(target: Transformer) -> None:
    # Stop string ">#": every token's closing ">" might start it, so it is held back and released
    # with the next token's text; a stop token (not kept) releases the last ">", which joins the
    # mark before it. The marks still spell each event's text.
    plain = collect_outputs(generate_stream(target, NullTokenizer(), PROMPTS, _params(LENGTHS)))
    stop_id = plain[0].token_ids[10]
    params = _params(LENGTHS, stop=(">#",), stop_token_ids=(stop_id,))
    want = collect_outputs(generate_stream(target, NullTokenizer(), PROMPTS, params))
    seqs = [p + o.token_ids + [0] * 8 for p, o in zip(PROMPTS, plain, strict=True)]
    events = _events(target, OracleProposer(seqs, V), PROMPTS, params, 3)
    shifted = 0
    for e in events:
        assert e.provenance is not None
        marks = e.provenance.tokens
        assert "".join(m.text for m in marks) == e.text
        assert len(marks) == len(e.token_ids) or (not e.token_ids and len(marks) <= 1)
        shifted += sum(m.text != f"<{t}>" for m, t in zip(marks, e.token_ids, strict=False))
    assert shifted > 0  # the held ">" moved text between marks
    outputs = collect_outputs(events)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in want]
    assert [o.text for o in outputs] == [o.text for o in want]
    assert outputs[0].token_ids == plain[0].token_ids[:10]  # it stopped at the stop token
    last = [e for e in events if e.index == 0][-1]
    assert last.provenance is not None and last.provenance.tokens[-1].text.endswith(">")
