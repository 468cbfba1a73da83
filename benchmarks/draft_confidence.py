"""How well an EAGLE-3 head's own probability of its draft predicts that the target accepts it:
acceptance per draft position and probability bucket, over greedy chains of K on the evaluation
sets (every turn, as `eaglespec bench` runs them; the shipped head at the default precision, no
prompt lookup). With `--min-prob`, the speed of chains that stop where the head doubts them,
against fixed chains, in one process (methods interleaved per question).

    python benchmarks/draft_confidence.py --questions ../shared/data/eval/*.jsonl \\
        [--model smollm2-135m] [--limit 4] [--max-tokens 128] [--chain 4] \\
        [--min-prob 0.3 0.2 --fixed 1 2 --lookup-tokens 4]

Calibration: each round's drafts d_1 .. d_K with the head's softmax probability p_j of each
greedy pick, and how many the target accepted; draft j counts in its bucket where drafts 1 .. j-1
were accepted, and is accepted where the target took it too. The gated chains (`--min-prob P`,
chains of up to --chain drafts) keep draft j while the product p_1 .. p_j is at least P: a
doubtful round drafts fewer tokens (none at all where p_1 < P), a confident one runs to K: the
rule the engine runs since session 40 (Eagle3Proposer's min_prob, --draft-min-prob), measured
here first (BENCHMARKS.md, "Does the head know when it is right?").
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from collections.abc import Sequence

import torch

from eaglespec.bench.aggregate import summarize
from eaglespec.bench.lineup import PLAIN, BenchMethod, shipped_head
from eaglespec.bench.memory import memory_meter
from eaglespec.bench.questions import read_all
from eaglespec.bench.report import ab_table
from eaglespec.bench.runner import RunSettings, run_benchmark
from eaglespec.draft.base import Proposer
from eaglespec.draft.hybrid import HybridProposer
from eaglespec.draft.proposer import DraftState, Eagle3Proposer
from eaglespec.methods import with_lookup
from eaglespec.sampling import greedy_tokens

# probability buckets [lo, hi); the last one holds p = 1.0
BUCKETS = ((0.0, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, 0.9), (0.9, 1.0 + 1e-9))


class ConfidenceChains(Eagle3Proposer):
    """Greedy chains that record each draft's head probability (`probs`, one list a round) and
    each round's accepted drafts (`accepted`, from the catch-up's counts), batch 1; with
    `min_prob` > 0 a chain stops where the product of its picks' probabilities falls below it."""

    def __init__(self, base: Eagle3Proposer, min_prob: float = 0.0) -> None:
        super().__init__(base.head, base.capture)
        self.log_min = math.log(min_prob) if min_prob > 0 else -math.inf
        self.probs: list[list[float]] = []
        self.accepted: list[int] = []

    def propose(self, state: DraftState, k: int) -> torch.Tensor:
        self.flush(state)
        committed = list(state.cache.lengths)
        logits, hidden = state.logits, state.prenorm  # (1, Vd), (1, C)
        drafts: list[torch.Tensor] = []
        probs: list[float] = []
        path = 0.0
        while len(drafts) < k:
            if drafts:  # one head step on the last draft
                positions = torch.tensor(state.cache.lengths)[:, None]  # (1, 1)
                out = self.head(drafts[-1][:, None], hidden[:, None], positions, state.cache)
                state.cache.advance([1])
                logits, hidden = out.logits[:, -1], out.prenorm[:, -1]
            lp = logits.float().log_softmax(-1).max(-1).values  # (1,)
            p = float(lp[0])  # sync: the host decides the chain's length
            if path + p < self.log_min:
                break
            path += p
            probs.append(math.exp(p))
            drafts.append(self.head.to_target(greedy_tokens(logits)))  # (1,)
        state.cache.truncate(committed)
        self.probs.append(probs)
        if not drafts:
            return torch.empty(len(committed), 0, dtype=torch.long)
        return torch.stack(drafts, dim=1)  # (1, k')

    def catch_up(
        self,
        state: DraftState,
        tokens: torch.Tensor,
        aux: Sequence[torch.Tensor],
        counts: Sequence[int],
    ) -> DraftState:
        if len(self.accepted) < len(self.probs):  # a drafting round's catch-up: accepted + 1
            self.accepted.append(counts[0] - 1)
        return super().catch_up(state, tokens, aux, counts)


def calibration(rounds: list[tuple[list[float], int]], chain: int) -> list[str]:
    lines = ["| draft | " + " | ".join(f"p {a:.1f}-{b:.1f}" for a, b in BUCKETS) + " |"]
    lines.append("|---" * (len(BUCKETS) + 1) + "|")
    for j in range(chain):
        cells = []
        for lo, hi in BUCKETS:
            seen = [a > j for p, a in rounds if len(p) > j and a >= j and lo <= p[j] < hi]
            cells.append(f"{sum(seen) / len(seen):.2f} ({len(seen)})" if seen else "-")
        lines.append(f"| {j + 1} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", nargs="+", required=True)
    ap.add_argument("--model", default="smollm2-135m", help="a registry name with a shipped head")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--chain", type=int, default=4, help="drafts a round at most")
    ap.add_argument("--min-prob", type=float, nargs="*", default=[], help="gated chains to time")
    ap.add_argument("--fixed", type=int, nargs="*", default=[1], help="fixed chains to time")
    ap.add_argument("--lookup-tokens", type=int, default=0, help="for the timed chains")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, base = shipped_head(args.model)
    questions = read_all(args.questions, args.limit)
    settings = RunSettings(max_tokens=args.max_tokens, temperature=0.0, seed=0)
    meter = memory_meter(target.model.device)

    probe = ConfidenceChains(base)
    methods = [
        BenchMethod(PLAIN, None, 0, None, "plain decoding"),
        BenchMethod(f"chain of {args.chain}", probe, args.chain, None, "recorded"),
    ]

    def lookup(p: Eagle3Proposer) -> Proposer:
        return with_lookup(p, "", args.lookup_tokens).proposer

    gated = {tau: ConfidenceChains(base, tau) for tau in args.min_prob}
    for k in args.fixed:
        methods.append(BenchMethod(f"fixed chain of {k}", lookup(base), k, None, "fixed"))
    for tau, prop in gated.items():
        name = f"up to {args.chain}, path p >= {tau}"
        methods.append(BenchMethod(name, lookup(prop), args.chain, None, "gated"))
    gens = run_benchmark(target, methods, questions, settings, meter)
    rounds = list(zip(probe.probs, probe.accepted, strict=False))
    print(f"{args.model}: {len(rounds)} rounds of chains of {args.chain}, acceptance (rounds)")
    print("\n".join(calibration(rounds, args.chain)))
    stats = summarize(gens, questions, [m.name for m in methods], group_by="file", greedy=True)
    look = f", {args.lookup_tokens} lookup tokens grafted" if args.lookup_tokens else ""
    plain = stats.overall[PLAIN]
    print(f"\n{plain.generations} turns, plain {plain.tokens_per_second:.1f} tokens/s{look}")
    proposers = {m.name: m.proposer for m in methods}

    def spread(name: str) -> str:
        """Rounds per number of drafts, for the recorded and the gated chains."""
        prop = proposers[name]
        inner = prop.head if isinstance(prop, HybridProposer) else prop
        if not isinstance(inner, ConfidenceChains):
            return "-"
        lengths = Counter(len(p) for p in inner.probs)
        return " ".join(f"{n}:{c}" for n, c in sorted(lengths.items()))

    print(ab_table(stats.overall, ("drafts a round", spread)))


if __name__ == "__main__":
    main()
