"""Command line: `eaglespec generate|chat|pull|train|export|serve|bench`.

Errors a user can act on print as one line, with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from eaglespec.bench.command import add_bench_parser, cmd_bench
from eaglespec.calibration import CalibrationStore
from eaglespec.chat import add_chat_parser, cmd_chat
from eaglespec.cliargs import add_model_args, add_speculation_args, load_llm, precision_line
from eaglespec.config import SamplingParams
from eaglespec.errors import EaglespecError
from eaglespec.generate import generate_stream
from eaglespec.registry import MODELS, list_models, pull
from eaglespec.requests import RequestOutput, collect_outputs
from eaglespec.serve.command import add_serve_parser, cmd_serve
from eaglespec.train.command import add_train_parser, cmd_train
from eaglespec.train.export import add_export_parser, cmd_export

if TYPE_CHECKING:
    from eaglespec.llm import LLM


def _add_generate(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    p.add_argument("prompt", help="the prompt text, or - to read it from standard input")
    p.add_argument("--raw", action="store_true", help="no chat template: the prompt as plain text")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="seed for sampling (repeatable runs)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    add_model_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after a speculative run, decode the same prompt plainly and report the measured "
        "speedup (and, when greedy, whether the outputs are identical). Default: on when "
        "streaming with a draft, off with --json",
    )
    add_speculation_args(p, default_method="eagle3 with the head shipped for the model, else none")


def _add_pull(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("pull", help="download a registry model into the cache")
    p.add_argument("name", nargs="?", help=f"one of: {', '.join(MODELS)}")
    p.add_argument("--list", action="store_true", help="list the registry models")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eaglespec", description="LLM inference with EAGLE-3 speculative decoding"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    add_chat_parser(sub)
    _add_pull(sub)
    add_train_parser(sub)
    add_export_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    if args.repetition_penalty != 1 and args.method is None and args.draft is None:
        args.draft = "none"  # the penalty needs plain decoding; only an explicit draft refuses
    llm = load_llm(args, progress=not args.json)

    def say(line: str) -> None:
        if not args.json:
            print(line, file=sys.stderr)

    say(precision_line(llm))
    if llm.draft_report:
        say(f"[{llm.method}: {llm.draft_report}]")
    calibration = CalibrationStore.open(llm, say)
    ids = llm.encode(prompt, chat=not args.raw, system=args.system)
    speculating = llm.proposer is not None and llm.speculation != "off"
    compare = speculating and (not args.json if args.compare is None else args.compare)
    if compare or llm.compile != "none":  # first-call costs (compiling) before anything is timed
        llm.warm_up(ids)
    output = None
    for event in llm.stream([ids], params):
        if not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        output = event.output or output
    assert output is not None
    calibration.save()
    baseline = plain_run(llm, ids, params) if compare else None
    stats = {**output.stats.to_dict(), "load_seconds": llm.loaded.seconds}
    comparison = _comparison(output, baseline, params) if baseline is not None else None
    if args.json:
        result = {
            "model": str(llm.loaded.path),
            "precision": {"dtype": llm.loaded.precision.dtype, "quant": llm.loaded.precision.quant},
            "text": output.text,
            "prompt_token_ids": output.prompt_token_ids,
            "token_ids": output.token_ids,
            "finish_reason": output.finish_reason,
            "stats": stats,
            "method": llm.method,
            "speculation": llm.speculation if speculating else "off",
            "draft": llm.draft_report,
            "plain": comparison,
        }
        print(json.dumps(result))
        return 0
    print()
    say(
        f"[{stats['new_tokens']} tokens, {stats['tokens_per_second']:.1f} tok/s decode, "
        f"prefill {stats['prefill_seconds']:.2f} s ({stats['prompt_tokens']} tokens), "
        f"load {stats['load_seconds']:.2f} s, {output.finish_reason}"
        + (
            f", {llm.method}: mean acceptance length {stats['mean_accept_length']:.2f} "
            f"over {stats['rounds']} rounds]"
            if output.stats.rounds
            else "]"
        )
    )
    if comparison is not None:
        same = {True: ", same output", False: ", OUTPUT DIFFERS", None: ""}[comparison["identical"]]
        say(
            f"[plain decoding of the same prompt: {comparison['tokens_per_second']:.1f} tok/s; "
            f"speculative speedup {comparison['speedup']:.2f}x{same}]"
        )
    return 0


def plain_run(llm: LLM, ids: list[int], params: SamplingParams) -> RequestOutput:
    """The same request decoded without drafting, for the measured comparison."""
    return collect_outputs(generate_stream(llm.model, llm.tokenizer, [ids], [params]))[0]


def _comparison(
    spec: RequestOutput, plain: RequestOutput, params: SamplingParams
) -> dict[str, Any]:
    """Decode speeds of the two runs; identical outputs are only promised for greedy decoding."""
    rate = plain.stats.tokens_per_second
    return {
        "tokens_per_second": rate,
        "new_tokens": len(plain.token_ids),
        "speedup": spec.stats.tokens_per_second / rate if rate else 0.0,
        "identical": spec.token_ids == plain.token_ids if params.temperature == 0 else None,
    }


def cmd_pull(args: argparse.Namespace) -> int:
    if args.list or not args.name:
        for model, pulled in list_models():
            mark = "pulled" if pulled else "-"
            print(f"{model.name:22} {model.size / 1e6:8.0f} MB  {mark:7} {model.description}")
        return 0
    print(pull(args.name))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {
        "generate": cmd_generate,
        "chat": cmd_chat,
        "pull": cmd_pull,
        "train": cmd_train,
        "export": cmd_export,
        "serve": cmd_serve,
        "bench": cmd_bench,
    }
    try:
        return commands[args.command](args)
    except EaglespecError as e:
        print(f"eaglespec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
