"""The engine's round code at another revision against today's, in one process: engine.py and
draft/proposer.py taken from `--rev` (git show) and imported beside today's, the same target,
head and prompts, fixed chains, run alternately repeat by repeat so the machine's drift falls on
both alike. Plain decoding (generate.generate_stream) runs in the same rotation as the baseline.

    python benchmarks/engine_ab.py --rev REV [--chains 0 1] [--repeats 9] [--tokens 200]
                                   [--model smollm2-135m] [--lookup-tokens 0]

--lookup-tokens N grafts prompt lookup's continuations into both variants' rounds (today's
draft/hybrid.py around each revision's head proposer), as the commands do (N = 4 there).

The old modules run against today's other modules, so this measures changes confined to the
round's own code (orchestration, verification, catch-up), not kernels (benchmarks/kernel_ab.py).
Every run's tokens must equal plain greedy decoding's. Prints each variant's median wall time for
the prompts, its median speed against plain pair by pair, and new against old per chain.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

import eaglespec.engine as new_engine
from eaglespec import LLM, SamplingParams
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.generate import generate_stream
from eaglespec.methods import with_lookup
from eaglespec.policy import DraftChoice, FixedDraft
from eaglespec.requests import collect_outputs

PROMPTS = (
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash map works, with an example in Python.",
)


def module_at(rev: str, path: str, name: str, folder: Path) -> ModuleType:
    """`path` (relative to the repository) as it was at `rev`, imported as module `name`."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    file = folder / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rev", required=True, help="the revision to compare today's code with")
    ap.add_argument("--chains", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lookup-tokens", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old_engine = module_at(args.rev, "src/eaglespec/engine.py", "old_engine", Path(tmp))
        old_prop = module_at(args.rev, "src/eaglespec/draft/proposer.py", "old_proposer", Path(tmp))
    llm = LLM(args.model, speculation="on", num_draft=1, lookup_tokens=0, progress=False)
    new = llm.proposer
    assert isinstance(new, Eagle3Proposer), "the model's shipped head drafts here"
    old = old_prop.Eagle3Proposer(new.head, new.capture, new.min_prob)
    if args.lookup_tokens:
        new = with_lookup(new, "", args.lookup_tokens).proposer
        old = with_lookup(old, "", args.lookup_tokens).proposer
    prompts = [llm.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)

    def run(name: str) -> list[list[int]]:
        outs = []
        for p in prompts:
            if name == "plain":
                events = generate_stream(llm.model, llm.tokenizer, [p], [params])
            else:
                is_old = name.startswith("old")
                engine, proposer = (old_engine, old) if is_old else (new_engine, new)
                k = int(name.split()[-1])
                events = engine.generate_speculative(
                    llm.model, proposer, llm.tokenizer, [p], [params], num_draft=k,
                    policy=FixedDraft(DraftChoice(k)),
                )  # fmt: skip
            outs += [o.token_ids for o in collect_outputs(events)]
        return outs

    names = ["plain"] + [f"{v} chain {k}" for k in args.chains for v in ("old", "new")]
    seconds: dict[str, list[float]] = {n: [] for n in names}
    want = None
    for rep in range(args.repeats + 1):  # the first is a warm-up
        for name in names:
            start = time.perf_counter()
            got = run(name)
            wall = time.perf_counter() - start
            want = want or got
            assert got == want, f"{name}: output differs from plain greedy"
            if rep:
                seconds[name].append(wall)
    threads = torch.get_num_threads()
    print(f"{args.model}, {len(prompts)} prompts x {args.tokens} tokens, {threads} threads,")
    print(f"medians of {args.repeats}; every output equal to plain greedy decoding's")
    for name in names:
        ratios = zip(seconds["plain"], seconds[name], strict=True)
        pair = statistics.median(a / b for a, b in ratios)
        print(f"{name:12s} {statistics.median(seconds[name]):.3f} s  {pair:.3f}x plain")
    for k in args.chains:
        old_s, new_s = seconds[f"old chain {k}"], seconds[f"new chain {k}"]
        ratio = statistics.median(a / b for a, b in zip(old_s, new_s, strict=True))
        print(f"chain {k}: new {ratio:.3f}x old")


if __name__ == "__main__":
    main()
