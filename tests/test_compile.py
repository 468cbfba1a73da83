"""torch.compile'd decode and verify steps (`Transformer.compile_steps`): the compiled step computes
what the eager one does (fp32, attention spelled out instead of SDPA), keeps the cache protocol
(writes land where the plan says, ragged rows and tree masks included), and speculative decoding
over a compiled target stays lossless against plain decoding of the same compiled target, with
int4 weights too.

Each test compiles a tiny model: inductor's C++ compile costs seconds the first time, then its
on-disk cache answers."""

from __future__ import annotations

import copy

import pytest
import torch

from eaglespec.config import SamplingParams
from eaglespec.draft.loader import random_eagle3
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.engine import generate_speculative
from eaglespec.errors import InvalidRequestError
from eaglespec.generate import generate_stream
from eaglespec.model.llama import Transformer
from eaglespec.model.quant import quantize_model
from eaglespec.requests import collect_outputs
from helpers import NullTokenizer, tiny_target
from oracle import OracleProposer

V = 96


@pytest.fixture(scope="module")
def eager() -> Transformer:
    return tiny_target(0, vocab=V)


def _compiled(model: Transformer, mode: str) -> Transformer:
    twin = copy.deepcopy(model)
    twin.compile_steps(mode)
    return twin


@pytest.mark.parametrize("mode", ["block", "full"])
def test_compiled_steps_compute_the_eager_steps(eager: Transformer, mode: str) -> None:
    comp = _compiled(eager, mode)
    prompts = torch.tensor([[5, 17, 33, 2, 8, 1], [9, 1, 4, 0, 0, 0]])
    caches = [m.new_cache(2, 32) for m in (eager, comp)]
    for m, c in zip((eager, comp), caches, strict=True):
        m(prompts, torch.arange(6).expand(2, 6), c)  # prefill: eager in both (prefix-free)
        c.advance([6, 3])  # ragged: row 1 keeps 3 entries
    # Steps of 1 token, then a 3-token tree (root, two siblings), on ragged rows.
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3)
    steps = [
        (torch.tensor([[7], [8]]), None, [1, 1]),
        (torch.tensor([[3], [4]]), None, [1, 1]),
        (torch.tensor([[11, 12, 13], [21, 22, 23]]), tree, [2, 1]),
        (torch.tensor([[30], [31]]), None, [1, 1]),
    ]
    for ids, mask, keep in steps:
        outs = []
        for m, c in zip((eager, comp), caches, strict=True):
            depth = torch.tensor([0, 1, 1])[: ids.shape[1]] if mask is not None else torch.zeros(1)
            pos = torch.tensor(c.lengths)[:, None] + depth.long()[None]
            outs.append(m(ids, pos, c, attn_mask=mask, capture=(0, 2)))
            c.advance(keep)
        torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
        for a, b in zip(outs[0].hidden, outs[1].hidden, strict=True):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    # The compiled steps wrote the same entries to the cache.
    torch.testing.assert_close(caches[1].k, caches[0].k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[1].v, caches[0].v, atol=1e-4, rtol=1e-4)


PROMPTS = [[5, 17, 33, 2, 8], [9, 1, 4], [70, 71, 72, 73, 74, 75, 76, 77, 78]]


@pytest.mark.parametrize("compile", ["none", "block"])
@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_speculation_over_a_quantized_or_compiled_target_is_lossless(
    eager: Transformer, quant: str, compile: str
) -> None:
    """Greedy identity with respect to the same target, for each quantization, eager and
    compiled: the quantized kernels compute each row alone (tests/test_quant.py), so verifying
    k tokens in one forward gives the tokens k single steps give."""
    target = quantize_model(copy.deepcopy(eager), quant)
    target.compile_steps(compile)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (14, 9, 20)]
    plain = collect_outputs(generate_stream(target, NullTokenizer(), PROMPTS, params))
    seqs = [p + o.token_ids + [0] * 8 for p, o in zip(PROMPTS, plain, strict=True)]
    drafts = {
        "oracle-noisy": OracleProposer(seqs, V, wrong_every=3),
        "random-head": Eagle3Proposer(random_eagle3(target, seed=1), (1, 3, 4)),
    }
    for proposer in drafts.values():
        spec = collect_outputs(
            generate_speculative(target, proposer, NullTokenizer(), PROMPTS, params, num_draft=3)
        )
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_unknown_compile_mode_names_the_supported_ones(eager: Transformer) -> None:
    with pytest.raises(InvalidRequestError, match="'fast'.*none, block, full"):
        copy.deepcopy(eager).compile_steps("fast")


def test_compiled_head_steps_compute_the_eager_head(eager: Transformer) -> None:
    """An EAGLE-3 head's compiled layers (`Eagle3Head.compile_steps`): a prefill over the
    prompt, then single-token draft steps, give the eager head's logits and states."""
    head = random_eagle3(eager, seed=2)
    comp = copy.deepcopy(head)
    comp.compile_steps("block")
    gen = torch.Generator().manual_seed(0)
    C = head.cfg.hidden_size
    ids = torch.tensor([[5, 17, 33, 2, 8], [9, 1, 4, 6, 0]])
    hidden = torch.randn(2, 5, C, generator=gen)
    caches = [h.new_cache(2, 16) for h in (head, comp)]
    outs = [
        h(ids, hidden, torch.arange(5).expand(2, 5), c)
        for h, c in zip((head, comp), caches, strict=True)
    ]
    for step in range(3):
        for c in caches:
            c.advance([5 if step == 0 else 1, 4 if step == 0 else 1])
        torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
        nxt = torch.tensor([[3 + step], [7 + step]])
        state = [o.prenorm[:, -1:] for o in outs]
        pos = torch.tensor(caches[0].lengths)[:, None]
        outs = [h(nxt, s, pos, c) for h, s, c in zip((head, comp), state, caches, strict=True)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[1].prenorm, outs[0].prenorm, atol=1e-4, rtol=1e-4)
