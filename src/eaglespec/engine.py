"""Speculative decoding of a batch: the only module that knows both the target and the draft.

One round, for every active row at once:
  1. the proposer drafts a chain of k tokens after the root (the last token the target chose);
  2. the target runs root + drafts in one forward (tree mask, positions prefix + depth) and captures
     the states the draft needs;
  3. verification accepts a prefix of the drafts and picks the next root (bonus or recovered);
  4. one host sync hands the tokens back; the target cache keeps root + accepted entries
     (`cache.keep`), and the draft catches up on them with the target's own states.
Rows accept different numbers of tokens; caches and positions are per row throughout.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eaglespec.cache import KVCache, compact_order
from eaglespec.config import SamplingParams, TreeConfig
from eaglespec.draft.base import GraftingProposer, Proposer, TreeProposer
from eaglespec.errors import InvalidRequestError
from eaglespec.generate import next_tokens, pad_right, step_logprobs
from eaglespec.logprobs import TokenLogprob, to_host, token_logprobs
from eaglespec.model.llama import ForwardOutput, Transformer
from eaglespec.policy import DraftChoice, DraftPolicy, FixedDraft
from eaglespec.requests import (
    Provenance,
    RequestState,
    StreamEvent,
    TokenMark,
    account_time,
    append_token,
    new_states,
)
from eaglespec.sampling import RowRandom, SamplingTensors, greedy_tokens, probs_from_logits
from eaglespec.tokenizer import Tokenizer
from eaglespec.tree import DraftTree, chain_tree, verify_positions
from eaglespec.verify import (
    HostPath,
    VerifyResult,
    verify_greedy,
    verify_greedy_host,
    verify_sampled,
)


@dataclass
class SpecBatch:
    """The device-side state of the rows still generating."""

    cache: KVCache  # the target's
    draft: Any  # the proposer's state
    roots: torch.Tensor  # (B,) tokens the target chose last, not yet in its cache
    st: SamplingTensors
    generators: list[torch.Generator | None]

    def select(self, proposer: Proposer, rows: list[int]) -> SpecBatch:
        """Only these rows, in this order; the target cache is compacted in place
        (KVCache.compact), so this batch must not be used after."""
        idx = torch.tensor(rows, device=self.roots.device)
        return SpecBatch(
            self.cache.compact(rows),
            proposer.select_rows(self.draft, rows),
            self.roots[idx],
            self.st.select(idx),
            [self.generators[r] for r in rows],
        )

    @staticmethod
    def concat(proposer: Proposer, parts: Sequence[SpecBatch]) -> SpecBatch:
        """The rows of `parts` in order: sequences joining a running batch."""
        return SpecBatch(
            KVCache.concat([p.cache for p in parts]),
            proposer.concat([p.draft for p in parts]),
            torch.cat([p.roots for p in parts]),
            SamplingTensors.concat([p.st for p in parts]),
            [g for p in parts for g in p.generators],
        )


@dataclass(frozen=True, slots=True)
class RoundOutput:
    drafted: int  # draft positions this round: chain length or tree depth
    accepted: list[int]  # draft tokens accepted, per row
    tokens: list[list[int]]  # per row: the accepted draft tokens, then the next root
    draft_seconds: float  # proposing, plus the draft's catch-up after verification
    verify_seconds: float  # the target's forward, verification and the round's host sync
    sources: list[list[str]]  # per row, one requests.SOURCES entry per `tokens` entry
    logprobs: list[list[TokenLogprob]] | None = None  # per row, one per `tokens` entry


@dataclass(frozen=True, slots=True)
class RoundReport:
    """What `BatchRunner.round` hands back: the rows' events and the round's own figures."""

    events: list[StreamEvent]  # one per row that took part, in row order
    output: RoundOutput
    seconds: float  # the round's wall time


class PhaseClock:
    """Wall time of a round's phases without extra host syncs: CUDA events on a GPU, read after
    the round's own sync; `perf_counter` on a CPU, where every op has finished when it returns."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        """Seconds between consecutive marks; call after a host sync covering the last mark."""
        m = self.marks
        if self.cuda:
            m[-1].synchronize()  # no-op wait: the round's sync already passed this event
            return [a.elapsed_time(b) / 1e3 for a, b in zip(m, m[1:], strict=False)]
        return [b - a for a, b in zip(m, m[1:], strict=False)]


