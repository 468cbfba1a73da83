"""How closely int4 reproduces a model's decoder weights: min-max over 15 steps against
per-group spans (model/quant.py: code_spans), per GGUF tensor type.

    python benchmarks/int4_fidelity.py [--model qwen2.5-coder-1.5b] [--dtype float32]

For every decoder linear layer the loaded weight w (the file's weights, dequantized) is quantized
both ways and dequantized again; reported: the relative Frobenius error ||deq - w|| / ||w|| over
all layers, and the share of weights reproduced to within bf16 rounding (2^-8 relative).
"""

from __future__ import annotations

import argparse

from torch import nn

from eaglespec.model.loader import load_model
from eaglespec.model.quant import Int4Linear
from eaglespec.registry import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    model = load_model(resolve_model(args.model), dtype=args.dtype).model
    sums = {False: [0.0, 0.0, 0], True: [0.0, 0.0, 0]}  # fit_spans -> [err^2, w^2, close]
    count = 0
    for name, mod in model.named_modules():
        if not (isinstance(mod, nn.Linear) and name.startswith("layers.")):
            continue
        w = mod.weight.detach().float()
        count += w.numel()
        for fit in sums:
            err = Int4Linear.from_linear(mod, fit_spans=fit).dequantize() - w
            acc = sums[fit]
            acc[0] += float(err.square().sum())
            acc[1] += float(w.square().sum())
            acc[2] += int((err.abs() <= 2**-8 * w.abs() + 1e-6).sum())
    print(f"{args.model} ({args.dtype}), {count:,} decoder weights")
    print("| int4 | relative error | weights within bf16 rounding |\n|---|---|---|")
    for fit, (e2, w2, close) in sums.items():
        label = "per-group spans" if fit else "min-max over 15 steps"
        print(f"| {label} | {(e2 / w2) ** 0.5:.4f} | {close / count:.1%} |")


if __name__ == "__main__":
    main()
