"""Run the benchmark: every question at batch 1 (as Spec-Bench does), methods interleaved.

For question q: plain decoding answers all of q's turns, then each other method does, so a drift in
machine speed hits every method alike. Turn t's prompt is the chat of turns 0..t with the method's
own answers to turns 0..t-1 (FastChat's multi-turn protocol); with greedy decoding and a lossless
method these equal plain decoding's, so every method sees the same prompts.

Before timing, each method generates once (the first question's first turn, a few tokens): first
calls pay for allocation, lazy initialisation and, with --compile, compiling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from eaglespec.bench.lineup import Method
from eaglespec.bench.memory import MemoryMeter
from eaglespec.bench.questions import Question
from eaglespec.config import SamplingParams
from eaglespec.model.loader import LoadedModel
from eaglespec.requests import RequestOutput


@dataclass(frozen=True, slots=True)
class RunSettings:
    max_tokens: int  # new tokens per turn at most
    temperature: float  # 0 = greedy (the only setting where losslessness is checkable)
    seed: int  # sampling seed of every generation when temperature > 0
    warmup_tokens: int = 32  # new tokens of each method's warm-up generation

    def params(self, max_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens or self.max_tokens,
            temperature=self.temperature,
            seed=self.seed if self.temperature > 0 else None,
        )


@dataclass(frozen=True, slots=True)
class Generation:
    method: str
    question: int  # index into the benchmark's question list
    turn: int  # 0-based user turn
    prompt_token_ids: list[int]  # the chat so far, ending in the assistant header
    output: RequestOutput  # token ids, text, finish reason and GenerationStats
    peak_memory_bytes: int  # see MemoryMeter.scope


QuestionDone = Callable[[int, list[Generation]], None]  # (question index, its generations)


def warm_up(
    target: LoadedModel, methods: Sequence[Method], question: Question, settings: RunSettings
) -> None:
    prompt = target.tokenizer.encode_turns(question.turns[:1], [])
    params = settings.params(min(settings.max_tokens, settings.warmup_tokens))
    for method in methods:
        method.generate(target, prompt, params)


def run_conversation(
    target: LoadedModel,
    method: Method,
    question: Question,
    index: int,
    settings: RunSettings,
    meter: MemoryMeter,
) -> list[Generation]:
    """All turns of one question with one method, each turn continuing from its own answers."""
    out: list[Generation] = []
    answers: list[str] = []
    for turn in range(len(question.turns)):
        prompt = target.tokenizer.encode_turns(question.turns[: turn + 1], answers)
        meter.reset()
        result = method.generate(target, prompt, settings.params())
        out.append(Generation(method.name, index, turn, prompt, result, meter.peak_bytes()))
        # The answer as the next turn's context sees it: decoded ids, stop strings aside.
        answers.append(target.tokenizer.decode(result.token_ids))
    return out


def run_benchmark(
    target: LoadedModel,
    methods: Sequence[Method],
    questions: Sequence[Question],
    settings: RunSettings,
    meter: MemoryMeter,
    on_question: QuestionDone | None = None,
) -> list[Generation]:
    """Warm up every method, then answer every question with every method in turn."""
    warm_up(target, methods, questions[0], settings)
    out: list[Generation] = []
    for index, question in enumerate(questions):
        done = [
            g
            for method in methods
            for g in run_conversation(target, method, question, index, settings, meter)
        ]
        out += done
        if on_question is not None:
            on_question(index, done)
    return out