@torch.inference_mode()  # per resumption of the generator, not leaking into the caller's code
def generate_speculative(
    target: Transformer,
    proposer: Proposer,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    *,
    num_draft: int,
    tree: TreeConfig | None = None,
    policy: DraftPolicy | None = None,
) -> Iterator[StreamEvent]:
    """Like `generate.generate_stream`, with a chain of k = num_draft draft tokens per round, or
    an EAGLE-2 dynamic tree of `tree.num_nodes` tokens when `tree` is given. A `policy`
    (policy.py) picks each round's shape instead, up to that size, and learns from the rounds."""
    check_speculation(proposer, params, tree)
    runner = BatchRunner(
        target, proposer, tokenizer, max_draft=draft_width(num_draft, tree, proposer)
    )
    yield from runner.join(prompts, params, range(len(prompts)))
    if policy is None:
        policy = FixedDraft(DraftChoice(num_draft, tree))
    while runner.seqs:
        yield from runner.policy_round(policy).events


def check_speculation(
    proposer: Proposer, params: Sequence[SamplingParams], tree: TreeConfig | None
) -> None:
    if any(p.repetition_penalty != 1 for p in params):
        raise InvalidRequestError("repetition_penalty is not supported with speculative decoding")
    if tree is not None and not isinstance(proposer, TreeProposer):
        raise InvalidRequestError("tree drafting needs an EAGLE-3 head (--method eagle3)")


def draft_width(num_draft: int, tree: TreeConfig | None, proposer: Proposer | None) -> int:
    """Draft tokens a round verifies at most: the chain length, or the tree's node count, and
    what a grafting proposer adds to either."""
    grafted = proposer.graft_tokens if isinstance(proposer, GraftingProposer) else 0
    return max(num_draft, tree.num_nodes if tree is not None else 0) + grafted


