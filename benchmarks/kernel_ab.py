"""Two versions of the w4a8 kernels (csrc/w4a8.cpp) in one process, interleaved pass by pass:
what a kernel change buys, measured where the VM's drift falls on both alike.

    python benchmarks/kernel_ab.py --a f3f7105 --b HEAD [--shapes smollm2-135m]
                                   [--rows 1 2 4 8 32] [--repeats 9]

--a / --b: a git revision (the file as committed there) or a path to a .cpp file. Each source is
compiled with its torch.library namespace renamed (kernel_ab_a, kernel_ab_b), so both load
beside each other and beside the engine's own. Every case is first checked bitwise (the same
outputs from both for every M: a kernel change must not move a bit), then timed: the pass over
one copy per layer of the shape set's four 4-bit decoder matrices (random codes, as
benchmarks/roofline.py builds them: together they exceed the private caches, as a decode step's
do) and two copies of the 8-bit output head used in turn. Medians over --repeats after one
warm-up round; prints ms per pass and B's time over A's.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from roofline import SHAPES, random_w4a8, random_w8a8

from eaglespec.model import w4a8
from eaglespec.model.extension import CSRC, compile_and_load

SOURCE = CSRC / "w4a8.cpp"


def source_text(ref: str, name: str = SOURCE.name) -> str:
    """`name` (the kernel's source, or a header beside it) at a git revision, or, where `ref` is
    a .cpp file, that file itself and the headers beside it (else the working tree's)."""
    if Path(ref).is_file():
        path = Path(ref) if name == SOURCE.name else Path(ref).parent / name
        return (path if path.is_file() else SOURCE.parent / name).read_text()
    rel = (SOURCE.parent / name).relative_to(Path(__file__).resolve().parent.parent)
    return subprocess.run(
        ["git", "show", f"{ref}:{rel}"], check=True, capture_output=True, text=True
    ).stdout


def load(ref: str, label: str, folder: Path) -> object:
    """Compile the source, with the headers it includes, under the namespace kernel_ab_<label>;
    its ops."""
    namespace = f"kernel_ab_{label}"
    here = folder / label
    here.mkdir()
    for header in sorted(SOURCE.parent.glob("*.h")):
        (here / header.name).write_text(source_text(ref, header.name))
    text = source_text(ref).replace("eaglespec_w4a8", namespace)
    path = here / f"{namespace}.cpp"
    path.write_text(text)
    compile_and_load(path, namespace)
    return getattr(torch.ops, namespace)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--a", required=True, help="git revision or .cpp file (the baseline)")
    ap.add_argument("--b", required=True, help="git revision or .cpp file (the change)")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    w4a8.require()
    with tempfile.TemporaryDirectory() as tmp:
        ops = {"a": load(args.a, "a", Path(tmp)), "b": load(args.b, "b", Path(tmp))}
    layers, shapes, (head_n, head_k) = SHAPES[args.shapes]
    decoder = [[random_w4a8(n, k) for n, k in shapes] for _ in range(layers)]
    heads = [random_w8a8(head_n, head_k) for _ in range(2)]
    times: dict[tuple[int, str, str], list[float]] = {}
    with torch.inference_mode():
        for m in args.rows:  # the same bits from both, every matrix shape and the head
            for n, k in shapes:
                x = torch.randn(m, k).bfloat16()
                lin = decoder[0][shapes.index((n, k))]
                got = [ops[v].linear(x, lin.weight, n) for v in "ab"]  # type: ignore[attr-defined]
                assert torch.equal(got[0], got[1]), f"4-bit outputs differ at M = {m}, {n} x {k}"
            x = torch.randn(m, head_k).bfloat16()
            got = [ops[v].linear8(x, heads[0].weight, head_n) for v in "ab"]  # type: ignore[attr-defined]
            assert torch.equal(got[0], got[1]), f"8-bit outputs differ at M = {m}"
        for rep in range(args.repeats + 1):
            for m in args.rows:
                xs = {k: torch.randn(m, k).bfloat16() for _, k in shapes}
                xh = torch.randn(m, head_k).bfloat16()
                for v, op in ops.items():
                    start = time.perf_counter()
                    for row in decoder:
                        for lin, (n, k) in zip(row, shapes, strict=True):
                            op.linear(xs[k], lin.weight, n)  # type: ignore[attr-defined]
                    mid = time.perf_counter()
                    for lin in heads:
                        op.linear8(xh, lin.weight, head_n)  # type: ignore[attr-defined]
                    end = time.perf_counter()
                    if rep:  # the first round warms up
                        times.setdefault((m, "decoder", v), []).append(mid - start)
                        times.setdefault((m, "head", v), []).append((end - mid) / len(heads))
    print(f"{args.shapes}, {torch.get_num_threads()} threads, A = {args.a}, B = {args.b}")
    print("| rows M | decoder pass A ms | B ms | B / A | 8-bit head A ms | B ms | B / A |")
    print("|---|---|---|---|---|---|---|")
    for m in args.rows:
        cells = []
        for part in ("decoder", "head"):
            a, b = (statistics.median(times[(m, part, v)]) for v in "ab")
            cells += [f"{a * 1e3:.3f}", f"{b * 1e3:.3f}", f"{b / a:.3f}"]
        print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
