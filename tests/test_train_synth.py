"""Self-written training prompts (train/synth.py) and continuing a saved head (`--init-from`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from eaglespec.config import SamplingParams
from eaglespec.draft.config import default_capture
from eaglespec.draft.loader import load_eagle3, random_eagle3, save_eagle3
from eaglespec.errors import InvalidRequestError
from eaglespec.generate import generate_stream
from eaglespec.requests import collect_outputs
from eaglespec.train.data import Conversation
from eaglespec.train.meter import Deadline
from eaglespec.train.regen import Sample
from eaglespec.train.synth import (
    COMPLETE,
    FOLLOWUP_STARTERS,
    STARTER_MIXES,
    SUMMARIZE,
    Starter,
    SynthConfig,
    code_stubs,
    completion_prompts,
    followup_prompts,
    hash_seed,
    read_followups,
    read_synth_prompts,
    starter_for,
    summary_prompts,
    synthesize_prompts,
    user_turn_prefix,
)
from helpers import tiny_target

V = 96
EOS = 3


class WordTokenizer:
    """A chat tokenizer over a tiny vocabulary: id i reads "w<i>", characters encode to
    ord(c) % V, the template is ChatML-like with a system turn."""

    eos_ids = (EOS,)
    chat_template = "ChatML-like (apply_chat_template)"
    name = "word-tokenizer"

    def apply_chat_template(self, messages, *, add_generation_prompt=True):  # type: ignore[no-untyped-def]
        text = "<sys>be brief<end>"
        for m in messages:
            text += f"<{m['role']}>{m['content']}<end>"
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        return [ord(c) % V for c in text]

    def decode(self, ids, *, skip_special: bool = True) -> str:  # type: ignore[no-untyped-def]
        return " ".join(f"w{i}" for i in ids if not (skip_special and i == EOS))

    def stream_decoder(self, prompt_ids=()):  # type: ignore[no-untyped-def]
        tok = self

        class _Decoder:
            def push(self, tid: int) -> str:
                return "" if tid == EOS else tok.decode([tid]) + " "

            def flush(self) -> str:
                return ""

        return _Decoder()


pytestmark = pytest.mark.usefixtures("one_thread")


def test_user_turn_prefix_is_the_template_before_the_user_text() -> None:
    tok = WordTokenizer()
    assert user_turn_prefix(tok) == tok.encode("<sys>be brief<end><user>")


def test_synthesized_prompts_end_by_themselves_are_unique_and_resume(tmp_path: Path) -> None:
    target = tiny_target(0, vocab=V, layers=2)
    tok = WordTokenizer()
    path = tmp_path / "synth.jsonl"
    cfg = SynthConfig(prompts=4, max_tokens=64, batch=8, min_words=2)
    first = synthesize_prompts(target, tok, path, cfg)
    assert len(first) == 4
    texts = [c.turns[0] for c in first]
    assert len(set(texts)) == 4 and all(len(t.split()) >= 2 for t in texts)
    assert all(c.source.startswith("synth:") for c in first)
    # Resuming to a larger count keeps the first four and draws new seeds after the largest.
    more = synthesize_prompts(target, tok, path, SynthConfig(**{**_fields(cfg), "prompts": 6}))
    assert more[:4] == first and len(more) == 6
    assert len({c.source for c in more}) == 6
    assert read_synth_prompts(path) == more
    seeds = [json.loads(line)["seed"] for line in path.read_text().splitlines()]
    assert min(seeds[4:]) > max(seeds[:4])  # kept in the order they finish, new ones after


def test_steered_prompts_begin_with_their_seeds_starter_and_continue_it(tmp_path: Path) -> None:
    # Each kept prompt is its starter followed by what the model wrote after it: the same text a
    # seeded draw from the user-turn prefix plus the starter's ids gives.
    target = tiny_target(0, vocab=V, layers=2)
    tok = WordTokenizer()
    starters = (Starter("ab"), Starter("cd ef", max_tokens=80))
    cfg = SynthConfig(prompts=6, max_tokens=48, batch=8, min_words=2, starters=starters)
    path = tmp_path / "synth.jsonl"
    got = synthesize_prompts(target, tok, path, cfg)
    assert len(got) == 6
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert {starter_for(r["seed"], starters) for r in records} == set(starters)  # both used
    for r in records:
        start = starter_for(r["seed"], starters)
        assert start is not None and r["turns"][0].startswith(start.text)
        ids = user_turn_prefix(tok) + tok.encode(start.text, add_special=False)
        params = SamplingParams(
            max_tokens=max(48, start.max_tokens), temperature=1.0, top_p=0.99, seed=r["seed"]
        )
        alone = collect_outputs(generate_stream(target, tok, [ids], [params]))[0]
        assert r["turns"][0] == (start.text + alone.text).strip()
    for mix in STARTER_MIXES.values():  # BPE: a dangling space would split a word's token
        assert all(s.text and not s.text.endswith(" ") for s in mix)


def test_synthesis_gives_up_when_the_model_never_ends_a_turn(tmp_path: Path) -> None:
    target = tiny_target(0, vocab=V, layers=2)
    tok = WordTokenizer()
    cfg = SynthConfig(prompts=5, max_tokens=4, batch=8, min_words=50)  # nothing qualifies
    assert synthesize_prompts(target, tok, tmp_path / "s.jsonl", cfg) == []


def test_synthesis_stops_at_its_deadline(tmp_path: Path) -> None:
    """`--synth-seconds`: a passed deadline draws nothing; one that passes mid-way keeps the
    prompts written before it (the clock moves a second at each reading, one per draw)."""
    target = tiny_target(0, vocab=V, layers=2)
    tok = WordTokenizer()
    cfg = SynthConfig(prompts=6, max_tokens=64, batch=8, min_words=2)
    path = tmp_path / "synth.jsonl"
    passed = Deadline(at=0.0, clock=lambda: 1.0)
    assert synthesize_prompts(target, tok, path, cfg, deadline=passed) == []
    assert read_synth_prompts(path) == []
    ticks = iter(range(10**6))  # made at 0, due at 5: read before drawing (1), then per draw
    draws: list[int] = []
    got = synthesize_prompts(
        target,
        tok,
        path,
        cfg,
        on_batch=lambda kept, _: draws.append(kept),
        deadline=Deadline.after(5, lambda: float(next(ticks))),
    )
    assert len(draws) == 3 and sum(draws) == len(got) and read_synth_prompts(path) == got
    whole = synthesize_prompts(target, tok, tmp_path / "whole.jsonl", cfg)
    assert got == whole[: len(got)]  # the same draws, cut short


def test_summary_prompts_pick_long_finished_answers() -> None:
    tok = WordTokenizer()
    samples = [
        Sample("a:1#0", [1], [5] * 10 + [EOS], "stop"),
        Sample("a:2#0", [1], [6] * 3, "stop"),  # too short
        Sample("a:3#0", [1], [7] * 12, "length"),  # cut off
        Sample("a:4#0:summarize#0", [1], [8] * 12, "stop"),  # already a summary
        Sample("a:5#0", [1], [9] * 11, "stop"),
    ]
    got = summary_prompts(tok, samples, count=5, min_tokens=8)
    assert sorted(c.source for c in got) == ["a:1#0:summarize", "a:5#0:summarize"]
    by = {c.source: c.turns[0] for c in got}
    assert by["a:1#0:summarize"] == SUMMARIZE.format(text=" ".join(["w5"] * 10))
    assert summary_prompts(tok, samples, count=1, min_tokens=8) == summary_prompts(
        tok, samples, count=1, min_tokens=8
    )


def test_summary_prompts_join_answers_into_long_texts() -> None:
    tok = WordTokenizer()
    samples = [Sample(f"a:{i}#0", [1], [10 + i] * 9 + [EOS], "stop") for i in range(6)]
    samples.append(Sample("a:9#0", [1], [30] * 3, "stop"))  # too short: never joined
    got = summary_prompts(tok, samples, count=20, min_tokens=8, seed=3, join=3)
    assert len(got) == 20 and len({c.source for c in got}) == 20
    paragraphs = [c.turns[0].removeprefix("Summarize: ").split("\n\n") for c in got]
    counts = [len(p) for p in paragraphs]
    assert set(counts) == {1, 2, 3}  # a seeded count from 1 to join
    for p in paragraphs:
        assert len(set(p)) == len(p)  # no answer twice in one text
        assert all(x in {" ".join([f"w{10 + i}"] * 9) for i in range(6)} for x in p)
    assert got == summary_prompts(tok, samples, count=20, min_tokens=8, seed=3, join=3)
    assert summary_prompts(tok, samples[-1:], count=5, min_tokens=8, join=3) == []
    with pytest.raises(ValueError, match="join"):
        summary_prompts(tok, samples, count=1, min_tokens=8, join=0)


ANSWER = """Here is the code.