class BatchRunner:
    """The sequences decoding together. New ones join between rounds (one ragged prefill for all
    newcomers, then their rows are appended), finished or cancelled ones leave; each round drafts
    and verifies for every row at once. Generation of a fixed batch and the server's continuous
    batching both run on it.

    `max_draft` bounds the draft tokens of any round (cache room reserved per row)."""

    def __init__(
        self, target: Transformer, proposer: Proposer, tokenizer: Tokenizer, *, max_draft: int
    ) -> None:
        self.target = target
        self.proposer = proposer
        self.tokenizer = tokenizer
        self.max_draft = max_draft
        self.eos = set(tokenizer.eos_ids)
        self.limit = target.cfg.context_limit
        self.seqs: list[RequestState] = []  # row order of `batch`
        self.batch: SpecBatch | None = None

    def capacity_for(self, prompt_len: int, max_tokens: int) -> int:
        """Cache slots one request needs: prompt, output and one round's drafts past the end."""
        return min(self.limit, prompt_len + max_tokens + self.max_draft + 1)

    def join(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        indices: Iterable[int],
    ) -> list[StreamEvent]:
        """Prefill newcomers (StreamEvent.index = their `indices`) in one forward, emit their
        first tokens and append the unfinished ones to the running batch."""
        prefill = self.begin_join(prompts, params, indices, chunk=None)
        while not prefill.step():
            pass
        return self.complete_join(prefill)

    def begin_join(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        indices: Iterable[int],
        *,
        chunk: int | None,
    ) -> Prefill:
        """Newcomers whose prefill runs `chunk` prompt tokens per `Prefill.step` (None: all at
        once), so a caller can run rounds of the running batch between chunks; then
        `complete_join`. Bad requests raise here, before any forward."""
        start = time.perf_counter()
        seqs = new_states(prompts, params, self.tokenizer, self.limit, self.target.device, indices)
        capacity = max(
            self.capacity_for(len(p), sp.max_tokens) for p, sp in zip(prompts, params, strict=True)
        )
        return Prefill(self.target, self.proposer, prompts, params, seqs, capacity, chunk, start)

    def complete_join(self, prefill: Prefill) -> list[StreamEvent]:
        """The first tokens of a finished `Prefill`; its unfinished rows join the batch."""
        seqs = prefill.seqs
        started = prefill.finish()
        batch = started.batch
        first = batch.roots.tolist()  # sync: the first token of every new row
        lps = step_logprobs(started.logits, batch.roots, first, seqs)
        now = time.perf_counter()
        events, keep = [], []
        for row, seq in enumerate(seqs):
            seq.started = prefill.started
            account_time(seq.out.stats, prefill.started, now)
            row_lps = None if lps is None else lps[row]
            event = _emit(seq, [first[row]], self.eos, self.limit, row_lps, ["target"], 0, 0)
            events.append(event)
            if event.output is None:
                keep.append(row)
        if keep:
            if len(keep) < len(seqs):
                batch = batch.select(self.proposer, keep)
            parts = [batch] if self.batch is None else [self.batch, batch]
            self.batch = SpecBatch.concat(self.proposer, parts) if len(parts) > 1 else batch
            self.seqs += [seqs[r] for r in keep]
        return events

    def policy_round(self, policy: DraftPolicy) -> RoundReport:
        """One round with the shape `policy` picks for this batch size; the policy then observes
        the round's time and acceptance."""
        batch = len(self.seqs)
        choice = policy.choose(batch)
        report = self.round(choice.num_draft, choice.tree, graft=choice.graft)
        policy.observe(batch, choice, report.seconds, report.output.accepted)
        return report

    def round(self, num_draft: int, tree: TreeConfig | None, *, graft: bool = True) -> RoundReport:
        """One draft-and-verify round for every row; finished rows leave afterwards. `graft`:
        whether a grafting proposer adds its candidates (speculate_round)."""
        assert self.batch is not None, "round() on an empty batch"
        start = time.perf_counter()
        tops = [s.params.logprobs for s in self.seqs]
        result = speculate_round(
            self.target, self.proposer, self.batch, num_draft, tree, tops, graft=graft
        )
        now = time.perf_counter()
        shape = DraftChoice(num_draft, tree, graft).name
        events, keep = [], []
        for row, seq in enumerate(self.seqs):
            seq.out.stats.record_round(
                result.drafted,
                result.accepted[row],
                result.draft_seconds,
                result.verify_seconds,
                shape,
            )
            account_time(seq.out.stats, seq.started, now)
            lps = None if result.logprobs is None else result.logprobs[row]
            event = _emit(
                seq,
                result.tokens[row],
                self.eos,
                self.limit,
                lps,
                result.sources[row],
                result.drafted,
                result.accepted[row],
            )
            events.append(event)
            if event.output is None:
                keep.append(row)
        self._keep(keep)
        return RoundReport(events, result, now - start)

    def drop(self, indices: Iterable[int]) -> list[RequestState]:
        """Remove the rows of these requests (cancelled); returns their states."""
        gone = set(indices)
        dropped = [s for s in self.seqs if s.out.index in gone]
        self._keep([r for r, s in enumerate(self.seqs) if s.out.index not in gone])
        return dropped

    def _keep(self, rows: list[int]) -> None:
        """Only these rows (increasing) stay; rows from the end refill the gaps
        (cache.compact_order), so a departure moves a few rows, not the whole cache."""
        if len(rows) == len(self.seqs):
            return
        rows = compact_order(len(self.seqs), rows)
        self.seqs = [self.seqs[r] for r in rows]
        assert self.batch is not None
        self.batch = self.batch.select(self.proposer, rows) if rows else None


