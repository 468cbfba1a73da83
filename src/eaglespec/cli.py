"""Command line: `eaglespec generate|pull|train|export`.

Errors a user can act on print as one line, with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch

from eaglespec.bench.command import add_bench_parser, cmd_bench
from eaglespec.cliargs import int_list
from eaglespec.config import SamplingParams, TreeConfig
from eaglespec.errors import EaglespecError, InvalidRequestError
from eaglespec.heads import packaged_head
from eaglespec.methods import METHODS
from eaglespec.model.llama import COMPILE_MODES
from eaglespec.model.quant import QUANT_MODES
from eaglespec.registry import DEFAULT_MODEL, MODELS, list_models, pull
from eaglespec.train.command import add_train_parser, cmd_train
from eaglespec.train.export import add_export_parser, cmd_export


def _add_generate(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    p.add_argument("prompt", help="the prompt text, or - to read it from standard input")
    p.add_argument("--model", default=DEFAULT_MODEL, help="registry name, GGUF file or HF folder")
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
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--quant",
        choices=QUANT_MODES,
        default="none",
        help="weight-only quantization of the linear layers (CPU only): int8 stores int8 "
        "weights with per-channel scales; int4 stores 4-bit weights in groups of 32 (the output "
        "head stays int8). Both use bf16 activations in each matmul (the kernels' only fast "
        "input dtype); with --dtype float32 the inputs are cast to bf16 and back around each "
        "matmul, the rest of the model stays fp32",
    )
    p.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default="none",
        help="torch.compile the decode and verify steps: block (each decoder block; compiles "
        "in seconds) or full (the whole step; fastest, but 1-2 minutes of compiling per run)",
    )
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument(
        "--method",
        choices=METHODS,
        help="eagle3 (the default when --draft is given; alone, it uses the head shipped for "
        "the model), draft-model, lookup, or none (plain, the default)",
    )
    spec.add_argument(
        "--draft",
        help="eagle3: an EAGLE-3 checkpoint folder, or 'random' (a seeded random head: exact "
        "output, little acceptance); draft-model: a model name or path; 'none': plain decoding. "
        "With --method eagle3 and no --draft: the head shipped for the model (heads/)",
    )
    spec.add_argument("--draft-tokens", type=int, default=4, help="draft tokens per round (chain)")
    spec.add_argument(
        "--tree",
        metavar="DEPTH,TOPK,NODES",
        help="draft an EAGLE-2 dynamic tree instead of a chain, e.g. 4,4,16 (eagle3 only)",
    )
    spec.add_argument(
        "--capture",
        metavar="B1,B2,B3",
        help="override the target layers the EAGLE-3 head reads (boundary indices)",
    )


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
    _add_pull(sub)
    add_train_parser(sub)
    add_export_parser(sub)
    add_bench_parser(sub)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from eaglespec.llm import LLM  # torch-heavy imports only for commands that need them

    if args.threads:
        torch.set_num_threads(args.threads)
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
    method, draft = _method_and_draft(args.model, args.method, args.draft)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        quant=args.quant,
        compile=args.compile,
        progress=not args.json,
        method=method,
        draft=draft,
        num_draft=args.draft_tokens,
        tree=_tree(args.tree),
        capture=int_list(args.capture, "--capture") if args.capture else None,
    )
    if llm.draft_report and not args.json:
        print(f"[{llm.method}: {llm.draft_report}]", file=sys.stderr)
    ids = llm.encode(prompt, chat=not args.raw, system=args.system)
    output = None
    for event in llm.stream([ids], params):
        if not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        output = event.output or output
    assert output is not None
    stats = {**output.stats.to_dict(), "load_seconds": llm.loaded.seconds}
    if args.json:
        result = {
            "model": str(llm.loaded.path),
            "text": output.text,
            "prompt_token_ids": output.prompt_token_ids,
            "token_ids": output.token_ids,
            "finish_reason": output.finish_reason,
            "stats": stats,
            "method": llm.method,
            "draft": llm.draft_report,
        }
        print(json.dumps(result))
    else:
        print()
        print(
            f"[{stats['new_tokens']} tokens, {stats['tokens_per_second']:.1f} tok/s decode, "
            f"prefill {stats['prefill_seconds']:.2f} s ({stats['prompt_tokens']} tokens), "
            f"load {stats['load_seconds']:.2f} s, {output.finish_reason}"
            + (
                f", {llm.method}: mean acceptance length {stats['mean_accept_length']:.2f} "
                f"over {stats['rounds']} rounds]"
                if output.stats.rounds
                else "]"
            ),
            file=sys.stderr,
        )
    return 0


def _method_and_draft(model: str, method: str | None, draft: str | None) -> tuple[str, str | None]:
    """`--method eagle3` without --draft drafts with the EAGLE-3 head shipped for the model
    (heads/). With neither flag decoding stays plain: the shipped SmolLM2 head accepts 1.2-1.9
    tokens per forward, which on a 2-core CPU runs at about half plain decoding's speed
    (BENCHMARKS.md), so drafting is not the default until a head measurably pays."""
    if draft == "none":
        return method or "none", None
    if draft is None and method == "eagle3":
        head = packaged_head(model)
        if head is not None:
            return "eagle3", str(head)
    return method or ("eagle3" if draft else "none"), draft


def _tree(text: str | None) -> TreeConfig | None:
    if text is None:
        return None
    values = int_list(text, "--tree")
    if len(values) != 3:
        raise InvalidRequestError(f"--tree takes DEPTH,TOPK,NODES, got '{text}'")
    return TreeConfig(depth=values[0], top_k=values[1], num_nodes=values[2])


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
        "pull": cmd_pull,
        "train": cmd_train,
        "export": cmd_export,
        "bench": cmd_bench,
    }
    try:
        return commands[args.command](args)
    except EaglespecError as e:
        print(f"eaglespec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