```python
def add(a: int,
        b: int) -> int:
    \"\"\"Add two numbers.

    >>> add(1, 2)
    3
    \"\"\"
    return a + b


def one():
    '''One line.'''
    return 1


def only_doc():
    \"\"\"Nothing after the docstring.\"\"\"


x = 3
def bare(x):
    return x * 2
```

Text with `def inline():` is not code, nor is a block without a function:
```
print("hi")
```
"""


def test_code_stubs_cut_functions_after_signature_and_docstring() -> None:
    assert code_stubs(ANSWER) == [
        'def add(a: int,\n        b: int) -> int:\n    """Add two numbers.\n\n'
        '    >>> add(1, 2)\n    3\n    """\n',
        "def one():\n    '''One line.'''\n",
        "def bare(x):\n",
    ]
    assert code_stubs("no code at all") == []
    assert code_stubs('```python\ndef cut_off(x):\n    """never closed\n') == []
    # a block still open where the answer stops: its functions that a top-level line follows
    # ended, the last may be half written
    cut = "```python\ndef whole(x):\n    return x\n```\n```python\ndef ends(z):\n    return z\n\n"
    cut += "print(ends(1))\ndef half(y):\n    y"
    assert code_stubs(cut) == ["def whole(x):\n", "def ends(z):\n"]