class Prefill:
    """The target prefill of a group of new rows, `chunk` prompt positions per `step` (None:
    the whole prompts in one step). Prompts of one length go together: each chunk is one forward
    over all rows onto the cache built so far. Prompts of different lengths go one row at a
    time, each row's chunks onto its own row of the cache (a one-row view), so no padding is
    computed (right-padded together, 12 prompts of 29-769 tokens ran 9,228 rows for 2,258
    prompt tokens; session 58): every row is computed the same alone or batched, so the cache,
    the logits and the states are the ones a padded forward gives at the real positions.
    Each row's last-position logits are kept from the chunk that holds its last prompt token,
    and the captured states are gathered over chunks (zeros past a row's prompt), so `finish`
    samples the first tokens and starts the proposer exactly as a one-forward prefill does."""

    def __init__(
        self,
        target: Transformer,
        proposer: Proposer,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        seqs: Sequence[RequestState],
        capacity: int,
        chunk: int | None,
        started: float,
    ) -> None:
        self.target, self.proposer, self.seqs = target, proposer, list(seqs)
        self.params = params
        self.capacity = capacity
        self.started = started  # perf_counter when the group arrived: its timings' origin
        self.ids, self.lengths = pad_right(prompts, target.device)  # (B, T)
        self.chunk = chunk or self.ids.shape[1]
        self.cache = target.new_cache(len(prompts), capacity)
        self.done = 0  # prompt positions prefilled so far (all rows alike, or the row's)
        self.last: torch.Tensor | None = None  # (B, V) each row's last-position logits
        self.hidden: list[list[torch.Tensor]] = []  # per chunk: captured states (B, t, C)
        # Row by row where the lengths differ: the row at hand, its logits and states so far
        self.by_row = min(self.lengths) != max(self.lengths)
        self.row = 0
        self.row_last: list[torch.Tensor] = []  # (V,) per finished row
        self.row_hidden: list[list[list[torch.Tensor]]] = [[] for _ in self.lengths]

    def step(self) -> bool:
        """Prefill the next chunk; True once every prompt is in the cache."""
        if self.by_row:  # a chunk of one row a step; every row in this step without a chunk
            whole = self.chunk >= self.ids.shape[1]
            while not self._row_step():
                if not whole:
                    return False
            return True
        B, T = self.ids.shape
        c0, c1 = self.done, min(self.done + self.chunk, T)
        ids = self.ids[:, c0:c1]  # (B, t)
        device = ids.device
        positions = torch.tensor(self.cache.lengths, device=device)[:, None] + torch.arange(
            c1 - c0, device=device
        )  # (B, t): a row whose prompt ended keeps counting (those slots are never committed)
        ends = [n - 1 - c0 if c0 < n <= c1 else 0 for n in self.lengths]
        out: ForwardOutput = self.target(
            ids,
            positions,
            self.cache,
            capture=self.proposer.capture,
            logit_index=torch.tensor(ends, device=device)[:, None],
        )
        self.cache.advance([max(0, min(n, c1) - c0) for n in self.lengths])
        ending = torch.tensor([c0 < n <= c1 for n in self.lengths], device=device)  # (B,)
        logits = out.logits[:, 0]  # (B, V)
        self.last = logits if self.last is None else torch.where(ending[:, None], logits, self.last)
        self.hidden.append(list(out.hidden))
        self.done = c1
        return c1 >= T

    def _row_step(self) -> bool:
        """The next chunk of the row at hand, onto its own row of the cache; True once every
        prompt is in the cache."""
        b, n = self.row, self.lengths[self.row]
        c0, c1 = self.done, min(self.done + self.chunk, n)
        device = self.ids.device
        out: ForwardOutput = self.target(
            self.ids[b : b + 1, c0:c1],
            torch.arange(c0, c1, device=device)[None],
            self.cache.row(b),  # a view: the forward writes row b's entries
            capture=self.proposer.capture,
            logit_index=torch.tensor([[c1 - c0 - 1]], device=device),
        )
        self.cache.lengths = [c1 if r == b else m for r, m in enumerate(self.cache.lengths)]
        self.row_hidden[b].append(list(out.hidden))
        self.done = c1
        if c1 < n:
            return False
        self.row_last.append(out.logits[0, 0])
        self.row, self.done = self.row + 1, 0
        if self.row < len(self.lengths):
            return False
        self.last = torch.stack(self.row_last)  # (B, V)
        T = self.ids.shape[1]
        padded = []  # per row: its captured states (1, T, C), zeros past its prompt
        for n, chunks in zip(self.lengths, self.row_hidden, strict=True):
            states = [torch.cat(parts, dim=1) for parts in zip(*chunks, strict=True)]  # (1, n, C)
            padded.append([torch.nn.functional.pad(h, (0, 0, 0, T - n)) for h in states])
        # one "chunk" of (B, T, C) states, as the batched forwards leave them
        self.hidden = [[torch.cat(h, dim=0) for h in zip(*padded, strict=True)]]
        self.done = T
        return True

    def finish(self) -> StartedBatch:
        assert self.last is not None and self.done >= self.ids.shape[1], "prefill not finished"
        st = SamplingTensors.from_params(self.params, self.target.device)
        generators = [s.generator for s in self.seqs]
        roots = next_tokens(self.last, st, None, generators)
        hidden = [torch.cat(parts, dim=1) for parts in zip(*self.hidden, strict=True)]
        draft = self.proposer.start(self.ids, roots, hidden, self.lengths, self.capacity)
        batch = SpecBatch(self.cache, draft, roots, st, generators)
        return StartedBatch(batch, self.last)


