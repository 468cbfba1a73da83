"""Logits -> next tokens, per row with each row's own parameters. Pure tensor code.

Dims: B batch rows, V vocabulary.
Order of processing as in transformers' `generate`: repetition penalty, temperature, top-k, top-p,
min-p. Sampling draws one uniform per row and takes the first token whose cumulative probability
exceeds it (no host sync); each row draws from its own `torch.Generator` so seeded requests
repeat bitwise whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eaglespec.config import SamplingParams
from eaglespec.model import cpu_rowops


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
    """(..., V) -> (...) int64: the index of each row's first maximum, as `argmax` gives it:
    eaglespec's kernel for fp32 on the CPU (cpu_rowops.argmax, 6x faster), else torch.max, which
    is 2-3x faster than argmax over a vocabulary on CPU (torch 2.13, 2 threads: (1, 49152) fp32
    28 against 64 us, (32, 49152) 0.40 against 1.04 ms)."""
    if cpu_rowops.argmax_fits(logits):
        return cpu_rowops.argmax(logits)
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


# The top tokens the filters look at before sorting more of a row: tier by tier, then the whole row
CANDIDATES = (1024, 16384)


def _filter(scaled: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Mask to -inf every token outside a row's top-k, top-p nucleus or min-p floor."""
    return scaled.masked_fill(_filter_mask(scaled, st, CANDIDATES), -torch.inf)


def _filter_mask(scaled: torch.Tensor, st: SamplingTensors, tiers: tuple[int, ...]) -> torch.Tensor:
    """(B, V) logits -> (B, V) bool, True where the filters drop a token.

    The filters keep a prefix of a row sorted by probability. Usually it ends among the top
    tiers[0] tokens (a top-k within them, or a nucleus or min-p floor reached there), and only
    those are sorted: a full sort of 64 rows of a 49K vocabulary cost 136 ms a step on the 2-core
    CPU, three times the forward. The rows where it does not go on to the next tier (a flat row
    at a high temperature: the self-asked prompts' first tokens over Qwen's 152K vocabulary spent
    a fifth of prompt writing in whole-row sorts), and past the last are sorted whole."""
    B, V = scaled.shape
    k = torch.where(st.top_k > 0, st.top_k, torch.full_like(st.top_k, V))  # (B,)
    R = min(tiers[0], V) if tiers else V
    if R == V:
        return _sorted_mask(scaled, k, st)
    top, order = scaled.topk(R, dim=-1)  # (B, R) descending
    small_k = k <= R  # (B,) the top-k's own softmax is within the candidates
    lse = torch.where(small_k, _top_k_lse(top, k), scaled.logsumexp(-1))  # (B,)
    drop, p = _drop_sorted(top, k, lse, st)
    mask = torch.ones_like(scaled, dtype=torch.bool).scatter_(1, order, drop)  # (B, V)
    nucleus = (st.top_p < 1) & (p.sum(-1) >= st.top_p)  # (B,) reached among the candidates
    ends = small_k | nucleus | (p[:, -1] < st.min_p * p[:, 0])  # (B,)
    if not bool(ends.all()):  # sync: one per sampled step and tier, to find the rows that go on
        rows = (~ends).nonzero()[:, 0]  # sync
        mask[rows] = _filter_mask(scaled[rows], st.select(rows), tiers[1:])
    return mask