def test_completion_prompts_take_distinct_stubs_of_the_targets_answers() -> None:
    class TextTokenizer:  # answer i decodes to texts[i]
        def decode(self, ids: list[int]) -> str:
            return texts[ids[0]]

    late = "```python\ndef late(y):\n    return y\n```\nThen ```python\ndef cut(z):\n    z"
    texts = [ANSWER, ANSWER, late, ANSWER]
    samples = [
        Sample("a:1#0", [1], [0], "stop"),
        Sample("a:2#0", [1], [1], "stop"),  # the same stubs again: kept once
        Sample("a:3#0", [1], [2], "length"),  # cut at the cap: its closed block still counts
        Sample("a:4#0:complete0#0", [1], [3], "stop"),  # a completion's own answer
    ]
    got = completion_prompts(TextTokenizer(), samples, count=10)
    assert sorted(c.source for c in got) == [
        "a:1#0:complete0",
        "a:1#0:complete1",
        "a:1#0:complete2",
        "a:3#0:complete0",
    ]
    stubs = [*code_stubs(ANSWER), "def late(y):\n"]
    assert {c.turns[0] for c in got} == {COMPLETE.format(stub=s) for s in stubs}
    two = completion_prompts(TextTokenizer(), samples, count=2, seed=3)
    assert len(two) == 2 and two == completion_prompts(TextTokenizer(), samples, count=2, seed=3)


