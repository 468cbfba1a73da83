"""What the fused ops' argument checks cost: every kept value looked up every forward (the rule
before session 46) against the rule now (parameters, packed weights and submodules only after
nn.Module's registration hooks fired; model/cpu_layer.py's Checks), in one process, alternated.

    python benchmarks/checks_ab.py [--model smollm2-135m] [--tokens 128] [--repeats 5]

Plain decoding and the chain of one with prompt lookup (the shipped head, 4 lookup tokens) over
three prompts, greedy, prefill included; per repeat each rule runs both, and every output must
equal the first (plain greedy's). Prints tokens/s per rule and the median of the per-repeat
ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

from eaglespec import LLM, SamplingParams
from eaglespec.heads import packaged_head
from eaglespec.model import cpu_layer

PROMPTS = [
    "Write a short story about a robot who learns to paint. Make it vivid.",
    "Explain how a hash map works, with a Python example.",
    "Summarise the causes of the French Revolution in five bullet points.",
]


def every_forward(self: cpu_layer.Checks) -> bool:
    """The rule before: every kept value looked up again, whatever the epoch."""
    return cpu_layer._found(*self.hooked) and cpu_layer._found(self.wheres, self.names, self.values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    head = packaged_head(args.model)
    assert head is not None, f"no head ships for {args.model}"
    llms = {
        "plain": LLM(args.model, dtype="auto", quant="auto", draft="none", progress=False),
        "chain of 1 + lookup": LLM(
            args.model,
            dtype="auto",
            quant="auto",
            draft=str(head),
            num_draft=1,
            speculation="on",
            lookup_tokens=4,
            progress=False,
        ),
    }
    rules = {"every forward": every_forward, "epoch": cpu_layer.Checks.current}
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    prompts = [llms["plain"].encode(p) for p in PROMPTS]
    rates: dict[tuple[str, str], list[float]] = {(m, r): [] for m in llms for r in rules}
    first: dict[int, list[int]] = {}
    for rep in range(args.repeats + 1):  # the first is a warm-up
        for rule, current in rules.items():
            cpu_layer.Checks.current = current  # type: ignore[method-assign]
            for name, llm in llms.items():
                start, n = time.perf_counter(), 0
                for i, prompt in enumerate(prompts):
                    ids = [t for ev in llm.stream(prompt, params) for t in ev.token_ids]
                    assert first.setdefault(i, ids) == ids, f"{name} under {rule}: output differs"
                    n += len(ids)
                if rep:
                    rates[(name, rule)].append(n / (time.perf_counter() - start))
    cpu_layer.Checks.current = rules["epoch"]  # type: ignore[method-assign]
    print(f"{args.model}, default precision, {len(PROMPTS)} prompts x {args.tokens} tokens")
    print("| run | every forward tok/s | epoch tok/s | epoch / every forward (median of repeats) |")
    print("|---|---|---|---|")
    for name in llms:
        old, new = rates[(name, "every forward")], rates[(name, "epoch")]
        ratio = statistics.median(b / a for a, b in zip(old, new, strict=True))
        print(
            f"| {name} | {statistics.median(old):.1f} | {statistics.median(new):.1f} | "
            f"{ratio:.3f}x |"
        )


if __name__ == "__main__":
    main()
