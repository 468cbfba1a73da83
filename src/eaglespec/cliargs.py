"""Command-line pieces the commands share: the model and speculation options (generate, serve,
bench), loading an `LLM` from them, and parsing of values that argparse's types do not cover,
with errors that name the flag (an `InvalidRequestError`, which the CLI prints as one line)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from eaglespec.config import TreeConfig
from eaglespec.errors import InvalidRequestError
from eaglespec.methods import (
    DEFAULT_DRAFT_MIN_PROB,
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_LOOKUP_TOKENS,
    METHODS,
)
from eaglespec.model.llama import COMPILE_MODES
from eaglespec.model.precision import AUTO
from eaglespec.model.quant import QUANT_MODES
from eaglespec.policy import SPECULATION_MODES
from eaglespec.registry import DEFAULT_MODEL

if TYPE_CHECKING:
    from eaglespec.llm import LLM


def int_list(text: str, flag: str) -> list[int]:
    """'2,15,27' -> [2, 15, 27]; anything else names `flag` and the text."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise InvalidRequestError(f"{flag} takes comma-separated integers, got '{text}'") from None


def thread_count(text: str) -> int:
    """--threads: a positive integer (argparse names the flag in its error)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer, got '{text}'") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"at least 1, got {n}")
    return n


def tree_config(text: str, flag: str) -> TreeConfig:
    """'4,4,16' -> TreeConfig(depth=4, top_k=4, num_nodes=16); anything else names `flag`."""
    values = int_list(text, flag)
    if len(values) != 3:
        raise InvalidRequestError(f"{flag} takes DEPTH,TOPK,NODES, got '{text}'")
    return TreeConfig(depth=values[0], top_k=values[1], num_nodes=values[2])


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="registry name, GGUF file or HF folder")
    p.add_argument(
        "--dtype",
        default=AUTO,
        help="auto (default: bfloat16 where --quant auto picks a 4-bit kernel, else float32), "
        "float32, bfloat16 or float16; float32 or float16 with --quant auto runs unquantized",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--quant",
        choices=(AUTO, *QUANT_MODES),
        default=AUTO,
        help="weight-only quantization of the linear layers (CPU only). auto (default): a GGUF "
        "stored at 4 bits runs as w4a8 on a CPU with AVX-512 VNNI (w4a8-all when its output "
        "head is 4-bit too; w4a8-mixed, each matrix at its stored width of 4 or 8 bits, when "
        "most are stored at 5-8 bits beside 4-bit ones), as llama.cpp runs it; anything else "
        "runs unquantized "
        "(model/precision.py). int8 stores int8 "
        "weights with per-channel scales; int4 stores 4-bit weights in groups of 32 (the output "
        "head stays int8; int4-all makes it int4 too, faster for large vocabularies such as "
        "Qwen's, less exact for small ones). These use bf16 activations in each matmul (the "
        "kernels' only fast input dtype); with --dtype float32 the inputs are cast to bf16 "
        "and back around each matmul, the rest of the model stays fp32. w4a8 / w4a8-all: the "
        "same 4-bit weights times activations quantized to int8 per group of 32, as llama.cpp "
        "does, in eaglespec's own kernel (x86 CPUs with AVX-512 VNNI; built on first use), "
        "the fastest CPU decode; none: the weights as loaded",
    )
    p.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default="none",
        help="torch.compile the decode and verify steps: block (each decoder block; compiles "
        "in seconds) or full (the whole step; fastest, but minutes of compiling per run: 5-15 "
        "for SmolLM2 and its head on 2 cores)",
    )
    p.add_argument("--threads", type=thread_count, help="CPU threads (default: torch's choice)")


def add_speculation_args(p: argparse.ArgumentParser, *, default_method: str = "none") -> None:
    """`default_method` names what runs with neither --method nor --draft (for the help)."""
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument(
        "--method",
        choices=METHODS,
        help="eagle3 (the default when --draft is given; alone, it uses the head shipped for "
        "the model), draft-model, lookup, or none (plain decoding). Default: " + default_method,
    )
    spec.add_argument(
        "--draft",
        help="eagle3: an EAGLE-3 checkpoint folder, or 'random' (a seeded random head: exact "
        "output, little acceptance); draft-model: a model name or path; 'none': plain decoding. "
        "With --method eagle3 and no --draft: the head shipped for the model (heads/)",
    )
    spec.add_argument(
        "--draft-tokens",
        type=int,
        default=DEFAULT_DRAFT_TOKENS,
        help="draft tokens per round (chain); under adaptive speculation the most it drafts",
    )
    spec.add_argument(
        "--draft-min-prob",
        type=float,
        metavar="P",
        help="eagle3: stop a round's chain where the product of the head's own probabilities "
        "of its drafts falls below P (none drafted if the first is below: a plain step), so "
        "verification goes where the head is sure; 0: every chain runs to its length. "
        f"Default: {DEFAULT_DRAFT_MIN_PROB} with eagle3",
    )
    spec.add_argument(
        "--tree",
        metavar="DEPTH,TOPK,NODES",
        help="draft an EAGLE-2 dynamic tree instead of a chain, e.g. 4,4,16 (eagle3 only)",
    )
    spec.add_argument(
        "--lookup-tokens",
        type=int,
        default=None,
        help="eagle3: also verify up to N prompt-lookup tokens each round where the context "
        "already holds what follows its last tokens (quoted text, repeated code), in the same "
        f"forward as the head's drafts; 0: off. Default: {DEFAULT_LOOKUP_TOKENS} with eagle3",
    )
    spec.add_argument(
        "--speculation",
        choices=SPECULATION_MODES,
        default="adaptive",
        help="adaptive (default): each round drafts the chain length (0 = none) or the tree "
        "that the measured round times and observed acceptance say is fastest, starting from "
        "the calibration stored for this model and machine if there is one; on: the "
        "configured chain or tree every round; off: plain decoding",
    )
    spec.add_argument(
        "--capture",
        metavar="B1,B2,B3",
        help="override the target layers the EAGLE-3 head reads (boundary indices)",
    )


def load_llm(args: argparse.Namespace, *, progress: bool) -> LLM:
    """The model and draft the shared options name (threads set first); what they leave unset
    is LLM's default, the commands' own (methods.resolve_method)."""
    import torch

    from eaglespec.llm import LLM  # torch-heavy imports only for commands that need them

    if args.threads:
        torch.set_num_threads(args.threads)
    return LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        quant=args.quant,
        compile=args.compile,
        progress=progress,
        method=args.method,
        draft=args.draft,
        num_draft=args.draft_tokens,
        tree=tree_config(args.tree, "--tree") if args.tree else None,
        capture=int_list(args.capture, "--capture") if args.capture else None,
        speculation=args.speculation,
        lookup_tokens=args.lookup_tokens,
        draft_min_prob=args.draft_min_prob,
    )


def precision_line(llm: LLM) -> str:
    """One line on the precision the model runs at, and why when the user left it to "auto"."""
    p = llm.loaded.precision
    why = f" (auto: {p.reason})" if p.reason else ""
    return f"[{llm.loaded.path.name}: {p.dtype}, quant {p.quant}{why}]"
