"""`eaglespec bench`: the command line of the benchmark harness."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from eaglespec.bench.aggregate import BenchSummary, summarize
from eaglespec.bench.environment import EngineSettings, describe_model, environment
from eaglespec.bench.lineup import (
    METHOD_NAMES,
    DraftSources,
    Method,
    build_methods,
    check_methods,
    default_methods,
)
from eaglespec.bench.llamacpp import LLAMA_CPP, LlamaCppMethod, check_gguf
from eaglespec.bench.memory import memory_meter
from eaglespec.bench.questions import GROUPINGS, Question, read_all
from eaglespec.bench.report import render_report, summary_table
from eaglespec.bench.results import results_dict, write_results
from eaglespec.bench.runner import Generation, QuestionDone, RunSettings, run_benchmark
from eaglespec.cliargs import add_model_args, tree_config
from eaglespec.draft.proposer import check_min_prob
from eaglespec.errors import InvalidRequestError
from eaglespec.heads import packaged_head
from eaglespec.methods import DEFAULT_DRAFT_MIN_PROB, DEFAULT_LOOKUP_TOKENS
from eaglespec.model.llama import check_compile_mode
from eaglespec.model.loader import check_quant, dtype_name, load_model
from eaglespec.registry import resolve_model


def add_bench_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "bench",
        help="benchmark speculative decoding methods against plain decoding",
        description="Runs FastChat-format questions (question_id, category, turns) at batch 1 "
        "with plain decoding and each method on one loaded target, methods interleaved per "
        "question after a warm-up, and writes OUT/results.json, OUT/report.md and PNG plots: "
        "tokens/s, speedup, acceptance, time per round, peak memory, and whether greedy "
        "outputs equal plain decoding's.",
    )
    p.add_argument("--questions", nargs="+", required=True, metavar="FILE", help="FastChat JSONL")
    add_model_args(p)  # --model, --dtype, --device, --quant, --compile, --threads
    p.add_argument(
        "--methods",
        nargs="+",
        choices=METHOD_NAMES,
        help="default: every method that can run (eagle3-* when a head ships for the model or "
        "--draft is given, draft-model with --draft-model); plain always runs as the baseline. "
        "llama.cpp (opt-in, needs llama-cpp-python and a GGUF model): llama.cpp's own plain "
        "decoding of the same file, as a reference",
    )
    p.add_argument("--draft", help="EAGLE-3 head folder or 'random'; default: the shipped head")
    p.add_argument("--draft-model", help="draft-model method's drafter, e.g. qwen2.5-coder-0.5b")
    p.add_argument("--limit", type=int, help="first K questions of each file")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens per turn at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (checks lossless)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--group-by", choices=GROUPINGS, default="category", help="table rows")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    p.add_argument("--num-draft", "--draft-tokens", dest="num_draft", type=int, default=4)
    p.add_argument(
        "--tree",
        metavar="DEPTH,TOPK,NODES",
        help="eagle3-tree's shape (default 4,4,16); with --calibrate, a tree arm to measure too",
    )
    p.add_argument(
        "--lookup-tokens",
        type=int,
        default=DEFAULT_LOOKUP_TOKENS,
        help="prompt-lookup tokens the eagle3-*+lookup methods graft into a round at most; "
        "with --calibrate, what the calibrated commands graft (their default: "
        f"{DEFAULT_LOOKUP_TOKENS}; 0 for none)",
    )
    p.add_argument(
        "--draft-min-prob",
        type=float,
        metavar="P",
        help="stop the EAGLE-3 head's chains where the product of its probabilities of their "
        "drafts falls below P. Default: none for eagle3-chain(+lookup), fixed chains of "
        f"--num-draft; {DEFAULT_DRAFT_MIN_PROB} for eagle3-adaptive and --calibrate, as the "
        "commands run",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="instead of benchmarking: measure each draft length (and --tree) on the questions' "
        "first turns and store the result for this model and machine; `generate`, `chat` and "
        "`serve` with adaptive speculation start from it (docs/calibration.md)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


DEFAULT_TREE = "4,4,16"


def _calibrate(args: argparse.Namespace, questions: list[Question]) -> int:
    """`--calibrate`: the adaptive policy's arms measured on the first turns, then stored."""
    from eaglespec.calibration import arm_name, calibrate, calibration_key, save_calibration
    from eaglespec.llm import LLM

    head = args.draft or packaged_head(args.model)
    if head is None:
        raise InvalidRequestError(f"no EAGLE-3 head ships for {args.model}; pass --draft HEAD")
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        quant=args.quant,
        compile=args.compile,
        progress=not args.quiet,
        method="eagle3",
        draft=str(head),
        num_draft=args.num_draft,
        tree=tree_config(args.tree, "--tree") if args.tree else None,
        speculation="adaptive",
        lookup_tokens=args.lookup_tokens,
        draft_min_prob=args.draft_min_prob,
    )
    prompts = [llm.encode(q.turns[0]) for q in questions]
    if not args.quiet:
        print(f"calibrating on {len(prompts)} prompts x {args.max_tokens} tokens", file=sys.stderr)
    policy, arms = calibrate(llm, prompts, args.max_tokens)
    path = save_calibration(calibration_key(llm), policy, "calibrate")
    print("| draft | rounds | ms per round | tokens per round | tokens/s |")
    print("|---|---|---|---|---|")
    for a in arms:
        print(
            f"| {a.choice} | {a.rounds} | {a.seconds_per_round * 1e3:.1f} | "
            f"{a.tokens_per_round:.2f} | {a.tokens_per_second:.1f} |"
        )
    best = policy.best(1)
    print(f"best at batch 1: {arm_name(best, policy) if best else '-'}; stored in {path}")
    return 0


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces `args`, every option spelled out."""
    parts = ["eaglespec", "bench", "--questions", *args.questions, "--model", args.model]
    parts += ["--methods", *args.methods] if args.methods else []
    for flag in ("draft", "draft_model", "limit", "threads", "tree", "draft_min_prob"):
        value = getattr(args, flag)
        parts += [f"--{flag.replace('_', '-')}", str(value)] if value is not None else []
    settings = (
        "max_tokens",
        "temperature",
        "seed",
        "group_by",
        "out",
        "num_draft",
        "lookup_tokens",
    )
    for flag in settings:
        parts += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for flag in ("dtype", "device", "quant", "compile"):
        parts += [f"--{flag}", str(getattr(args, flag))]
    return shlex.join(parts + (["--quiet"] if args.quiet else []))


def cmd_bench(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    # Every argument is checked before the (slow) loads.
    dtype_name(args.dtype)
    check_quant(args.quant)
    check_compile_mode(args.compile)
    tree = tree_config(args.tree or DEFAULT_TREE, "--tree")
    if args.num_draft < 1:
        raise InvalidRequestError(f"--num-draft must be >= 1, got {args.num_draft}")
    if args.draft_min_prob is not None:
        check_min_prob(args.draft_min_prob)
    if args.lookup_tokens < 0:
        raise InvalidRequestError(f"--lookup-tokens must be >= 0, got {args.lookup_tokens}")
    if args.lookup_tokens == 0 and any(m.endswith("+lookup") for m in args.methods or ()):
        raise InvalidRequestError("the eagle3-*+lookup methods need --lookup-tokens >= 1")
    questions = read_all(args.questions, args.limit)
    if args.calibrate:
        return _calibrate(args, questions)
    head = args.draft or packaged_head(args.model)
    drafts = DraftSources(eagle3=str(head) if head else None, draft_model=args.draft_model)
    names = check_methods(
        args.methods or default_methods(drafts),
        drafts,
        temperature=args.temperature,
        device=args.device,
    )
    settings = RunSettings(args.max_tokens, args.temperature, args.seed)
    settings.params()  # validates max_tokens and temperature
    path = resolve_model(args.model, progress=not args.quiet)
    if LLAMA_CPP in names:
        check_gguf(path)
    args.out.mkdir(parents=True, exist_ok=True)  # fail now, not after the run, if it cannot be

    target = load_model(
        path,
        dtype=args.dtype,
        device=args.device,
        quant=args.quant,
    )
    target.model.compile_steps(args.compile)
    precision = target.precision  # "auto" resolved
    methods = build_methods(
        names,
        target,
        drafts,
        num_draft=args.num_draft,
        tree=tree,
        quant=precision.quant,
        compile=args.compile,
        progress=not args.quiet,
        lookup_tokens=args.lookup_tokens,
        min_prob=args.draft_min_prob,
    )
    meter = memory_meter(target.model.device)
    log = _progress(questions) if not args.quiet else None
    generations = run_benchmark(target, methods, questions, settings, meter, log)
    summary = summarize(
        generations, questions, names, group_by=args.group_by, greedy=settings.temperature == 0
    )
    env = environment(
        EngineSettings(args.device, precision.dtype, precision.quant, args.compile),
        describe_model(target.path),
        _describe_drafts(methods, drafts),
    )
    for m in methods:
        if isinstance(m, LlamaCppMethod):
            env["llama_cpp"] = m.environment()
    _write(args, methods, summary, questions, generations, env, meter.scope)
    print(summary_table(summary.overall))
    print(f"written: {args.out / 'results.json'}, {args.out / 'report.md'}", file=sys.stderr)
    return 0


def _write(
    args: argparse.Namespace,
    methods: list[Method],
    summary: BenchSummary,
    questions: list[Question],
    generations: list[Generation],
    env: dict[str, Any],
    memory_scope: str,
) -> None:
    out: Path = args.out
    command = command_line(args)
    settings = {
        "questions": [str(p) for p in args.questions],
        "limit": args.limit,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "num_draft": args.num_draft,
        "draft_min_prob": args.draft_min_prob,
        "tree": args.tree or DEFAULT_TREE,
        "memory_scope": memory_scope,
    }
    data = results_dict(
        command=command,
        settings=settings,
        environment=env,
        methods=methods,
        summary=summary,
        questions=questions,
        generations=generations,
    )
    write_results(out / "results.json", data)
    from eaglespec.bench.plots import write_plots  # matplotlib only for the command that plots

    n = len(questions)
    subtitle = f"{target_name(env)}, {env['device']} {env['dtype']}, {n} question{'s' * (n != 1)}"
    plots = write_plots(out, summary, subtitle)
    report = render_report(
        summary,
        command=command,
        settings=settings,
        environment=env,
        descriptions={m.name: m.description for m in methods},
        memory_scope=memory_scope,
        plots=plots,
    )
    (out / "report.md").write_text(report, encoding="utf-8")


def target_name(env: dict[str, Any]) -> str:
    return Path(env["model"]["path"]).name


def _describe_drafts(methods: list[Method], drafts: DraftSources) -> dict[str, Any]:
    """Path and hashes of each draft a method used ('random' heads have no file)."""
    used = {m.name for m in methods}
    out: dict[str, Any] = {}
    if drafts.eagle3 and any(name.startswith("eagle3") for name in used):
        random = drafts.eagle3 == "random"
        out["eagle3"] = (
            {"path": "random", "sha256": None} if random else describe_model(Path(drafts.eagle3))
        )
    if drafts.draft_model and "draft-model" in used:
        out["draft-model"] = describe_model(resolve_model(drafts.draft_model, progress=False))
    return out


def _progress(questions: list[Question]) -> QuestionDone:
    """A line per question on stderr: each method's tokens/s on it."""

    def log(index: int, gens: list[Generation]) -> None:
        q = questions[index]
        parts = []
        for method in dict.fromkeys(g.method for g in gens):
            stats = [g.output.stats for g in gens if g.method == method]
            tokens = sum(s.new_tokens for s in stats)
            seconds = sum(s.prefill_seconds + s.decode_seconds for s in stats)
            parts.append(f"{method} {tokens / seconds if seconds else 0:.1f}")
        print(
            f"[{index + 1}/{len(questions)}] {q.source} {q.question_id} ({q.category}): "
            f"tok/s {', '.join(parts)}",
            file=sys.stderr,
            flush=True,
        )

    return log
