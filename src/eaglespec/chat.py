"""`eaglespec chat`: an interactive conversation through the model's chat template, answers
streamed, with the same per-turn figures as `generate` (tokens, tok/s, acceptance length).

Lines starting with "/" are commands: /reset forgets the conversation, /exit (or end of input)
leaves. The conversation is the model's own earlier answers plus the user's turns, re-encoded
through the template each turn, so multi-turn prompts are exactly what the template makes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TextIO

from eaglespec.calibration import CalibrationStore
from eaglespec.cliargs import add_model_args, add_speculation_args, load_llm, precision_line
from eaglespec.config import SamplingParams
from eaglespec.errors import InvalidRequestError
from eaglespec.llm import LLM
from eaglespec.requests import RequestOutput

HELP = "/reset forgets the conversation, /exit leaves (or Ctrl-D)"


def add_chat_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "chat",
        help="chat with a model interactively (streams answers, per-turn stats)",
        description=f"An interactive chat through the model's chat template. {HELP}.",
    )
    p.add_argument("--system", help="system message")
    p.add_argument("--max-tokens", type=int, default=512, help="per answer")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="seed for sampling")
    add_model_args(p)
    add_speculation_args(p, default_method="eagle3 with the head shipped for the model, else none")


def cmd_chat(args: argparse.Namespace) -> int:
    llm = load_llm(args, progress=True)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if not llm.tokenizer.chat_template:
        raise InvalidRequestError(f"{args.model} has no chat template; use `eaglespec generate`")
    say(precision_line(llm))
    if llm.draft_report:
        say(f"[{llm.method}: {llm.draft_report}]")
    calibration = CalibrationStore.open(llm, say)
    if llm.compile != "none":
        say("[compiling the decode steps: a short warm-up generation]")
        llm.warm_up("Hello")
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    say(f"[{HELP}]")
    try:
        chat_loop(llm, params, args.system, terminal_reader(), sys.stdout, say)
    finally:
        calibration.save()
    return 0


def terminal_reader() -> Callable[[], str | None]:
    """Lines from standard input: with a prompt and line editing (readline) on a terminal,
    plain lines from a pipe; None at the end of input."""
    if not sys.stdin.isatty():
        return lambda: sys.stdin.readline() or None
    import readline  # noqa: F401  (gives input() line editing and history)

    def read() -> str | None:
        try:
            return input("> ")
        except EOFError:
            return None

    return read


def lines_of(stream: TextIO) -> Callable[[], str | None]:
    return lambda: stream.readline() or None


def chat_loop(
    llm: LLM,
    params: SamplingParams,
    system: str | None,
    read_line: Callable[[], str | None],
    stdout: TextIO,
    say: Callable[[str], None],
) -> list[dict[str, str]]:
    """Read user turns with `read_line` until /exit or the end of input (None); returns the
    conversation."""
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    while True:
        line = read_line()
        if line is None:
            break
        text = line.strip()
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(start)
            say("[conversation cleared]")
            continue
        if not text:
            continue
        if text.startswith("/"):
            say(f"[unknown command {text.split()[0]}: {HELP}]")
            continue
        messages.append({"role": "user", "content": text})
        ids = llm.tokenizer.encode_chat(messages)
        if len(ids) + 1 > llm.config.context_limit:
            messages.pop()
            say(
                f"[the conversation is {len(ids)} tokens, past the model's context of "
                f"{llm.config.context_limit}; /reset to start over]"
            )
            continue
        output = None
        for event in llm.stream([ids], params):
            stdout.write(event.text)
            stdout.flush()
            output = event.output or output
        assert output is not None
        stdout.write("\n")
        messages.append({"role": "assistant", "content": output.text})
        say(turn_stats(output, llm.method))
    return messages


def turn_stats(output: RequestOutput, method: str) -> str:
    s = output.stats
    line = f"[{len(output.token_ids)} tokens, {s.tokens_per_second:.1f} tok/s"
    if s.rounds:
        line += f", {method}: mean acceptance length {s.mean_accept_length:.2f}"
    return line + f", {output.finish_reason}]"