def test_init_from_continues_a_saved_head(tmp_path: Path) -> None:
    """What the pipeline's --init-from does: the saved head's weights come back into a fresh fp32
    head built around the target's embedding with this run's vocabulary; lm_head rows of tokens
    in both vocabularies continue, the others start from the target's rows mapped onto the saved
    head's scale (the linear map fitted on the shared rows)."""
    from eaglespec.train.pipeline import build_head, check_init_vocab, init_head
    from eaglespec.train.vocab import DraftVocab

    target = tiny_target(0, vocab=V, layers=4, hidden=16)
    capture = default_capture(4)
    saved = random_eagle3(target, draft_vocab_size=32, seed=3)
    old_ids = torch.arange(0, 64, 2)  # the saved head drafts even ids
    saved.d2t.copy_(old_ids - torch.arange(32))
    torch.manual_seed(5)
    M = torch.randn(16, 16) / 4  # the saved head's rows: the target's, mapped by M
    with torch.no_grad():
        saved.lm_head.weight.copy_(target.lm_head.weight[old_ids] @ M)
    folder = save_eagle3(saved, tmp_path / "h", capture, num_target_layers=4)
    loaded = load_eagle3(folder, target, dtype=torch.float32)

    class _Loaded:
        model, config = target, target.cfg

    new_ids = torch.arange(16, 48)  # this run's vocabulary: half of it shared
    vocab = DraftVocab(new_ids, V)
    head = build_head(_Loaded(), target.lm_head.weight[vocab.ids], vocab, 3, "cpu")  # type: ignore[arg-type]
    assert init_head(head, loaded, capture) == 16  # 16, 18, .., 46
    mine = head.state_dict()
    for name, t in saved.state_dict().items():
        if not name.startswith(("embed.", "lm_head.")) and name != "d2t":
            assert torch.equal(mine[name].to(t.dtype), t), name
    assert torch.equal(head.d2t, new_ids - torch.arange(32))
    for row, tid in enumerate(new_ids.tolist()):
        if tid % 2 == 0:  # carried over exactly
            assert torch.equal(head.lm_head.weight[row], loaded.head.lm_head.weight[tid // 2])
        else:  # the map fitted on the 16 shared rows recovers M
            want = target.lm_head.weight[tid] @ M
            torch.testing.assert_close(head.lm_head.weight[row], want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="captures layers"):
        init_head(head, loaded, (0, 1, 2))
    # --keep-vocab keeps its 32 tokens: a run's vocabulary of fewer is refused before answering
    for size in (32, 48, 0, V):
        check_init_vocab(loaded, size, V)
    with pytest.raises(ValueError, match="drafts 32 tokens, more than --draft-vocab 16"):
        check_init_vocab(loaded, 16, V)


def _fields(cfg: SynthConfig) -> dict[str, object]:
    return {f: getattr(cfg, f) for f in cfg.__slots__}  # type: ignore[attr-defined]


def _one_turn_answered(tmp_path: Path, answer: list[int]) -> tuple[Path, Path, Sample]:
    """A prompt file of one turn ("Write add.") and an output folder whose responses.jsonl
    already holds its answer `answer`: (the file, the folder, the answer's sample)."""
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"turns": ["Write add."]}) + "\n")
    out = tmp_path / "head"
    (out / "work").mkdir(parents=True)
    seeded = Sample("q.jsonl:1#0", [1, 2], answer, "stop")  # the data's one turn, answered
    (out / "work" / "responses.jsonl").write_text(json.dumps(asdict(seeded)) + "\n")
    return data, out, seeded


def test_pipeline_answers_summaries_and_completions_of_its_own_answers(
    tmp_path: Path, tiny_hf_folder: Path
) -> None:
    """--summaries and --completions: prompts made from the answers already in responses.jsonl
    are answered in the same regeneration stage (here the one answer is already there, so only
    the derived prompts are new). The summary's prompt does not fit the tiny model's context of
    128: it is skipped and counted, not an error."""
    from eaglespec.tokenizer import Tokenizer
    from eaglespec.train.pipeline import PipelineConfig, run
    from eaglespec.train.regen import RegenConfig

    tok = Tokenizer.from_hf_folder(tiny_hf_folder)
    data, out, seeded = _one_turn_answered(tmp_path, tok.encode(ANSWER))
    cfg = PipelineConfig(
        target=str(tiny_hf_folder),
        data=(str(data),),
        out=out,
        regen=RegenConfig(max_new_tokens=4),
        summaries=1,
        summary_min_tokens=10,
        completions=2,
        stop_after="regen",
    )
    report = run(cfg, log=lambda _: None, progress=False)
    keys = [json.loads(line)["key"] for line in (out / "work" / "responses.jsonl").open()]
    assert keys[0] == seeded.key and len(keys) == 3 and report["regen"]["new"] == 2
    assert sum(":complete" in k for k in keys) == 2
    assert report["regen"]["skipped_long"] == 1  # the summary of a 200-token answer