@dataclass(frozen=True, slots=True)
class StartedBatch:
    batch: SpecBatch  # roots = the first tokens
    logits: torch.Tensor  # (B, V) the prefill's last-position logits the first tokens came from


def speculate_round(
    target: Transformer,
    proposer: Proposer,
    batch: SpecBatch,
    num_draft: int,
    tree: TreeConfig | None,
    logprobs: Sequence[int | None] = (),
    *,
    graft: bool = True,
) -> RoundOutput:
    """Propose, verify in one target forward, commit both caches; updates `batch` in place.
    Near the end of the cache the chain is shortened (a tree falls back to a chain).
    `logprobs[b]`: row b's number of top alternatives, None (or no entry) for no logprobs.
    `graft` False: a grafting proposer's candidates (prompt lookup) stay out of this round, so
    a round of no drafts is a plain decoding step (the adaptive policy's plain arm: in a batch,
    every row verifies as many tokens as its longest graft, policy.py)."""
    clock = PhaseClock(batch.roots.device)
    clock.mark()
    greedy = batch.st.all_greedy and all(t is None for t in logprobs)
    grafter = getattr(proposer, "graft", None) if graft else None  # (its isinstance: ~20 us)
    room = batch.cache.capacity - max(batch.cache.lengths) - 1
    if tree is not None and isinstance(proposer, TreeProposer) and room >= tree.num_nodes:
        drafted = proposer.propose_tree(batch.draft, batch.roots, tree)
    else:  # a chain, shortened near the end of the cache
        k = max(0, min(num_draft, room))
        if k == 0 and grafter is None and greedy:  # nothing to draft or graft: no tree to build
            clock.mark()
            return _plain_round(target, proposer, batch, clock)
        roots = batch.roots  # (B,)
        drafts = proposer.propose(batch.draft, k) if k else roots.new_empty(len(roots), 0)
        drafted = chain_tree(roots, drafts)
    own_nodes = drafted.tokens.shape[1]  # nodes past these are grafted (prompt lookup's)
    if grafter is not None:  # a GraftingProposer's candidates
        drafted = grafter(batch.draft, drafted, room)
    clock.mark()
    if drafted.num_nodes == 1 and greedy:  # the gate declined every draft, lookup found none
        return _plain_round(target, proposer, batch, clock)
    out: ForwardOutput | None = None
    argmax: torch.Tensor | None
    if greedy and drafted.is_chain:  # the argmax after each node is all greedy verification needs
        argmax, hidden = target.greedy(drafted.tokens, batch.cache, proposer.capture)  # (B, N)
    else:
        prefix = torch.tensor(batch.cache.lengths, device=batch.roots.device)
        out = target(
            drafted.tokens,
            verify_positions(drafted, prefix),
            batch.cache,
            attn_mask=None if drafted.is_chain else drafted.mask,  # a chain's mask is causal
            capture=proposer.capture,
        )
        hidden = out.hidden
        argmax = greedy_tokens(out.logits) if greedy else None  # (B, N), a tree's
    N, D, dev = drafted.num_nodes, drafted.max_depth, batch.roots.device
    result: VerifyResult | None = None
    if argmax is not None:  # verified on the host
        rows = torch.cat([drafted.tokens, argmax, drafted.parents], 1).tolist()  # (B, 3N)
        # (sync: the round's tokens, once for all rows)
        walks = [verify_greedy_host(r[:N], r[N : 2 * N], r[2 * N :]) for r in rows]
    else:
        assert out is not None
        result = _verify(drafted, out.logits, batch.st, batch.generators)
        found = [result.path, result.next_token[:, None], result.bonus[:, None].long()]
        rows = torch.cat([drafted.tokens, *found], 1).tolist()  # (B, N + D + 3)
        # (sync: the round's tokens, once for all rows)
        walks = [
            HostPath([n for n in r[N : N + D + 1] if n >= 0], r[N + D + 1], bool(r[N + D + 2]))
            for r in rows
        ]
    accepted = [len(w.path) - 1 for w in walks]
    if not batch.st.all_greedy and drafted.draft_probs is None:
        # the verifier peeked at each row's uniforms: use up one per emitted token (verify.py)
        RowRandom(batch.generators).advance([a + 1 for a in accepted])
    # per row: the accepted drafts' tokens (row r's first N entries), then the next root
    tokens = [[r[n] for n in w.path[1:]] + [w.next_token] for r, w in zip(rows, walks, strict=True)]
    sources = [
        _sources(len(w.path) - 1, D, w.bonus, [n >= own_nodes for n in w.path[1:]]) for w in walks
    ]
    lps = None
    if result is not None and out is not None and any(t is not None for t in logprobs):
        path_tokens = torch.gather(drafted.tokens, 1, result.path.clamp(min=0))  # (B, D + 1)
        lps = _round_logprobs(out.logits, result, path_tokens, tokens, logprobs)
    clock.mark()
    committed = [a + 1 for a in accepted]  # the root and the accepted drafts
    # (B, A) each row's root path, padded with node 0; a chain's is 0 .. a, nothing to gather,
    # and so is a tree's whose every row accepted its first nodes in order (the head's chain,
    # which precedes a graft, or nothing: most tree rounds of a chain with lookup grafted)
    in_order = drafted.is_chain or all(w.path[-1] == len(w.path) - 1 for w in walks)
    nodes = None if in_order else _path_nodes(walks, max(committed), dev)
    if nodes is None:  # already in their slots, in order
        batch.cache.advance(committed)
    else:
        batch.cache.keep(nodes, committed)
    batch.draft = _catch_up(proposer, batch.draft, hidden, nodes, tokens, committed, dev)
    batch.roots = torch.tensor([w.next_token for w in walks], device=dev)  # (B,)
    clock.mark()
    propose, verify, catch_up = clock.spans()
    return RoundOutput(D, accepted, tokens, propose + catch_up, verify, sources, lps)


