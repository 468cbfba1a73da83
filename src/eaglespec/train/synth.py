"""Prompts the target writes itself, for domains the prompt files do not cover.

Two kinds, both from the target alone (no outside data, never the evaluation sets):

- **Self-asked questions** (Magpie, Xu et al. 2024): the chat template rendered up to the start of
  a user message, with nothing after it, is a context in which an instruction-tuned model writes
  the kind of request it was tuned on. Sampled at temperature 1, one per seed, these cover open
  writing, advice, QA and code far more widely than a few hundred seed tasks.
- **Summaries of its own answers**: "Summarize: <text>" over the longest regenerated responses,
  so the head also learns summarization, where the answer copies from a long context.
- **Completions of its own code**: "Complete the code I provided." over the Python functions of
  its own answers, cut after the signature and docstring, so the head also learns to continue a
  given stub (the HumanEval form) rather than only to write code from a description.

Self-asked prompts are appended to `synth_prompts.jsonl` (one JSON object per line, `turns` as in
FastChat questions, plus the seed) as each is written, so an interrupted run keeps what it has.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from eaglespec.config import SamplingParams
from eaglespec.errors import InvalidRequestError
from eaglespec.model.llama import Transformer
from eaglespec.tokenizer import Tokenizer
from eaglespec.train.answering import Job, answer_all
from eaglespec.train.data import Conversation
from eaglespec.train.regen import Sample, drop_partial_tail, read_jsonl

_SENTINEL = "\x00eaglespec-user-turn\x00"
SUMMARIZE = "Summarize: {text}"
COMPLETE = "Complete the code I provided.\n\n{stub}"
_DERIVED = (":summarize", ":complete")  # sources of prompts made from answers


@dataclass(frozen=True, slots=True)
class SynthConfig:
    prompts: int = 0  # self-asked prompts to have in the file
    max_tokens: int = 128  # a longer one is cut and dropped
    temperature: float = 1.0
    top_p: float = 0.99
    batch: int = 64
    min_words: int = 4
    seed: int = 0


def user_turn_prefix(tokenizer: Tokenizer) -> list[int]:
    """Ids of the chat template rendered up to where a user message's text begins (the default
    system prompt included, as the model sees it in a real chat)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], add_generation_prompt=False
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
) -> list[Conversation]:
    """Sample self-asked prompts until `path` holds `cfg.prompts` of them; returns them all.
    Kept: ended by the model itself (end of turn), at least `min_words` words, not a duplicate.
    Gives up after drawing 4x `cfg.prompts` samples this call (a model that rarely ends a user
    turn by itself), returning what it has. Draws are decoded `cfg.batch` at a time in one
    continuously refilled batch (answering.py) and kept in the order they finish."""
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
    draws = 4 * max(cfg.prompts - len(have), 0)
    jobs = [
        Job(
            f"synth:{s}",
            prefix,
            SamplingParams(
                max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seed=s
            ),
        )
        for s in range(seed, seed + draws)
    ]
    with path.open("a") as f:
        answers = answer_all(model, tokenizer, jobs, max_rows=cfg.batch)
        for a in answers:
            if len(have) >= cfg.prompts:
                answers.close()
                break
            o = a.output
            text = o.text.strip()
            ended = o.finish_reason == "stop"
            kept = ended and len(text.split()) >= cfg.min_words and text not in seen
            if kept:
                seen.add(text)
                have.append(Conversation((text,), a.job.key))
                f.write(json.dumps({"seed": a.job.params.seed, "turns": [text]}) + "\n")
                f.flush()
            if on_batch is not None:
                on_batch(int(kept), len(o.token_ids))
    return have[: cfg.prompts]


def summary_prompts(
    tokenizer: Tokenizer, samples: Sequence[Sample], count: int, min_tokens: int, seed: int = 0
) -> list[Conversation]:
    """`count` summarization prompts over a seeded choice of responses with at least
    `min_tokens` tokens that ended by themselves; the source names the answer summarized."""
    pool = [
        s
        for s in samples
        if s.finish == "stop" and len(s.response) >= min_tokens and not _derived(s.key)
    ]
    random.Random(f"{seed}:summarize").shuffle(pool)
    return [
        Conversation(
            (SUMMARIZE.format(text=tokenizer.decode(s.response).strip()),), f"{s.key}:summarize"
        )
        for s in pool[:count]
    ]


def completion_prompts(
    tokenizer: Tokenizer, samples: Sequence[Sample], count: int, seed: int = 0
) -> list[Conversation]:
    """`count` code-completion prompts over a seeded choice of the distinct function stubs
    (`code_stubs`) in answers that ended by themselves; the source names the answer."""
    pool: dict[str, str] = {}  # stub -> source, first answer wins
    for s in samples:
        if s.finish == "stop" and not _derived(s.key):
            for i, stub in enumerate(code_stubs(tokenizer.decode(s.response))):
                pool.setdefault(stub, f"{s.key}:complete{i}")
    stubs = sorted(pool)
    random.Random(f"{seed}:complete").shuffle(stubs)
    return [Conversation((COMPLETE.format(stub=stub),), pool[stub]) for stub in stubs[:count]]


def code_stubs(text: str) -> list[str]:
    """The top-level Python functions of fenced code blocks in `text`, each cut after its
    signature and, where one follows, its docstring: what is left is for the model to write.
    Functions with an empty body left (the docstring was all there was) are skipped."""
    stubs = []
    for block in text.split("```")[1::2]:
        lines = block.split("\n")[1:]  # the fence's language tag
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
            stubs.append("\n".join(lines[i:end]) + "\n")
    return stubs


def _derived(key: str) -> bool:
    return any(tag in key for tag in _DERIVED)