def test_followups_are_second_turns_written_after_the_targets_own_answer(tmp_path: Path) -> None:
    """Each follow-up is its conversation's first turn again with a second one under the same
    source: a FOLLOWUP_STARTERS opening and what the model wrote after it, seeded by the source,
    in the context of the first request and the target's own answer. Only one-turn conversations
    whose answer ended by itself and fits `max_context` are asked, never a summary's or a
    completion's; a resumed run keeps what the file holds and writes the rest."""
    target = tiny_target(0, vocab=V, layers=2)
    tok = WordTokenizer()
    convs = [Conversation((f"q{i} ask",), f"d:{i}") for i in range(40)]
    convs += [
        Conversation(("cut",), "d:cut"),  # its answer ran to the cap
        Conversation(("long",), "d:long"),  # request and answer past max_context
        Conversation(("sum",), "d:1#0:summarize"),  # a derived prompt
        Conversation(("t1", "t2"), "d:two"),  # already two turns
        Conversation(("unanswered",), "d:none"),
    ]
    samples = [Sample(f"d:{i}#0", [1, 2], [10 + i, 11, EOS], "stop") for i in range(40)]
    samples += [
        Sample("d:cut#0", [1], [5, 6], "length"),
        Sample("d:long#0", [1] * 30, [5] * 40, "stop"),
        Sample("d:1#0:summarize#0", [1], [5, EOS], "stop"),
        Sample("d:two#0", [1], [5, EOS], "stop"),
    ]
    cfg = SynthConfig(max_tokens=64, batch=8, seed=0)
    path = tmp_path / "followups.jsonl"
    first = followup_prompts(target, tok, convs, samples, path, 3, cfg, max_context=64)
    assert len(first) == 3 and read_followups(path) == first
    by_source = {c.source: c for c in convs}
    for c in first:
        assert c.source.startswith("d:") and c.source[2:].isdigit()  # only the eligible
        assert c.turns[0] == by_source[c.source].turns[0] and len(c.turns) == 2
        start = next(s for s in FOLLOWUP_STARTERS if c.turns[1].startswith(s.text))
        i = int(c.source[2:])
        history = [
            {"role": "user", "content": c.turns[0]},
            {"role": "assistant", "content": tok.decode([10 + i, 11, EOS])},
        ]
        prefix = user_turn_prefix(tok, history)
        assert prefix == tok.encode(
            f"<sys>be brief<end><user>{c.turns[0]}<end><assistant>{history[1]['content']}"
            "<end><user>"
        )
        ids = prefix + tok.encode(start.text, add_special=False)
        params = SamplingParams(
            max_tokens=64, temperature=1.0, top_p=0.99, seed=hash_seed(c.source, 0)
        )
        alone = collect_outputs(generate_stream(target, tok, [ids], [params]))[0]
        assert alone.finish_reason == "stop"
        assert c.turns[1] == (start.text + alone.text).strip()
    more = followup_prompts(target, tok, convs, samples, path, 5, cfg, max_context=64)
    assert more[:3] == first and len(more) == 5 and len({c.source for c in more}) == 5
    assert read_followups(path) == more


def test_pipeline_answers_the_followups_second_turn_after_the_first_answer(
    tmp_path: Path, tiny_hf_folder: Path
) -> None:
    """--followups: a follow-up (here one a stopped run left in followups.jsonl, which a resumed
    run keeps) is answered as the conversation's second turn, in the context of the first
    request, the target's own first answer and the follow-up; the first turn is not answered
    again."""
    from eaglespec.tokenizer import Tokenizer
    from eaglespec.train.pipeline import PipelineConfig, run
    from eaglespec.train.regen import RegenConfig

    tok = Tokenizer.from_hf_folder(tiny_hf_folder)
    data, out, seeded = _one_turn_answered(tmp_path, tok.encode("Sure: a + b.", add_special=False))
    followup = {"source": "q.jsonl:1", "turns": ["Write add.", "Now in C."]}
    (out / "work" / "followups.jsonl").write_text(json.dumps(followup) + "\n")
    cfg = PipelineConfig(
        target=str(tiny_hf_folder),
        data=(str(data),),
        out=out,
        regen=RegenConfig(max_new_tokens=4),
        followups=1,
        stop_after="regen",
    )
    report = run(cfg, log=lambda _: None, progress=False)
    lines = [json.loads(line) for line in (out / "work" / "responses.jsonl").open()]
    assert [d["key"] for d in lines] == ["q.jsonl:1#0", "q.jsonl:1#1"]
    assert report["regen"]["new"] == 1 and report["followups"] == 1
    assert report["throughput"]["followups"]["prompts"] == 0  # none written by this run
    assert lines[1]["prompt"] == tok.encode_turns(followup["turns"], [tok.decode(seeded.response)])


def test_a_base_model_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    tok = WordTokenizer()
    tok.chat_template = None  # type: ignore[assignment]
    with pytest.raises(InvalidRequestError, match="no chat template to write user turns in"):
        synthesize_prompts(tiny_target(0, vocab=V), tok, tmp_path / "s.jsonl", SynthConfig(4))  # type: ignore[arg-type]
    path = tmp_path / "f.jsonl"
    with pytest.raises(InvalidRequestError, match="--followups: word-tokenizer has no chat"):
        followup_prompts(tiny_target(0, vocab=V), tok, [], [], path, 4, SynthConfig())  # type: ignore[arg-type]
