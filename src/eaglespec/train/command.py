"""`eaglespec train`: the command line of the training pipeline (pipeline.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eaglespec.cliargs import int_list, thread_count
from eaglespec.errors import InvalidRequestError
from eaglespec.registry import DEFAULT_MODEL
from eaglespec.train.answering import BUDGET, MAX_ROWS
from eaglespec.train.pipeline import LM_HEADS, STAGES, PipelineConfig, run
from eaglespec.train.regen import RegenConfig
from eaglespec.train.synth import STARTER_MIXES, SynthConfig
from eaglespec.train.trainer import TrainConfig
from eaglespec.train.ttt import LOSSES


def add_train_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "train",
        help="train an EAGLE-3 head for a target (regenerate, capture, train, evaluate)",
        description="Regenerates the responses with the target, captures its features, trains "
        "an EAGLE-3 head with the training-time-test loss and writes it in the native "
        "LlamaForCausalLMEagle3 format to OUT; every stage is cached under OUT/work and resumed.",
    )
    p.add_argument("--target", default=DEFAULT_MODEL, help="registry name, GGUF file or HF folder")
    p.add_argument(
        "--data",
        nargs="+",
        required=True,
        metavar="FILE",
        help="FastChat questions, ShareGPT JSON, Alpaca/GSM8K JSONL or plain text",
    )
    p.add_argument("--out", required=True, type=Path, help="output folder (the head)")
    p.add_argument(
        "--variants",
        default="",
        metavar="NAME=SHARE,...",
        help="recast a share of the prompts, e.g. code=0.25 (see train/data.py)",
    )
    p.add_argument("--limit-per-file", type=int, help="first N conversations of each file")
    p.add_argument(
        "--skip-per-file",
        type=_count,
        default=0,
        metavar="N",
        help="skip the first N conversations of each file (a later stage takes other questions)",
    )
    p.add_argument(
        "--synth-prompts",
        type=_count,
        default=0,
        metavar="N",
        help="add N prompts the target writes itself (Magpie: sampled from an empty user turn)",
    )
    p.add_argument(
        "--synth-steer",
        choices=sorted(STARTER_MIXES),
        help="begin each self-asked prompt with a starter of this mix (train/synth.py): tasks "
        "(code, math, questions, writing, a text to summarise or rewrite, instructions) or code "
        "(writing, completing, explaining and fixing code in several languages) or general "
        "(short instructions, questions, writing and rewriting; a quarter code and math): "
        "nearer what users ask than the model's own turns",
    )
    p.add_argument(
        "--summaries",
        type=_count,
        default=0,
        metavar="N",
        help="add N 'Summarize: ...' prompts over the target's own longest answers",
    )
    p.add_argument(
        "--summary-min-tokens",
        type=int,
        default=150,
        metavar="N",
        help="only answers at least this long are summarized",
    )
    p.add_argument(
        "--summary-join",
        type=_positive,
        default=1,
        metavar="N",
        help="each text to summarise joins 1 to N of those answers as paragraphs (a seeded "
        "count): long texts like the articles users ask to have summarised; raise "
        "--max-prompt-tokens to match",
    )
    p.add_argument(
        "--completions",
        type=_count,
        default=0,
        metavar="N",
        help="add N 'Complete the code I provided.' prompts over the functions in the target's "
        "own answers, cut after signature and docstring",
    )
    p.add_argument(
        "--followups",
        type=_count,
        default=0,
        metavar="N",
        help="add N second turns the target writes itself after its own answers (change, "
        "extend or question the answer: a chat's follow-up), answered with the first answer "
        "in context",
    )
    p.add_argument(
        "--init-from",
        type=Path,
        metavar="HEAD",
        help="continue training this head: its weights (and lm_head rows of tokens still in the "
        "rebuilt draft vocabulary); its capture layers must match",
    )
    p.add_argument("--stop-after", choices=STAGES, default="eval")
    g = p.add_argument_group("regeneration")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--max-prompt-tokens", type=int, default=1024)
    g.add_argument("--regen-temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument(
        "--regen-max-samples",
        type=int,
        help="stop regenerating once this many responses exist (batches run in a seeded random "
        "order, so they are a sample of the whole mix)",
    )
    g.add_argument(
        "--regen-seconds",
        type=float,
        metavar="S",
        help="stop answering after S seconds; the prompts' answers may take the share of S that "
        "their turns are of all turns planned, the summaries, completions and follow-ups the "
        "rest; the answers so far are kept and a later run resumes from them",
    )
    g.add_argument(
        "--synth-seconds",
        type=float,
        metavar="S",
        help="stop writing self-asked prompts after S seconds; those written are kept",
    )
    g.add_argument(
        "--answer-rows",
        type=_positive,
        default=MAX_ROWS,
        metavar="N",
        help="rows decoded at once while writing prompts and answering (a GPU takes hundreds)",
    )
    g.add_argument(
        "--answer-tokens",
        type=_positive,
        default=BUDGET,
        metavar="N",
        help="rows x (prompt + new tokens) at most in that batch: bounds its KV cache",
    )
    g.add_argument(
        "--target-dtype",
        default="auto",
        help="target dtype for answering, capture and evaluation; auto = as the commands run it",
    )
    g.add_argument(
        "--target-quant",
        default="auto",
        help="target weights (none, int8, int4, w4a8, auto); auto = as the commands run it "
        "(a 4-bit GGUF as w4a8)",
    )
    g = p.add_argument_group("head")
    g.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size; 0 = full")
    g.add_argument(
        "--keep-vocab",
        action="store_true",
        help="with --init-from: keep the continued head's tokens (and their trained lm_head "
        "rows), then add this run's most frequent others up to --draft-vocab; by default the "
        "vocabulary is rebuilt from this run's data",
    )
    g.add_argument("--capture", metavar="B1,B2,B3", help="boundary ids; default 2,N//2,N-3")
    g.add_argument(
        "--head-intermediate",
        type=int,
        metavar="N",
        help="the head layer's MLP width (default: the target's)",
    )
    g.add_argument(
        "--lm-head",
        choices=LM_HEADS,
        default="trained",
        help="trained: the head's own output rows, starting from the target's; target: the "
        "target's rows of the draft vocabulary, frozen and not stored with the head (a head a "
        "fraction the size, e.g. for a large hidden size)",
    )
    g.add_argument("--save-dtype", default="bfloat16")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=10)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--warmup-steps", type=int, default=50)
    g.add_argument("--schedule", choices=("cosine", "linear"), default="cosine")
    g.add_argument("--batch-tokens", type=int, default=8192, help="padded positions per step")
    g.add_argument("--ttt-steps", type=int, default=7, help="unrolled draft steps")
    g.add_argument(
        "--ttt-decay",
        type=_step_decay,
        default=0.8,
        help="step j's loss weight decay^j (EAGLE-3's 0.8); lower puts the first draft first",
    )
    g.add_argument(
        "--loss",
        choices=LOSSES,
        default="ce",
        help="ce: soft cross-entropy against the target (EAGLE's); lk: LK's negative log "
        "acceptance, -log sum min(p, q); topk: ce plus ce over the target's 10 most likely "
        "tokens again (HASS) (train/ttt.py)",
    )
    g.add_argument(
        "--train-seconds",
        type=float,
        metavar="S",
        help="stop training after S seconds (the schedule is not shortened); the head as it is "
        "then is saved and evaluated",
    )
    g.add_argument("--grad-clip", type=float, default=0.5)
    g.add_argument(
        "--train-dtype",
        choices=("auto", "bfloat16", "float16", "float32"),
        default="auto",
        help="autocast dtype; float32 = none; auto = bfloat16 where the device has bf16 matmul "
        "kernels (a GPU, an AVX-512 or AMX CPU), else float32 (an AVX2 CPU, where bf16 runs "
        "many times slower)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="cpu", help="cpu or cuda (runs under torchrun too)")
    g.add_argument("--threads", type=thread_count, help="CPU threads")
    g = p.add_argument_group("held-out evaluation")
    g.add_argument("--heldout", type=float, default=0.02, help="share of conversations held out")
    g.add_argument("--eval-prompts", type=int, default=24)
    g.add_argument("--eval-max-tokens", type=int, default=128)
    g.add_argument("--eval-draft-tokens", type=int, default=4)


def _count(text: str) -> int:
    """A number of prompts to add: an integer, 0 or more (argparse names the flag on error)."""
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {n}")
    return n


def _step_decay(text: str) -> float:
    """A loss weight ratio between steps: a number in (0, 1] (argparse names the flag on error)."""
    x = float(text)
    if not 0.0 < x <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {x}")
    return x


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.keep_vocab and not args.init_from:
        raise InvalidRequestError("--keep-vocab keeps a continued head's tokens: pass --init-from")
    cfg = PipelineConfig(
        target=args.target,
        data=tuple(args.data),
        out=args.out,
        variants=_variants(args.variants),
        limit_per_file=args.limit_per_file,
        skip_per_file=args.skip_per_file,
        synth=SynthConfig(
            prompts=args.synth_prompts,
            seed=args.seed,
            starters=STARTER_MIXES[args.synth_steer] if args.synth_steer else (),
            batch=args.answer_rows,
            batch_tokens=args.answer_tokens,
            max_seconds=args.synth_seconds,
        ),
        summaries=args.summaries,
        summary_min_tokens=args.summary_min_tokens,
        summary_join=args.summary_join,
        completions=args.completions,
        followups=args.followups,
        init_from=args.init_from,
        regen=RegenConfig(
            max_prompt_tokens=args.max_prompt_tokens,
            max_new_tokens=args.max_new_tokens,
            temperature=args.regen_temperature,
            max_samples=args.regen_max_samples,
            max_seconds=args.regen_seconds,
            batch_tokens=args.answer_tokens,
            max_batch=args.answer_rows,
            seed=args.seed,
        ),
        draft_vocab=args.draft_vocab,
        keep_vocab=args.keep_vocab,
        head_intermediate=args.head_intermediate,
        lm_head=args.lm_head,
        capture=tuple(int_list(args.capture, "--capture")) if args.capture else None,
        target_dtype=args.target_dtype,
        target_quant=args.target_quant,
        device=args.device,
        heldout=args.heldout,
        eval_prompts=args.eval_prompts,
        eval_max_tokens=args.eval_max_tokens,
        eval_draft_tokens=args.eval_draft_tokens,
        save_dtype=args.save_dtype,
        stop_after=args.stop_after,
        train=TrainConfig(
            epochs=args.epochs,
            lr=args.lr,
            warmup_steps=args.warmup_steps,
            schedule=args.schedule,
            batch_tokens=args.batch_tokens,
            ttt_steps=args.ttt_steps,
            decay=args.ttt_decay,
            loss=args.loss,
            grad_clip=args.grad_clip,
            dtype=args.train_dtype,
            seed=args.seed,
            max_seconds=args.train_seconds,
        ),
    )
    run(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    return 0


def _variants(text: str) -> tuple[tuple[str, float], ...]:
    out = []
    for part in filter(None, text.split(",")):
        name, _, share = part.partition("=")
        try:
            out.append((name, float(share)))
        except ValueError:
            raise InvalidRequestError(f"--variants takes NAME=SHARE pairs, got '{part}'") from None
    return tuple(out)