def _plain_round(
    target: Transformer, proposer: Proposer, batch: SpecBatch, clock: PhaseClock
) -> RoundOutput:
    """A round with nothing drafted or grafted, all rows greedy and without logprobs: the plain
    decoding step of generate.generate_stream, its captured states handed to the draft. The same
    forward and the same tokens as the general path (a chain of only the root accepts nothing
    and takes the root's argmax), without its tree, verification and catch-up tensor work: about
    0.3 ms of a 6.5 ms SmolLM2 step, in many small ops."""
    roots = batch.roots  # (B,)
    B = len(roots)
    argmax, hidden = target.greedy(roots[:, None], batch.cache, proposer.capture)  # (B, 1)
    next_token = argmax[:, 0]  # (B,)
    tokens = next_token.tolist()  # sync: the round's tokens
    clock.mark()
    batch.cache.advance([1] * B)
    batch.draft = proposer.catch_up(batch.draft, argmax, hidden, [1] * B)
    batch.roots = next_token
    clock.mark()
    propose, verify, catch_up = clock.spans()
    sources = [["target"] for _ in range(B)]
    return RoundOutput(0, [0] * B, [[t] for t in tokens], propose + catch_up, verify, sources)


def _sources(accepted: int, depth: int, bonus: bool, grafted: list[int]) -> list[str]:
    """requests.SOURCES of a row's round tokens: its accepted drafts, then the target's token."""
    drafts = ["lookup" if g else "draft" for g in grafted[:accepted]]
    if depth == 0:
        return drafts + ["target"]
    return drafts + ["bonus" if bonus else "corrected"]


