"""Prompts the target writes itself, for domains the prompt files do not cover.

Two kinds, both from the target alone (no outside data, never the evaluation sets):

- **Self-asked questions** (Magpie, Xu et al. 2024): the chat template rendered up to the start of
  a user message, with nothing after it, is a context in which an instruction-tuned model writes
  the kind of request it was tuned on. Sampled at temperature 1, one per seed, these cover open
  writing, advice, QA and code far more widely than a few hundred seed tasks.
  With `starters` (`--synth-steer tasks|code|general`), each seed's user turn begins with one of
  a mix of starters, chosen by the seed, and the model writes the rest: the mix is steered
  towards the kinds of requests users make of an assistant (STARTERS: code, math, questions,
  writing, rewriting or summarising a text the request itself holds, multi-step instructions;
  CODE_STARTERS: writing, completing, explaining and fixing code in several languages, with a
  quarter general requests; or GENERAL_STARTERS: short instructions, questions and advice,
  writing and rewriting, with a quarter code and math) instead of wherever the model's own turns
  drift. The starters are generic openings written for this purpose, not taken from any set.
- **Summaries of its own answers**: "Summarize: <text>" over the longest regenerated responses,
  so the head also learns summarization, where the answer copies from a long context.
- **Follow-ups to its own answers**: the chat rendered after one of its answers up to where the
  next user message begins, and a generic opening (FOLLOWUP_STARTERS), so the model writes a
  second request about its answer (change it, extend it, question it: what a chat's second turn
  asks, the MT-bench form) and then answers it with its first answer in context.
- **Completions of its own code**: "Complete the code I provided." over the Python functions of
  its own answers, cut after the signature and docstring, so the head also learns to continue a
  given stub (the HumanEval form) rather than only to write code from a description.

Self-asked prompts are appended to `synth_prompts.jsonl` (one JSON object per line, `turns` as in
FastChat questions, plus the seed) as each is written, so an interrupted run keeps what it has.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from eaglespec.config import SamplingParams
from eaglespec.errors import InvalidRequestError
from eaglespec.model.llama import Transformer
from eaglespec.tokenizer import Tokenizer
from eaglespec.train.answering import BUDGET, MAX_ROWS, Job, answer_all
from eaglespec.train.data import Conversation
from eaglespec.train.meter import NEVER, Deadline
from eaglespec.train.regen import Sample, drop_partial_tail, read_jsonl

_SENTINEL = "\x00eaglespec-user-turn\x00"
SUMMARIZE = "Summarize: {text}"
COMPLETE = "Complete the code I provided.\n\n{stub}"
_DERIVED = (":summarize", ":complete")  # sources of prompts made from answers


@dataclass(frozen=True, slots=True)
class Starter:
    text: str  # how the user turn begins; the model writes the rest
    max_tokens: int = 128  # room for the rest (a request quoting a text needs more)


_TEXT = 384  # a starter whose request carries a passage the model writes itself
STARTERS = (
    # code
    Starter("Write a Python function that"),
    Starter("Write a Python program that"),
    Starter("Write a JavaScript function that"),
    Starter("Implement a Python class that"),
    Starter("Fix the bug in this code:\n\n```python\n", _TEXT),
    Starter("Explain what this code does:\n\n```python\n", _TEXT),
    # math
    Starter("Solve this problem step by step:"),
    Starter("Calculate"),
    Starter("A word problem:"),
    # questions
    Starter("What is"),
    Starter("Why do"),
    Starter("How does"),
    Starter("Who was"),
    Starter("What is the difference between"),
    # writing
    Starter("Write a short story about"),
    Starter("Write an email to"),
    Starter("Write a poem about"),
    Starter("Write a blog post about"),
    Starter("Imagine you are"),
    # a text given in the request
    Starter("Summarize the following article:\n\n", _TEXT),
    Starter("Summarize this text in two sentences:\n\n", _TEXT),
    Starter("Rewrite this paragraph to be more formal:\n\n", _TEXT),
    Starter("Extract the key points from this passage:\n\n", _TEXT),
    # instructions
    Starter("Give me three tips for"),
    Starter("List five"),
    Starter("Compare"),
    Starter("Describe"),
    Starter("Plan a"),
)


_CODE_TEXT = 320  # room for a snippet the model writes into the request
CODE_STARTERS = (
    # write, in several languages
    Starter("Write a Python function that"),
    Starter("Write a Python script that"),
    Starter("Write a JavaScript function that"),
    Starter("Write a TypeScript function that"),
    Starter("Write a C++ function that"),
    Starter("Write a Rust function that"),
    Starter("Write a Go function that"),
    Starter("Write a Java method that"),
    Starter("Write a SQL query that"),
    Starter("Write a bash script that"),
    Starter("Implement a Python class that"),
    Starter("Write unit tests for a Python function that"),
    # complete, explain, fix, improve code given in the request
    Starter("Complete this function:\n\n```python\ndef", _CODE_TEXT),
    Starter("Complete the code:\n\n```python\n", _CODE_TEXT),
    Starter("Explain what this code does:\n\n```python\n", _CODE_TEXT),
    Starter("Explain this JavaScript code:\n\n```javascript\n", _CODE_TEXT),
    Starter("Fix the bug in this code:\n\n```python\n", _CODE_TEXT),
    Starter("Refactor this code to be more readable:\n\n```python\n", _CODE_TEXT),
    Starter("Add type hints and a docstring to this function:\n\n```python\ndef", _CODE_TEXT),
    Starter("What is the time complexity of this code?\n\n```python\n", _CODE_TEXT),
    # questions about programming
    Starter("How do I"),
    Starter("What is the difference between"),
    Starter("Explain how"),
    # general requests, a quarter of the mix
    Starter("Solve this problem step by step:"),
    Starter("What is"),
    Starter("Write a short story about"),
    Starter("Summarize the following article:\n\n", _TEXT),
    Starter("Give me three tips for"),
)
GENERAL_STARTERS = (
    # short instructions of the kind assistants are tuned on
    Starter("Rewrite the following sentence"),
    Starter("Give an example of"),
    Starter("Generate a list of"),
    Starter("Suggest"),
    Starter("Explain the concept of"),
    Starter("Classify the following"),
    Starter("Create a"),
    Starter("Name three"),
    Starter("Brainstorm"),
    Starter("Edit this sentence"),
    Starter("Translate"),
    Starter("Identify"),
    # questions and advice
    Starter("What are the benefits of"),
    Starter("What is the best way to"),
    Starter("How can I"),
    Starter("Why is"),
    Starter("Can you explain"),
    Starter("What should I"),
    # writing, and a text given in the request
    Starter("Write a paragraph about"),
    Starter("Write a letter to"),
    Starter("Write a product description for"),
    Starter("Rewrite this paragraph to be more concise:\n\n", _TEXT),
    Starter("Summarize the following article:\n\n", _TEXT),
    Starter("Give me feedback on this essay:\n\n", _TEXT),
    # a quarter code and math
    Starter("Write a Python function that"),
    Starter("Explain what this code does:\n\n```python\n", _TEXT),
    Starter("How do I"),
    Starter("Solve this problem step by step:"),
    Starter("A word problem:"),
    Starter("Calculate"),
)
# How a follow-up request begins (`followup_prompts`): the kinds of second turns a chat brings
# (change, extend, rewrite or question the answer just given), generic openings written for this
# purpose, not taken from any set.
FOLLOWUP_STARTERS = (
    Starter("Now"),
    Starter("Can you"),
    Starter("Could you also"),
    Starter("Rewrite your previous answer"),
    Starter("Make it"),
    Starter("What if"),
    Starter("Why"),
    Starter("How"),
    Starter("Explain"),
    Starter("Thanks! Now"),
    Starter("Great. Please"),
    Starter("Summarize"),
    Starter("Give me"),
    Starter("Write"),
    Starter("I don't understand"),
    Starter("That's not quite right."),
)
# Follow-ups are sampled cooler than self-asked prompts: at 1.0 / 0.99 SmolLM2-135M's second
# turns drifted off the answer they follow more often than at 0.7 / 0.95 (16 draws of each read
# side by side, session 55); what is asked stays the model's own.
FOLLOWUP_TEMPERATURE = 0.7
FOLLOWUP_TOP_P = 0.95
STARTER_MIXES = {  # `--synth-steer MIX`
    "tasks": STARTERS,
    "code": CODE_STARTERS,
    "general": GENERAL_STARTERS,
}


@dataclass(frozen=True, slots=True)
class SynthConfig:
    prompts: int = 0  # self-asked prompts to have in the file
    max_tokens: int = 128  # a longer one is cut and dropped (a starter may give more)
    temperature: float = 1.0
    top_p: float = 0.99
    batch: int = MAX_ROWS  # rows decoded at once
    batch_tokens: int = BUDGET  # rows x their positions at most (answering.answer_all's budget)
    max_seconds: float | None = None  # stop writing after this long (pipeline.py's Deadline)
    min_words: int = 4
    seed: int = 0
    starters: tuple[Starter, ...] = ()  # begin each user turn with one (by seed); () = none


def starter_for(seed: int, starters: Sequence[Starter]) -> Starter | None:
    """The starter of draw `seed` (None without starters): the same on every run and resume."""
    return random.Random(f"{seed}:starter").choice(starters) if starters else None


def user_turn_prefix(tokenizer: Tokenizer, history: Sequence[dict[str, str]] = ()) -> list[int]:
    """Ids of the chat template rendered up to where a user message's text begins (the default
    system prompt included, as the model sees it in a real chat), after the messages of
    `history` (a follow-up's: the first request and the model's answer to it)."""
    text = tokenizer.apply_chat_template(
        [*history, {"role": "user", "content": _SENTINEL}], add_generation_prompt=False
    )
    return tokenizer.encode(text[: text.index(_SENTINEL)], add_special=False)


def read_synth_prompts(path: Path) -> list[Conversation]:
    return [Conversation(tuple(d["turns"]), f"synth:{d['seed']}") for d in read_jsonl(path)]


def synthesize_prompts(
    model: Transformer,
    tokenizer: Tokenizer,
    path: Path,
    cfg: SynthConfig,
    *,
    on_batch: Callable[[int, int], None] | None = None,  # (prompts kept, tokens) per draw
    deadline: Deadline = NEVER,
) -> list[Conversation]:
    """Sample self-asked prompts until `path` holds `cfg.prompts` of them; returns them all.
    Kept: ended by the model itself (end of turn), at least `min_words` words, not a duplicate.
    Gives up after drawing 4x `cfg.prompts` samples this call (a model that rarely ends a user
    turn by itself), returning what it has, and stops at the first draw that finishes after
    `deadline`. Draws are decoded `cfg.batch` at a time in one continuously refilled batch
    (answering.py) and kept in the order they finish."""
    if not tokenizer.chat_template:
        raise InvalidRequestError(
            f"--synth-prompts: {tokenizer.name} has no chat template to write user turns in "
            "(a base model); give it prompts from --data only"
        )
    drop_partial_tail(path)  # a killed run's last, half-written line
    have = read_synth_prompts(path)
    seen = {c.turns[0] for c in have}
    prefix = user_turn_prefix(tokenizer)
    seed = cfg.seed * 1_000_000 + max((int(c.source.split(":")[1]) for c in have), default=-1) + 1
    draws = 0 if deadline.passed() else 4 * max(cfg.prompts - len(have), 0)
    starts = {s: starter_for(s, cfg.starters) for s in range(seed, seed + draws)}
    jobs = []
    for s, start in starts.items():
        ids = prefix + (tokenizer.encode(start.text, add_special=False) if start else [])
        room = max(cfg.max_tokens, start.max_tokens) if start else cfg.max_tokens
        params = SamplingParams(
            max_tokens=room, temperature=cfg.temperature, top_p=cfg.top_p, seed=s
        )
        jobs.append(Job(f"synth:{s}", ids, params))
    with path.open("a") as f:
        answers = answer_all(model, tokenizer, jobs, max_rows=cfg.batch, budget=cfg.batch_tokens)
        for a in answers:
            if len(have) >= cfg.prompts or deadline.passed():
                answers.close()
                break
            o, draw = a.output, a.job.params.seed
            assert draw is not None  # every draw is seeded above
            start = starts[draw]
            text = ((start.text if start else "") + o.text).strip()
            ended = o.finish_reason == "stop"
            # the model's own words: at least min_words, or two after a starter
            words = len(o.text.split()) >= (cfg.min_words if start is None else 2)
            kept = ended and words and text not in seen
            if kept:
                seen.add(text)
                have.append(Conversation((text,), a.job.key))
                f.write(json.dumps({"seed": draw, "turns": [text]}) + "\n")
                f.flush()
            if on_batch is not None:
                on_batch(int(kept), len(o.token_ids))
    return have[: cfg.prompts]


def summary_prompts(
    tokenizer: Tokenizer,
    samples: Sequence[Sample],
    count: int,
    min_tokens: int,
    seed: int = 0,
    join: int = 1,
) -> list[Conversation]:
    """`count` summarization prompts over a seeded choice of responses with at least
    `min_tokens` tokens that ended by themselves; the source names the answer summarized.

    With `join` > 1 each text joins 1 to `join` such answers (a seeded count, the answers drawn
    without repeats within a text) as paragraphs: texts of the lengths the articles users ask to
    have summarised run to (600-1,600 tokens), so the head learns to copy at the positions and
    from the contexts such prompts bring. The source names the first answer and the text's
    index."""
    if join < 1:
        raise ValueError(f"join must be at least 1, got {join}")
    pool = [
        s
        for s in samples
        if s.finish == "stop" and len(s.response) >= min_tokens and not _derived(s.key)
    ]
    rng = random.Random(f"{seed}:summarize")
    rng.shuffle(pool)
    if join == 1:
        return [
            Conversation(
                (SUMMARIZE.format(text=tokenizer.decode(s.response).strip()),),
                f"{s.key}:summarize",
            )
            for s in pool[:count]
        ]
    convs = []
    for i in range(count if pool else 0):
        parts = rng.sample(pool, min(len(pool), rng.randint(1, join)))
        text = "\n\n".join(tokenizer.decode(s.response).strip() for s in parts)
        convs.append(Conversation((SUMMARIZE.format(text=text),), f"{parts[0].key}:summarize{i}"))
    return convs


def completion_prompts(
    tokenizer: Tokenizer, samples: Sequence[Sample], count: int, seed: int = 0
) -> list[Conversation]:
    """`count` code-completion prompts over a seeded choice of the distinct function stubs
    (`code_stubs`) in the target's own answers; the source names the answer. Answers cut at the
    token cap count too: `code_stubs` reads only functions that ended (a fenced block that
    closed, or a top-level line after them)."""
    pool: dict[str, str] = {}  # stub -> source, first answer wins
    for s in samples:
        if not _derived(s.key):
            for i, stub in enumerate(code_stubs(tokenizer.decode(s.response))):
                pool.setdefault(stub, f"{s.key}:complete{i}")
    stubs = sorted(pool)
    random.Random(f"{seed}:complete").shuffle(stubs)
    return [Conversation((COMPLETE.format(stub=stub),), pool[stub]) for stub in stubs[:count]]


def read_followups(path: Path) -> list[Conversation]:
    return [Conversation(tuple(d["turns"]), d["source"]) for d in read_jsonl(path)]


def followup_prompts(
    model: Transformer,
    tokenizer: Tokenizer,
    convs: Sequence[Conversation],
    samples: Sequence[Sample],
    path: Path,
    count: int,
    cfg: SynthConfig,
    *,
    max_context: int = 768,
    on_batch: Callable[[int, int], None] | None = None,  # (prompts kept, tokens) per draw
    deadline: Deadline = NEVER,
) -> list[Conversation]:
    """Second user turns the target writes itself after its own answer (Magpie's trick one turn
    on): over a seeded choice of one-turn conversations whose answer ended by itself (summaries
    and completions left out) and whose request and answer take at most `max_context` tokens,
    the chat rendered up to where the next user message begins, then a FOLLOWUP_STARTERS
    opening picked by the draw, and the model writes the rest at `cfg`'s temperature. Kept as
    for `synthesize_prompts` (ended by the model, two words after the opening; at most 4x `count`
    draws). Each is the conversation again with the follow-up as its second turn, under the
    first one's source, so answering it reuses the first answer (regen.py keys turns by source)
    and only the second is new. Appended to `path` as written ({"source", "turns"}); a resumed
    run keeps those and writes the rest. Returns at most `count`, in the order they finished."""
    if not tokenizer.chat_template:
        raise InvalidRequestError(
            f"--followups: {tokenizer.name} has no chat template to write user turns in "
            "(a base model)"
        )
    drop_partial_tail(path)
    have = read_followups(path)
    done = {c.source for c in have}
    by_source = {c.source: c for c in convs if len(c.turns) == 1}
    answered = {s.key: s for s in samples}
    pool = sorted(
        src
        for src, c in by_source.items()
        if src not in done
        and not _derived(src)
        and (a := answered.get(f"{src}#0")) is not None
        and a.finish == "stop"
        and len(a.prompt) + len(a.response) <= max_context
    )
    random.Random(f"{cfg.seed}:followups").shuffle(pool)
    draws = 0 if deadline.passed() else 4 * max(count - len(have), 0)
    jobs, starts = [], {}
    for src in pool[:draws]:
        draw = hash_seed(src, cfg.seed)
        start = starter_for(draw, FOLLOWUP_STARTERS)
        assert start is not None
        answer = tokenizer.decode(answered[f"{src}#0"].response)
        history = [
            {"role": "user", "content": by_source[src].turns[0]},
            {"role": "assistant", "content": answer},
        ]
        ids = user_turn_prefix(tokenizer, history) + tokenizer.encode(start.text, add_special=False)
        params = SamplingParams(
            max_tokens=cfg.max_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            seed=draw,
        )
        starts[src] = start
        jobs.append(Job(src, ids, params))
    with path.open("a") as f:
        answers = answer_all(model, tokenizer, jobs, max_rows=cfg.batch, budget=cfg.batch_tokens)
        for a in answers:
            if len(have) >= count or deadline.passed():
                answers.close()
                break
            src, o = a.job.key, a.output
            kept = o.finish_reason == "stop" and len(o.text.split()) >= 2
            if kept:
                turns = (by_source[src].turns[0], (starts[src].text + o.text).strip())
                have.append(Conversation(turns, src))
                f.write(json.dumps({"source": src, "turns": list(turns)}) + "\n")
                f.flush()
            if on_batch is not None:
                on_batch(int(kept), len(o.token_ids))
    return have[:count]


def hash_seed(source: str, seed: int) -> int:
    """A draw's seed from its conversation's source: the same on every run and resume."""
    return zlib.crc32(f"{seed}:{source}".encode())


def code_stubs(text: str) -> list[str]:
    """The top-level Python functions of the fenced code blocks of `text`, each cut after its
    signature and, where one follows, its docstring: what is left is for the model to write.
    Functions with an empty body left (the docstring was all there was) are skipped, and so are
    those a block still open at the end of `text` (an answer cut at the token cap) may stop in:
    there a function counts only where a top-level line follows it."""
    stubs = []
    parts = text.split("```")
    for b in range(1, len(parts), 2):  # inside a fence
        lines = parts[b].split("\n")[1:]  # the fence's language tag
        closed = b + 1 < len(parts)
        tops = [j for j, line in enumerate(lines) if line.strip() and line[0] not in " \t"]
        for i, line in enumerate(lines):
            if not line.startswith("def "):
                continue
            end = i
            while end < len(lines) and not lines[end].rstrip().endswith(":"):
                end += 1  # a signature over several lines
            end += 1
            body = [j for j in range(end, len(lines)) if lines[j].strip()]
            if body and lines[body[0]].strip()[:3] in ('"""', "'''"):
                first = body[0]
                quote = lines[first].strip()[:3]
                # the docstring closes on its opening line, or on the first later line quoting
                later = (j for j in range(first + 1, len(lines)) if quote in lines[j])
                close = first if lines[first].count(quote) >= 2 else next(later, None)
                if close is None:
                    continue
                end = close + 1
                body = [j for j in body if j >= end]
            if not body or not lines[body[0]].startswith((" ", "\t")):
                continue  # nothing of the body left to write
            if not closed and not any(j > body[0] for j in tops):
                continue  # the answer may stop inside this function
            stubs.append("\n".join(lines[i:end]) + "\n")
    return stubs


def _derived(key: str) -> bool:
    return any(tag in key for tag in _DERIVED)
