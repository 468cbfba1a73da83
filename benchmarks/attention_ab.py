"""The attention kernel of a git revision against the working tree's, interleaved in one process:
csrc/attention.cpp as it was at --rev is built under another op namespace beside today's, both
run the same decode-like shapes (T causal query rows over K cached keys, as a verification or a
prefill chunk attends), and every output is checked bitwise equal before it is timed.

    python benchmarks/attention_ab.py --rev e7f3526~1 [--threads 2] [--repeats 40] \\
        [--shapes decode|prefill|all]

Prints microseconds per call, medians, old / new / new over old. Needs AVX2 or AVX-512 and a C++
compiler (the kernel's own needs).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from eaglespec.model import cpu_attention
from eaglespec.model.extension import CFLAGS, CSRC

DECODE = [(K, T) for K in (128, 512, 1024, 2048) for T in (1, 2, 3, 4, 8)]
PREFILL = [(0, 256), (256, 256), (0, 1024)]


def _load_old(rev: str) -> None:
    """Build csrc at `rev` with the attention namespace renamed (so both register)."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    rel = CSRC.relative_to(root)
    folder = Path(tempfile.mkdtemp(prefix="attention_ab_"))
    names = subprocess.check_output(["git", "ls-tree", "--name-only", f"{rev}:{rel}"], text=True)
    for name in names.split():
        if name != "attention.cpp" and not name.endswith(".h"):
            continue  # the source and whatever headers it may include
        text = subprocess.check_output(["git", "show", f"{rev}:{rel}/{name}"], text=True)
        (folder / name).write_text(text.replace("eaglespec_attention", "eaglespec_attention_ab"))
    cpp_extension.load(
        name=f"attention_ab_{rev.replace('~', '_').replace('^', '_')}",
        sources=[str(folder / "attention.cpp")],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="the git revision whose kernel is 'old'")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--shapes", choices=("decode", "prefill", "all"), default="all")
    ap.add_argument("--heads", default="9,3", help="query heads, KV heads (SmolLM2: 9,3)")
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()
    if cpu_attention.available() is not None:
        raise SystemExit(f"the kernel does not run here: {cpu_attention.available()}")
    _load_old(args.rev)
    old = torch.ops.eaglespec_attention_ab.attend
    new = torch.ops.eaglespec_attention.attend
    torch.set_num_threads(args.threads)
    H, Hkv = (int(x) for x in args.heads.split(","))
    D = args.head_dim
    shapes = {"decode": DECODE, "prefill": PREFILL, "all": DECODE + PREFILL}[args.shapes]
    print(f"threads {args.threads}, heads {H}/{Hkv} of {D}, bf16; us per call, medians")
    print("| cached keys | rows | old | new | new / old |\n|---|---|---|---|---|")
    torch.manual_seed(0)
    for K, T in shapes:
        q = torch.randn(1, H, T, D, dtype=torch.bfloat16)
        k = torch.randn(1, Hkv, K + T, D, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.ones(1, 1, T, K + T, dtype=torch.bool).tril(K)  # row t: keys 0 .. K + t
        call = (q, k, v, mask, D**-0.5)
        if not torch.equal(old(*call), new(*call)):
            raise SystemExit(f"outputs differ at K={K}, T={T}")
        a, b = [], []
        for _ in range(max(3, args.repeats // (1 + T // 64))):
            t0 = time.perf_counter()
            old(*call)
            t1 = time.perf_counter()
            new(*call)
            t2 = time.perf_counter()
            a.append(t1 - t0)
            b.append(t2 - t1)
        ma, mb = statistics.median(a) * 1e6, statistics.median(b) * 1e6
        print(f"| {K} | {T} | {ma:.1f} | {mb:.1f} | {mb / ma:.2f} |", flush=True)


if __name__ == "__main__":
    main()
