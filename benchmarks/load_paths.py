"""A model loaded at the commands' default precision two ways, in one process: its w4a8 layers
made from the GGUF's blocks as stored (loader.stored_layers, what load_model does) and by the
fitting path (every matrix dequantized to the model's dtype and its codes re-derived,
quant.py): the load's wall time, and how close each is to the fp32 model on one text.

    python benchmarks/load_paths.py [--model smollm2-135m] [--text README.md] [--tokens 384]
                                    [--repeats 1]

Closeness, over the text's positions: KL(fp32 || w4a8) of the next-token distributions, top-1
agreement with the fp32 model, and the NLL of the text (the fp32 model's beside it). Loads are
alternated blocks / fitted, --repeats times each; medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from eaglespec.model import loader
from eaglespec.registry import resolve_model


def _logits(lm: loader.LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """(T, V) fp32 logits of a prefill over ids (1, T)."""
    m = lm.model
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        out = m(ids, positions, m.new_cache(1, ids.shape[1]))
    return out.logits.float()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", type=Path, default=Path(__file__).parents[1] / "README.md")
    p.add_argument("--tokens", type=int, default=384)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    path = resolve_model(args.model)

    ref = loader.load_model(path, dtype="float32", quant="none")
    ids = torch.tensor([ref.tokenizer.encode(args.text.read_text())[: args.tokens]])
    ref_logp = _logits(ref, ids).log_softmax(-1)  # (T, V)
    del ref
    nll_ref = -ref_logp[:-1].gather(-1, ids[0, 1:, None]).mean()

    ways: dict[str, Callable[..., dict[str, list[str]]]] = {
        "blocks": loader.stored_layers,
        "fitted": lambda *a: {},
    }
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    logp: dict[str, torch.Tensor] = {}
    try:
        for _ in range(args.repeats):
            for way, stored in ways.items():
                loader.stored_layers = stored  # type: ignore[assignment]
                start = time.perf_counter()
                lm = loader.load_model(path, dtype="auto", quant="auto")
                seconds[way].append(time.perf_counter() - start)
                logp[way] = _logits(lm, ids).log_softmax(-1)
                precision = lm.precision.quant
                del lm
    finally:
        loader.stored_layers = ways["blocks"]  # type: ignore[assignment]

    print(f"{args.model} ({precision}), {ids.shape[1]} tokens of {args.text.name}")
    print(
        "| way | load s (median) | KL(fp32 || it) | top-1 agreement | NLL (fp32: "
        f"{float(nll_ref):.4f}) |"
    )
    print("|---|---|---|---|---|")
    for way in ways:
        lq = logp[way]
        kl = (ref_logp.exp() * (ref_logp - lq)).sum(-1).mean()
        agree = (ref_logp.argmax(-1) == lq.argmax(-1)).float().mean()
        nll = -lq[:-1].gather(-1, ids[0, 1:, None]).mean()
        print(
            f"| {way} | {statistics.median(seconds[way]):.2f} | {float(kl):.5f} | "
            f"{float(agree):.4f} | {float(nll):.4f} |"
        )


if __name__ == "__main__":
    main()
