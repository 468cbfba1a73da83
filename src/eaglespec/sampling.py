"""Logits -> next tokens, per row with each row's own parameters. Pure tensor code.

Dims: B batch rows, V vocabulary.
Order of processing as in transformers' `generate`: repetition penalty, temperature, top-k, top-p,
min-p. Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws exactly
from p without a cumulative sum or a host sync; each row draws its noise from its own
`torch.Generator` so seeded requests repeat bitwise whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eaglespec.config import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters on the device."""

    temperature: torch.Tensor  # (B,) fp32, 0 for greedy rows
    top_k: torch.Tensor  # (B,) int64, 0 = off
    top_p: torch.Tensor  # (B,) fp32, 1 = off
    min_p: torch.Tensor  # (B,) fp32, 0 = off
    repetition_penalty: torch.Tensor  # (B,) fp32, 1 = off
    all_greedy: bool  # host-side: skip the sampling path entirely
    any_greedy: bool  # host-side: some row is greedy (temperature 0)
    any_filter: bool  # host-side: some row uses top-k / top-p / min-p
    any_penalty: bool  # host-side: some row uses a repetition penalty

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu"
    ) -> SamplingTensors:
        def col(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=col([p.temperature for p in params]),
            top_k=col([p.top_k for p in params], torch.int64),
            top_p=col([p.top_p for p in params]),
            min_p=col([p.min_p for p in params]),
            repetition_penalty=col([p.repetition_penalty for p in params]),
            all_greedy=all(p.greedy for p in params),
            any_greedy=any(p.greedy for p in params),
            any_filter=any(p.top_k or p.top_p < 1 or p.min_p > 0 for p in params),
            any_penalty=any(p.repetition_penalty != 1 for p in params),
        )

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        """The parameters of a subset of rows (when finished rows leave the batch)."""
        return SamplingTensors(
            temperature=self.temperature[rows],
            top_k=self.top_k[rows],
            top_p=self.top_p[rows],
            min_p=self.min_p[rows],
            repetition_penalty=self.repetition_penalty[rows],
            all_greedy=self.all_greedy,
            any_greedy=self.any_greedy,
            any_filter=self.any_filter,
            any_penalty=self.any_penalty,
        )

    @classmethod
    def concat(cls, parts: Sequence[SamplingTensors]) -> SamplingTensors:
        """The rows of `parts` in order (new sequences joining a running batch)."""
        return cls(
            temperature=torch.cat([p.temperature for p in parts]),
            top_k=torch.cat([p.top_k for p in parts]),
            top_p=torch.cat([p.top_p for p in parts]),
            min_p=torch.cat([p.min_p for p in parts]),
            repetition_penalty=torch.cat([p.repetition_penalty for p in parts]),
            all_greedy=all(p.all_greedy for p in parts),
            any_greedy=any(p.any_greedy for p in parts),
            any_filter=any(p.any_filter for p in parts),
            any_penalty=any(p.any_penalty for p in parts),
        )


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...) int64: the index of each row's first maximum, as `argmax` gives it,
    through torch.max, which is 2-3x faster over a vocabulary on CPU (torch 2.13, 2 threads:
    (1, 49152) fp32 28 against 64 us, (32, 49152) 0.40 against 1.04 ms)."""
    return logits.max(-1).indices


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """logits (B, V); seen (B, V) bool, tokens already in the prompt or output; penalty (B,).
    Positive logits are divided by the penalty, negative ones multiplied (transformers' rule)."""
    pen = penalty[:, None]
    penalized = torch.where(logits > 0, logits / pen, logits * pen)
    return torch.where(seen, penalized, logits)


def probs_from_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits (B, V) fp32 -> probs (B, V) after temperature and the top-k / top-p / min-p filters.
    Greedy rows (temperature 0) get a one-hot at their argmax, so callers can treat rows alike."""
    greedy = st.temperature == 0
    temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    scaled = logits / temp[:, None]
    if st.any_filter:
        scaled = _filter(scaled, st)
    probs = torch.softmax(scaled, dim=-1)
    if not st.any_greedy:
        return probs
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def _filter(scaled: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Mask to -inf every token outside a row's top-k, top-p nucleus or min-p floor."""
    B, V = scaled.shape
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # (B, V)
    rank = torch.arange(V, device=scaled.device)[None, :]  # (1, V)
    k = torch.where(st.top_k > 0, st.top_k, torch.full_like(st.top_k, V))[:, None]
    drop = rank >= k
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Nucleus: keep a token while the mass strictly before it is < top_p (the first always stays).
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop |= mass_before >= st.top_p[:, None]
    drop |= sorted_probs < st.min_p[:, None] * sorted_probs[:, :1]
    drop[:, 0] = False
    mask = torch.empty_like(drop).scatter_(1, order, drop)
    return scaled.masked_fill(mask, float("-inf"))


class RowRandom:
    """Random draws for a batch: each row from its own generator, so a seeded request repeats
    bitwise whatever else is in the batch, or the whole batch from one shared generator (one call
    per draw, for large batches of identical requests such as distribution tests). None stands
    for torch's global generator."""

    def __init__(self, generators: Sequence[torch.Generator | None] | torch.Generator | None):
        self._per_row = not (generators is None or isinstance(generators, torch.Generator))
        self._generators = generators

    def uniform(self, batch: int, n: int, device: torch.device | str) -> torch.Tensor:
        """(B, n) i.i.d. U[0, 1)."""
        if not self._per_row:
            gen = self._generators
            assert gen is None or isinstance(gen, torch.Generator)
            return torch.rand(batch, n, device=device, generator=gen)
        gens = list(self._generators)  # type: ignore[arg-type]
        assert len(gens) == batch, f"{len(gens)} generators for {batch} rows"
        return torch.stack([torch.rand(n, device=device, generator=g) for g in gens])

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """probs (B, V) -> tokens (B,) int64 by the exponential race: argmax(p / E), E ~ Exp(1)
        i.i.d., picks token i with probability p_i (no cumulative sum, no host sync)."""
        noise = torch.empty_like(probs)
        if not self._per_row:
            gen = self._generators
            assert gen is None or isinstance(gen, torch.Generator)
            noise.exponential_(1.0, generator=gen)
        else:
            for row, g in enumerate(self._generators):  # type: ignore[arg-type]
                noise[row].exponential_(1.0, generator=g)
        return (probs / noise).argmax(-1)


def sample(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None], greedy: bool
) -> torch.Tensor:
    """probs (B, V) -> tokens (B,) int64. One generator per row (None = the global RNG)."""
    if greedy:
        return probs.argmax(-1)
    return RowRandom(generators).sample(probs)