def _sorted_mask(scaled: torch.Tensor, k: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The filters' mask from whole sorted rows: (B, V) logits, (B,) top-k -> (B, V) bool."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # (B, V)
    drop, _ = _drop_sorted(sorted_logits, k, _top_k_lse(sorted_logits, k), st)
    return torch.empty_like(drop).scatter_(1, order, drop)


def _top_k_lse(sorted_logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(B, R) descending logits, (B,) top-k -> (B,) log-sum-exp of each row's first k."""
    rank = torch.arange(sorted_logits.shape[1], device=sorted_logits.device)[None, :]  # (1, R)
    return sorted_logits.masked_fill(rank >= k[:, None], -torch.inf).logsumexp(-1)


def _drop_sorted(
    sorted_logits: torch.Tensor,  # (B, R) a row's R most likely tokens' logits, descending
    k: torch.Tensor,  # (B,) top-k (V when off)
    lse: torch.Tensor,  # (B,) log of the softmax's normalizer (over the top-k when it is on)
    st: SamplingTensors,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, R) which of them the filters drop, and their probabilities (0 outside the top-k)."""
    rank = torch.arange(sorted_logits.shape[1], device=sorted_logits.device)[None, :]  # (1, R)
    drop = rank >= k[:, None]
    p = (sorted_logits - lse[:, None]).exp().masked_fill(drop, 0.0)  # (B, R)
    # Nucleus: keep a token while the mass strictly before it is < top_p (the first always stays).
    mass_before = p.cumsum(-1) - p  # may round up to 1 in a long tail: top_p = 1 is off
    drop |= (mass_before >= st.top_p[:, None]) & (st.top_p[:, None] < 1)
    drop |= p < st.min_p[:, None] * p[:, :1]
    drop[:, 0] = False
    return drop, p


class RowRandom:
    """Random draws for a batch: each row from its own generator, so a seeded request repeats
    bitwise whatever else is in the batch, or the whole batch from one shared generator (one call
    per draw, for large batches of identical requests such as distribution tests). None stands
    for torch's global generator.

    A seeded row draws one uniform per token it emits, whether the token comes from a plain step
    or from verifying drafts (`peek` the round's uniforms, `advance` past the ones used), and a
    token is drawn from its uniform the same way in both (`inverse_transform`): so a seeded
    request gives the same tokens whatever speculation ran (verify.py)."""

    def __init__(self, generators: Sequence[torch.Generator | None] | torch.Generator | None):
        self._per_row = not (generators is None or isinstance(generators, torch.Generator))
        self._generators = generators

    def uniform(self, batch: int, n: int, device: torch.device | str) -> torch.Tensor:
        """(B, n) i.i.d. U[0, 1)."""
        if not self._per_row:
            return torch.rand(batch, n, device=device, generator=self._shared())
        return torch.stack([torch.rand(n, device=device, generator=g) for g in self._rows(batch)])

    def peek(self, batch: int, n: int, device: torch.device | str) -> torch.Tensor:
        """(B, n): the next n uniforms of each seeded row, left in its generator for `advance`.
        Rows on the global generator, and a shared generator, draw (and use up) fresh ones."""
        if not self._per_row:
            return torch.rand(batch, n, device=device, generator=self._shared())
        out = []
        for g in self._rows(batch):
            state = None if g is None else g.get_state()
            out.append(torch.rand(n, device=device, generator=g))
            if g is not None:
                g.set_state(state)
        return torch.stack(out)

    def advance(self, counts: Sequence[int]) -> None:
        """Use up counts[b] uniforms of each seeded row (those its round emitted tokens from)."""
        if not self._per_row:
            return
        for g, n in zip(self._rows(len(counts)), counts, strict=True):
            if g is not None and n:
                torch.rand(n, device=g.device, generator=g)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """probs (B, V) -> tokens (B,) int64, one uniform per row (`inverse_transform`). (An
        exponential race, argmax p / E, needs a draw per token: 60 ms a step for 64 rows of a
        49K vocabulary on the 2-core CPU, against 1-2 ms for this.)"""
        return inverse_transform(probs, self.uniform(probs.shape[0], 1, probs.device)[:, 0])

    def _shared(self) -> torch.Generator | None:
        gen = self._generators
        assert gen is None or isinstance(gen, torch.Generator)
        return gen

    def _rows(self, batch: int) -> list[torch.Generator | None]:
        gens = list(self._generators)  # type: ignore[arg-type]
        assert len(gens) == batch, f"{len(gens)} generators for {batch} rows"
        return gens


def inverse_transform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs (B, V), u (B,) in [0, 1) -> tokens (B,) int64: the first token whose cumulative
    probability exceeds u * total (no host sync). A token of probability 0 adds nothing to the
    sum, so it is never drawn."""
    cdf = probs.cumsum(-1)  # (B, V)
    tokens = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)  # (B, 1)
    return tokens.clamp_(max=probs.shape[1] - 1).squeeze(1)


def sample(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None], greedy: bool
) -> torch.Tensor:
    """probs (B, V) -> tokens (B,) int64. One generator per row (None = the global RNG)."""
    if greedy:
        return probs.argmax(-1)
    return RowRandom(generators).sample(probs)
