"""Average two EAGLE-3 heads of one target into a third (a weight-space "soup"): a head and its
continuation trained on other data, to keep what each learned.

    python benchmarks/head_average.py HEAD_A HEAD_B --weight 0.5 --out SOUP [--vocab b|a]

Every weight is (1 - w) * A + w * B, computed in fp32 and stored in B's dtype. The draft
vocabularies may differ (a continuation trained with `--keep-vocab` holds A's tokens and more):
lm_head rows are matched by target token id. `--vocab b` (default) keeps B's vocabulary, and
B's own rows for tokens A lacks; `--vocab a` keeps A's, and needs B to hold all of A's tokens.
The config is the kept vocabulary's head's. The result is a head folder `eaglespec bench
--draft` loads (session 39: stage 17 and stage 23 averaged, BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglespec.errors import InvalidRequestError


def target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """(Vd,) target id of each draft token (EAGLE-3's d2t holds target id - draft id)."""
    return d2t + torch.arange(len(d2t))


def average(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], weight: float, vocab: str
) -> dict[str, torch.Tensor]:
    if a.keys() != b.keys():
        raise InvalidRequestError(f"the heads' tensors differ: {sorted(a.keys() ^ b.keys())}")
    keep, other = (b, a) if vocab == "b" else (a, b)
    w_keep = weight if vocab == "b" else 1 - weight  # the weight of the kept head's values
    where = {int(t): i for i, t in enumerate(target_ids(other["d2t"]))}
    kept_ids = target_ids(keep["d2t"])
    shared = [(i, where[int(t)]) for i, t in enumerate(kept_ids) if int(t) in where]
    if vocab == "a" and len(shared) < len(kept_ids):
        raise InvalidRequestError("--vocab a needs B to hold every token of A's vocabulary")
    out = {}
    for name, t in keep.items():
        if name in ("d2t", "t2d"):
            out[name] = t
            continue
        lm_head = name == "lm_head.weight"
        skip = 1 if lm_head else 0  # lm_head's rows are matched by token: only its width must agree
        if t.shape[skip:] != other[name].shape[skip:]:
            raise InvalidRequestError(f"{name}: {tuple(t.shape)} against {other[name].shape}")
        if lm_head:
            rows = t.float().clone()  # (Vd, C); unshared rows stay the kept head's
            ki = torch.tensor([i for i, _ in shared])
            oi = torch.tensor([j for _, j in shared])
            rows[ki] = w_keep * t.float()[ki] + (1 - w_keep) * other[name].float()[oi]
            out[name] = rows.to(b[name].dtype)
        else:
            out[name] = (w_keep * t.float() + (1 - w_keep) * other[name].float()).to(b[name].dtype)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("head_a", type=Path)
    ap.add_argument("head_b", type=Path)
    ap.add_argument("--weight", type=float, default=0.5, help="B's share, 0-1")
    ap.add_argument("--vocab", choices=("a", "b"), default="b")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    a = load_file(args.head_a / "model.safetensors")
    b = load_file(args.head_b / "model.safetensors")
    out = average(a, b, args.weight, args.vocab)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(out, args.out / "model.safetensors")
    src = args.head_b if args.vocab == "b" else args.head_a
    shutil.copy(src / "config.json", args.out / "config.json")
    print(f"{args.out}: {len(out['d2t'])} draft tokens, B's share {args.weight}")


if __name__ == "__main__":
    main()