def _round_logprobs(
    logits: torch.Tensor,  # (B, N, V) the verify forward's logits, one row per tree node
    result: VerifyResult,
    path_tokens: torch.Tensor,  # (B, D + 1) root, accepted drafts, then padding
    tokens: list[list[int]],  # per row: the round's tokens (accepted drafts, then the next root)
    tops: Sequence[int | None],
) -> list[list[TokenLogprob]]:
    """Token j of row b was chosen from the logits at node path[b, j]: the accepted drafts at
    positions j < a, the next root at j = a."""
    B, N, V = logits.shape
    nodes = result.path.clamp(min=0)  # (B, D + 1)
    emitted = torch.cat([path_tokens[:, 1:], path_tokens[:, :1]], dim=1)  # (B, D + 1)
    emitted.scatter_(1, result.num_accepted[:, None], result.next_token[:, None])
    at = torch.gather(logits, 1, nodes[..., None].expand(B, nodes.shape[1], V))  # (B, D + 1, V)
    k = [t or 0 for t in tops] + [0] * (B - len(tops))
    return to_host(token_logprobs(at, emitted, max(k)), tokens, k)


def _verify(
    tree: DraftTree,
    logits: torch.Tensor,
    st: SamplingTensors,
    generators: Sequence[torch.Generator | None],
) -> VerifyResult:
    """logits (B, N, V): greedy fast path, else target probs per node (greedy rows one-hot)."""
    if st.all_greedy:
        return verify_greedy(tree, logits)
    B, N, V = logits.shape
    per_node = st.select(torch.arange(B, device=logits.device).repeat_interleave(N))
    probs = probs_from_logits(logits.reshape(B * N, V), per_node).view(B, N, V)
    return verify_sampled(tree, probs, RowRandom(generators))


def _path_nodes(walks: Sequence[HostPath], width: int, device: torch.device) -> torch.Tensor:
    """(B, width) each row's root path (root, accepted nodes), padded with node 0."""
    return torch.tensor([w.path + [0] * (width - len(w.path)) for w in walks], device=device)


def _catch_up(
    proposer: Proposer,
    draft: Any,
    states: list[torch.Tensor],  # the verify forward's captured states, each (B, N, Ct)
    nodes: torch.Tensor | None,  # (B, A) root paths padded with node 0; None for a chain
    tokens: list[list[int]],  # per row: the accepted drafts, then the next root
    counts: list[int],  # per row: root + accepted
    dev: torch.device,
) -> Any:
    """Feed the draft (accepted drafts + next root) with the target states of (root + accepted)."""
    A = max(counts)
    # (B, A) row b: d_1 .. d_a, next, then padding (past counts[b]: computed, never committed)
    fed = torch.tensor([t + t[-1:] * (A - len(t)) for t in tokens], device=dev)
    if nodes is None:  # root + accepted drafts are nodes 0 .. a: the first A nodes of every row
        aux = [h[:, :A] for h in states]
    else:
        aux = [torch.gather(h, 1, nodes[..., None].expand(-1, -1, h.shape[-1])) for h in states]
    return proposer.catch_up(draft, fed, aux, counts)


def _emit(
    seq: RequestState,
    tokens: list[int],
    eos: set[int],
    limit: int,
    logprobs: list[TokenLogprob] | None,
    sources: list[str],  # one requests.SOURCES entry per token
    drafted: int,
    accepted: int,
) -> StreamEvent:
    """Append a round's tokens in order, stopping at the first that finishes the request."""
    text, new_ids = "", []
    new_lps: list[TokenLogprob] | None = None if seq.out.logprobs is None else []
    marks: list[TokenMark] = []
    event = None
    for j, tid in enumerate(tokens):
        full = len(seq.out.prompt_token_ids) + len(seq.out.token_ids) + 1 >= limit
        event = append_token(seq, tid, eos, full, None if logprobs is None else logprobs[j])
        text += event.text
        new_ids += event.token_ids
        if event.token_ids:
            marks.append(TokenMark(event.text, sources[j]))
        elif event.text:  # an EOS releasing held-back text: it belongs to the tokens before
            last = marks.pop() if marks else TokenMark("", sources[j])
            marks.append(TokenMark(last.text + event.text, last.source))
        if new_lps is not None and event.logprobs:
            new_lps += event.logprobs
        if event.output is not None:
            break
    assert event is not None
    provenance = Provenance(drafted, accepted, marks)
    return StreamEvent(event.index, text, new_ids, event.output, new_lps, provenance)
