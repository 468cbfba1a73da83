"""Attention onto a KV cache on CPU: SDPA's kernel, the spelled-out `attend_math` and eaglespec's
own kernel (`cpu_attention`, where it builds), per dtype, for decode-like shapes (few queries per
row over a cached prefix). layers.attend picks between them from these numbers.

    python benchmarks/attention_cpu.py [--threads 2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from eaglespec.model import cpu_attention
from eaglespec.model.layers import attend_math

SHAPES = [(1, 100, 1), (1, 300, 1), (1, 1000, 1), (64, 301, 1), (1, 300, 5), (8, 300, 5)]


def _ms(fn: Callable[..., torch.Tensor], args: tuple[object, ...], repeats: int) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--heads", default="9,3", help="query heads, KV heads (SmolLM2: 9,3)")
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    H, Hkv = (int(x) for x in args.heads.split(","))
    print(f"threads {args.threads}, heads {H}/{Hkv}, head dim {args.head_dim}, medians in ms")
    kernel = cpu_attention.available() is None
    print("| dtype | rows | keys | queries | SDPA | attend_math | kernel |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for B, K, T in SHAPES:
            q = torch.randn(B, H, T, args.head_dim, dtype=dtype)
            k = torch.randn(B, Hkv, K, args.head_dim, dtype=dtype)
            v = torch.randn_like(k)
            mask = torch.ones(B, 1, T, K, dtype=torch.bool)
            sdpa = _ms(_sdpa, (q, k, v, mask), args.repeats)
            math = _ms(attend_math, (q, k, v, mask), args.repeats)
            own = "-"
            if kernel:
                own = f"{_ms(cpu_attention.attend, (q, k, v, mask), args.repeats):.3f}"
            name = str(dtype).removeprefix("torch.")
            print(f"| {name} | {B} | {K} | {T} | {sdpa:.3f} | {math:.3f} | {own} |")


if __name__ == "__main__":
    main()
