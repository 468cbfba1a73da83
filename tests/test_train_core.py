"""The training core: prompt formats (train/data.py), the draft vocabulary (train/vocab.py), the
training-time-test forward (train/ttt.py) and a tiny end-to-end run (train/trainer.py).

The training-time test must compute exactly what the head computes at inference: step 0 is the
head's prefill over the shifted sequence, step j at anchor p is the chain of single-token steps
after a prefill of positions 0..p, with the true tokens in place of the draft's picks. Both are
rebuilt here through `Eagle3Head.forward` and its KV cache and compared in fp32.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from eaglespec.cache import KVCache
from eaglespec.config import SamplingParams
from eaglespec.draft.config import default_capture
from eaglespec.draft.eagle3 import Eagle3Head
from eaglespec.draft.loader import load_eagle3, random_eagle3, save_eagle3
from eaglespec.draft.proposer import Eagle3Proposer
from eaglespec.engine import generate_speculative
from eaglespec.errors import InvalidRequestError
from eaglespec.generate import generate_stream
from eaglespec.model.llama import Transformer
from eaglespec.requests import collect_outputs
from eaglespec.train import trainer
from eaglespec.train.batching import length_batches
from eaglespec.train.data import (
    Conversation,
    read_all,
    read_conversations,
    with_variants,
)
from eaglespec.train.features import FeatureShard, _capture_batch, _concat
from eaglespec.train.meter import NEVER, Deadline
from eaglespec.train.pipeline import build_head, regen_deadlines
from eaglespec.train.regen import Sample, drop_partial_tail, read_jsonl, turns_to_answer
from eaglespec.train.trainer import TrainConfig, autocast_dtype, train
from eaglespec.train.ttt import TTTBatch, TTTOutput, _ttt_mask, position_loss, ttt_forward
from eaglespec.train.vocab import build_draft_vocab, target_ids
from helpers import NullTokenizer, tiny_target

V, VD, T, STEPS = 128, 64, 12, 3


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# data.py: every format, told apart by content


def _jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _turns(convs: list[Conversation]) -> list[tuple[str, ...]]:
    return [c.turns for c in convs]


def test_fastchat_questions_keep_every_turn(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "question.jsonl",
        [
            {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
            {"question_id": 82, "category": "math", "turns": ["2 + 2?"]},
        ],
    )
    convs = read_conversations(path)
    assert _turns(convs) == [("Write a poem.", "Shorter."), ("2 + 2?",)]
    assert [c.source for c in convs] == ["question.jsonl:1", "question.jsonl:2"]


SHAREGPT = [
    {
        "id": "a",
        "conversations": [
            {"from": "human", "value": "Hi there"},
            {"from": "gpt", "value": "Hello! (regenerated, never kept)"},
            {"from": "human", "value": "Tell me more"},
        ],
    },
    {"id": "b", "conversations": [{"from": "gpt", "value": "assistant only: no prompt"}]},
    {
        "id": "c",
        "conversations": [{"from": "system", "value": "sys"}, {"from": "user", "value": "Q"}],
    },
]


def test_sharegpt_array_keeps_human_turns(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT, indent=1))
    convs = read_conversations(path)
    assert _turns(convs) == [("Hi there", "Tell me more"), ("Q",)]
    assert [c.source for c in convs] == ["sharegpt.json:1", "sharegpt.json:3"]


def test_sharegpt_jsonl_same_as_array(tmp_path: Path) -> None:
    convs = read_conversations(_jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT))
    assert _turns(convs) == [("Hi there", "Tell me more"), ("Q",)]


def test_alpaca_instruction_input_and_seed_instances(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "alpaca.jsonl",
        [
            {"instruction": "Summarize the text.", "input": "Long text.", "output": "Short."},
            {"instruction": "Name a color.", "input": "", "output": "Red"},
            {"instruction": "Say hi."},  # no input key at all
            {  # self-instruct seed task: one prompt per instance
                "id": "seed_task_0",
                "instruction": "Translate to French.",
                "instances": [{"input": "cat", "output": "chat"}, {"input": "dog", "output": "x"}],
            },
        ],
    )
    convs = read_conversations(path)
    assert _turns(convs) == [
        ("Summarize the text.\n\nLong text.",),
        ("Name a color.",),
        ("Say hi.",),
        ("Translate to French.\n\ncat",),
        ("Translate to French.\n\ndog",),
    ]
    assert [c.source for c in convs][-2:] == ["alpaca.jsonl:4", "alpaca.jsonl:4"]


def test_gsm8k_questions(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "train.jsonl",
        [
            {"question": "Tom has 3 apples...", "answer": "#### 3"},
            {"question": "x?", "answer": "1"},
        ],
    )
    assert _turns(read_conversations(path)) == [("Tom has 3 apples...",), ("x?",)]


def test_plain_text_paragraphs(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("First paragraph,\nsecond line.\n\nSecond one.\n\n\n\nThird.\n")
    convs = read_conversations(path)
    assert _turns(convs) == [("First paragraph,\nsecond line.",), ("Second one.",), ("Third.",)]
    assert convs[0].source == "notes.txt:1"


def test_unknown_record_names_its_keys(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "odd.jsonl", [{"turns": ["ok"]}, {"prompt": "x", "completion": "y"}])
    with pytest.raises(InvalidRequestError, match=r"odd\.jsonl:2") as err:
        read_conversations(path)
    assert "'completion', 'prompt'" in str(err.value)


def test_invalid_json_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"turns": ["ok"]}\n\n{"turns": ["unterminated\n')
    with pytest.raises(InvalidRequestError, match="line 3") as err:
        read_conversations(path)
    # errors.py: "Each message names the file or value at fault" (read_all reads many files).
    assert "broken.jsonl" in str(err.value)


def test_read_all_without_prompts_raises(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    gpt_only = _jsonl(tmp_path / "gpt.jsonl", [SHAREGPT[1]])
    with pytest.raises(InvalidRequestError, match="no prompts found"):
        read_all([empty, gpt_only])
    ok = _jsonl(tmp_path / "q.jsonl", [{"question": "a"}])
    assert _turns(read_all([empty, ok, gpt_only])) == [("a",)]


def test_read_all_skips_then_limits_per_file(tmp_path: Path) -> None:
    """`--skip-per-file S --limit-per-file N`: conversations S to S + N of each file."""
    a = _jsonl(tmp_path / "a.jsonl", [{"question": f"a{i}"} for i in range(5)])
    b = _jsonl(tmp_path / "b.jsonl", [{"question": f"b{i}"} for i in range(2)])
    assert _turns(read_all([a, b], 1, 2)) == [("a1",), ("a2",), ("b1",)]
    assert _turns(read_all([a, b], 3)) == [("a3",), ("a4",)]
    assert _turns(read_all([a, b])) == [(f"a{i}",) for i in range(5)] + [("b0",), ("b1",)]
    with pytest.raises(InvalidRequestError, match="after skipping 5"):
        read_all([a, b], 5, 10)


def test_variants_are_seeded_and_sized() -> None:
    single = [Conversation((f"prompt {i}",), f"d.jsonl:{i + 1}") for i in range(10)]
    multi = [Conversation(("a", "b"), "d.jsonl:11")]
    convs = single + multi
    out = with_variants(convs, {"code": 0.3}, seed=0)
    assert out[: len(convs)] == convs  # the originals first, unchanged
    added = out[len(convs) :]
    assert len(added) == round(0.3 * len(single)) == 3
    originals = {c.source: c.turns[0] for c in single}
    for c in added:
        assert c.source.endswith(":code") and len(c.turns) == 1
        base = originals[c.source.removesuffix(":code")]  # never the multi-turn one
        assert c.turns[0].startswith("Write a Python program") and c.turns[0].endswith(base)
    assert with_variants(convs, {"code": 0.3}, seed=0) == out  # deterministic
    assert with_variants(convs, {"code": 0.3}, seed=1) != out  # the seed picks the set
    assert with_variants(convs, {"code": 0.0}) == convs
    with pytest.raises(InvalidRequestError, match="unknown prompt variant 'poetry'"):
        with_variants(convs, {"poetry": 0.5})


# ---------------------------------------------------------------------------------------------
# vocab.py


def test_vocab_docstring_example() -> None:
    # counts {5: 9, 1: 4, 6: 4, 2: 1}, 1 seen before 6
    responses = [[5] * 5 + [1, 6] * 4 + [2], [5] * 4]
    vocab = build_draft_vocab(responses, 3, 8)
    assert vocab.ids.tolist() == [1, 5, 6]
    assert vocab.d2t.tolist() == [1, 4, 4]
    assert vocab.t2d.int().tolist() == [0, 1, 0, 0, 0, 1, 1, 0]
    # ties go to the first seen
    assert build_draft_vocab(responses, 2, 8).ids.tolist() == [1, 5]
    assert build_draft_vocab([[6, 1] * 4 + [5] * 9], 2, 8).ids.tolist() == [5, 6]


def test_vocab_full_size_is_identity() -> None:
    for size in (8, 20):
        vocab = build_draft_vocab([[3, 3, 1]], size, 8)
        assert vocab.ids.tolist() == list(range(8))
        assert not vocab.d2t.any() and bool(vocab.t2d.all())


def test_vocab_pads_with_smallest_unused_ids() -> None:
    vocab = build_draft_vocab([[7, 3, 3], [7]], 4, 10)  # two distinct tokens for four slots
    assert vocab.ids.tolist() == [0, 1, 3, 7]
    assert (vocab.ids == torch.arange(4) + vocab.d2t).all()


def test_vocab_keeps_a_continued_heads_tokens_then_adds_the_most_frequent() -> None:
    responses = [[5] * 5 + [1, 6] * 4 + [2], [5] * 4]  # counts {5: 9, 1: 4, 6: 4, 2: 1}
    assert build_draft_vocab(responses, 3, 8, keep=[7, 2]).ids.tolist() == [2, 5, 7]
    # kept ids the data also ranks high take no second slot; duplicates count once
    assert build_draft_vocab(responses, 4, 8, keep=[5, 7, 5]).ids.tolist() == [1, 5, 6, 7]
    assert build_draft_vocab(responses, 2, 8, keep=[0, 3]).ids.tolist() == [0, 3]
    with pytest.raises(ValueError, match="cannot keep 3 tokens in a draft vocabulary of 2"):
        build_draft_vocab(responses, 2, 8, keep=[0, 3, 4])
    vocab = build_draft_vocab(responses, 3, 8, keep=[7])
    assert target_ids(vocab.d2t) == vocab.ids.tolist() == [1, 5, 7]


def test_vocab_coverage() -> None:
    vocab = build_draft_vocab([[5] * 3 + [1, 6]], 3, 8)  # ids [1, 5, 6]
    assert vocab.coverage([1, 2, 5, 5]) == 0.75
    assert vocab.coverage([0, 7]) == 0.0
    assert vocab.coverage([]) == 0.0


# ---------------------------------------------------------------------------------------------
# ttt.py: the training-time test is the inference computation


@pytest.fixture(scope="module", params=[2, 4], ids=["gqa", "mha"])
def target(request: pytest.FixtureRequest) -> Transformer:
    return tiny_target(0, vocab=V, kv_heads=request.param)


@pytest.fixture(scope="module")
def head(target: Transformer) -> Eagle3Head:
    return random_eagle3(target, draft_vocab_size=VD, seed=1)


def _target_states(target: Transformer, ids: torch.Tensor) -> list[torch.Tensor]:
    """A x (B, T, Ct): the target's states at the default capture boundaries."""
    B, n = ids.shape
    positions = torch.arange(n).expand(B, n)
    capture = default_capture(target.cfg.num_layers)
    return target(ids, positions, target.new_cache(B, n), capture=capture).hidden


def _batch(target: Transformer, seed: int = 0, valid: torch.Tensor | None = None) -> TTTBatch:
    """One sequence of T random tokens; loss on the last 6 positions."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (1, T), generator=gen)  # (1, T)
    loss_mask = torch.zeros(1, T, dtype=torch.bool)
    loss_mask[:, -6:] = True
    return TTTBatch(
        ids=ids,
        aux=torch.cat(_target_states(target, ids), dim=-1),  # (1, T, A*Ct)
        target_logp=F.log_softmax(torch.randn(1, T, VD, generator=gen), dim=-1),  # (1, T, Vd)
        target_valid=torch.ones(1, T, dtype=torch.bool) if valid is None else valid,
        loss_mask=loss_mask,
    )


def _split(head: Eagle3Head, aux: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(aux, head.cfg.target_hidden_size, dim=-1))


@torch.no_grad()
def test_step0_is_the_inference_prefill(target: Transformer, head: Eagle3Head) -> None:
    batch = _batch(target)
    out = ttt_forward(head, batch, steps=STEPS, keep_logp=True)
    assert out.logp is not None and [x.shape for x in out.logp] == [(1, T, VD)] * STEPS
    # Inference: position p reads (x_{p+1}, g_p) at RoPE position p.
    g = head.combine([a[:, :-1] for a in _split(head, batch.aux)])  # (1, T-1, C)
    ref = head(batch.ids[:, 1:], g, torch.arange(T - 1)[None], head.new_cache(1, T + 8))
    torch.testing.assert_close(
        out.logp[0][:, : T - 1], F.log_softmax(ref.logits, -1), atol=1e-5, rtol=1e-5
    )


def _inference_chain(head: Eagle3Head, batch: TTTBatch, p: int) -> list[torch.Tensor]:
    """STEPS x (Vd,) draft log-probs at anchor p, as inference computes them: a prefill of the
    committed prefix, then single-token chain steps fed the true tokens."""
    ids, aux = batch.ids, _split(head, batch.aux)
    cache = head.new_cache(1, T + 8)
    # Prefill: positions 0..p read x_1..x_{p+1} with g_0..g_p.
    g = head.combine([a[:, : p + 1] for a in aux])  # (1, p+1, C)
    pre = head(ids[:, 1 : p + 2], g, torch.arange(p + 1)[None], cache)
    cache.advance([p + 1])
    logps = [F.log_softmax(pre.logits[0, p], -1)]
    hidden = pre.prenorm[:, p : p + 1]  # (1, 1, C)
    for j in range(1, STEPS):
        # Autograd: write into a copy, not the buffer the earlier steps' attention has read.
        cache = KVCache(k=cache.k.clone(), v=cache.v.clone(), lengths=list(cache.lengths))
        # Chain step j: the true x_{p+1+j} in place of the draft pick, at RoPE position p + j.
        step = head(ids[:, p + 1 + j : p + 2 + j], hidden, torch.tensor([[p + j]]), cache)
        cache.advance([1])
        logps.append(F.log_softmax(step.logits[0, 0], -1))
        hidden = step.prenorm
    return logps


ANCHORS = [0, 4, T - 1 - STEPS]  # the last one: the last anchor whose chain reads true tokens


@torch.no_grad()
@pytest.mark.parametrize("p", ANCHORS)
def test_step_j_is_the_inference_chain(target: Transformer, head: Eagle3Head, p: int) -> None:
    batch = _batch(target)
    out = ttt_forward(head, batch, steps=STEPS, keep_logp=True)
    assert out.logp is not None
    for j, want in enumerate(_inference_chain(head, batch, p)):
        torch.testing.assert_close(out.logp[j][0, p], want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_padded_rows_match_single_rows(target: Transformer, head: Eagle3Head) -> None:
    a, b = _batch(target, seed=0), _batch(target, seed=1)
    n = T - 4  # b right-padded: its last 4 positions are padding
    both = TTTBatch(
        ids=torch.cat([a.ids, F.pad(b.ids[:, :n], (0, 4))]),
        aux=torch.cat([a.aux, F.pad(b.aux[:, :n], (0, 0, 0, 4))]),
        target_logp=torch.cat([a.target_logp, b.target_logp]),
        target_valid=torch.cat([a.target_valid, b.target_valid]),
        loss_mask=torch.cat([a.loss_mask, F.pad(b.loss_mask[:, :n], (0, 4))]),
    )
    short = TTTBatch(
        *(x[:, :n] for x in (b.ids, b.aux, b.target_logp, b.target_valid)),
        loss_mask=b.loss_mask[:, :n],
    )
    out2 = ttt_forward(head, both, steps=STEPS, keep_logp=True)
    out_a = ttt_forward(head, a, steps=STEPS, keep_logp=True)
    out_b = ttt_forward(head, short, steps=STEPS, keep_logp=True)
    assert out2.logp is not None and out_a.logp is not None and out_b.logp is not None
    for j in range(STEPS):
        keep = n - 1 - j  # positions whose tokens x_{p+1+j} are all real
        torch.testing.assert_close(out2.logp[j][0], out_a.logp[j][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            out2.logp[j][1, :keep], out_b.logp[j][0, :keep], atol=1e-5, rtol=1e-5
        )
    torch.testing.assert_close(out2.counts, out_a.counts + out_b.counts)


def _expected_valid(batch: TTTBatch, j: int) -> list[int]:
    """Anchors p whose step-j target x_{p+2+j} is a response token with a draftable top-1."""
    lm, tv = batch.loss_mask[0].tolist(), batch.target_valid[0].tolist()
    return [p for p in range(T) if p + 2 + j < T and lm[p + 2 + j] and tv[p + 1 + j]]


def test_position_losses_against_hand_computed_values() -> None:
    """p = (0.5, 0.3, 0.2), q = (0.2, 0.3, 0.5): ce = -sum p log q; lk = -log sum min(p, q)
    = -log(0.2 + 0.3 + 0.2) = -log 0.7. A perfect draft (q = p) has lk 0 and ce = H(p)."""
    p = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]).log()
    q = torch.tensor([[0.2, 0.3, 0.5], [0.5, 0.3, 0.2]]).log()
    ce = position_loss(q, p, "ce")
    want_ce = -(0.5 * math.log(0.2) + 0.3 * math.log(0.3) + 0.2 * math.log(0.5))
    entropy = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2))
    torch.testing.assert_close(ce, torch.tensor([want_ce, entropy]))
    lk = position_loss(q, p, "lk")
    torch.testing.assert_close(lk, torch.tensor([-math.log(0.7), 0.0]), atol=1e-6, rtol=1e-6)
    # Its gradient moves q's mass from where q > p to where q < p (raising the overlap).
    logits = torch.tensor([[0.2, 0.3, 0.5]]).log().requires_grad_()
    position_loss(torch.log_softmax(logits, -1), p[:1], "lk").sum().backward()
    assert logits.grad is not None
    assert logits.grad[0, 0] < 0 < logits.grad[0, 2]  # descent raises q(0), lowers q(2)
    # topk (HASS): ce plus the cross-entropy over the target's top-K again; with 3 tokens and
    # K = 10 every token is in the top-K, so it is twice ce; over 12 tokens the 2 least likely
    # count once.
    torch.testing.assert_close(position_loss(q, p, "topk"), 2 * ce)
    p12 = torch.arange(12, 0, -1, dtype=torch.float)[None] / 78  # (1, 12): 12/78 .. 1/78
    q12 = torch.full((1, 12), 1 / 12)
    want = -sum(p12[0, i].item() * math.log(1 / 12) * (2 if i < 10 else 1) for i in range(12))
    got = position_loss(q12.log(), p12.log(), "topk")
    torch.testing.assert_close(got, torch.tensor([want]))
    with pytest.raises(ValueError, match="loss must be one of"):
        position_loss(q, p, "kl2")


@torch.no_grad()
def test_loss_mask_and_sums(target: Transformer, head: Eagle3Head) -> None:
    valid = torch.ones(1, T, dtype=torch.bool)
    valid[0, [T - 5, T - 3]] = False  # target top-1 outside the draft vocab there
    batch = _batch(target, valid=valid)
    out: TTTOutput = ttt_forward(head, batch, steps=STEPS, keep_logp=True)
    assert out.logp is not None
    for j in range(STEPS):
        rows = _expected_valid(batch, j)
        assert int(out.counts[j]) == len(rows)
        # step j at p learns l_{p+1+j}; excluded positions add nothing
        tgt = batch.target_logp[0, [p + 1 + j for p in rows]]  # (Nv, Vd)
        mine = out.logp[j][0, rows]  # (Nv, Vd)
        want = -(tgt.exp() * mine).sum()
        torch.testing.assert_close(out.loss_sums[j], want, atol=1e-4, rtol=1e-5)
        hits = (mine.argmax(-1) == tgt.argmax(-1)).sum()
        assert int(out.correct[j]) == int(hits)
    # loss on x_6..x_11, top-1 not draftable at 7 and 9: four anchors per step
    assert [len(_expected_valid(batch, j)) for j in range(STEPS)] == [4, 4, 4]
    assert (out.chain <= out.correct).all() and (out.chain[1:] <= out.chain[:-1]).all()


def test_ttt_mask_matches_docstring() -> None:
    want = torch.tensor([[1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1]])
    assert torch.equal(_ttt_mask(3, 1, torch.device("cpu")), want.bool())
    assert torch.equal(_ttt_mask(3, 0, torch.device("cpu")), torch.ones(3, 3).tril().bool())
    assert _ttt_mask(4, 2, torch.device("cpu")).shape == (4, 12)


def _trainable(head: Eagle3Head) -> Eagle3Head:
    """random_eagle3 freezes the head: train everything but the target's shared embedding."""
    for p in head.parameters():
        p.requires_grad_(p is not head.embed.weight)
    return head.train()


def test_gradients_reach_the_head_not_the_embedding(target: Transformer) -> None:
    head = _trainable(random_eagle3(target, draft_vocab_size=VD, seed=1))
    out = ttt_forward(head, _batch(target), steps=STEPS)
    torch.stack(out.loss_sums).sum().backward()
    assert head.fc is not None
    named = dict(head.named_parameters())
    want = [n for n in named if n.startswith(("fc.", "midlayer.", "lm_head.", "norm."))]
    assert {"fc.weight", "midlayer.attn.wqkv.weight", "lm_head.weight"} <= set(want)
    for name in want:
        grad = named[name].grad
        assert grad is not None, name
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    assert not head.embed.weight.requires_grad and head.embed.weight.grad is None


def test_gradients_are_the_inference_chain_gradients(target: Transformer) -> None:
    """Step j's hidden is step j-1's output with its graph (not detached), as at inference."""
    head = _trainable(random_eagle3(target, draft_vocab_size=VD, seed=1))
    params = [p for p in head.parameters() if p.requires_grad]
    batch, p = _batch(target), ANCHORS[1]
    w = torch.randn(STEPS, VD, generator=torch.Generator().manual_seed(3))  # any linear readout
    out = ttt_forward(head, batch, steps=STEPS, keep_logp=True)
    assert out.logp is not None
    mine = torch.autograd.grad(
        sum((w[j] * lp[0, p]).sum() for j, lp in enumerate(out.logp)), params
    )
    ref = torch.autograd.grad(
        sum((w[j] * lp).sum() for j, lp in enumerate(_inference_chain(head, batch, p))), params
    )
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# end to end: train a few steps, save, load, decode losslessly


PROMPTS = [[5, 17, 33, 2, 8], [9, 1, 4], list(range(70, 79)), [100, 3], [44, 45, 46, 47]]
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (14, 9, 20, 16, 12)]


def _regenerated(
    target: Transformer, capture: tuple[int, ...]
) -> tuple[list[Sample], list[FeatureShard]]:
    """The target's own greedy answers to PROMPTS as samples (what regen.py writes), and their
    captured features, one FeatureShard per sample."""
    plain = collect_outputs(generate_stream(target, NullTokenizer(), PROMPTS, PARAMS))
    samples = [
        Sample(f"s{i}", p, o.token_ids, "length")
        for i, (p, o) in enumerate(zip(PROMPTS, plain, strict=True))
    ]
    keys = [s.key for s in samples]
    shard: FeatureShard = _concat(_capture_batch(target, samples, capture), keys)
    return samples, [shard.sample(i) for i in range(len(shard))]


class _Loaded:
    """What build_head reads of a loaded model."""

    def __init__(self, model: Transformer) -> None:
        self.model, self.config = model, model.cfg


@pytest.mark.parametrize("lm_head", ["trained", "target"])
def test_train_save_load_decode_losslessly(tmp_path: Path, lm_head: str) -> None:
    """The acceptance run: training lowers the loss, the saved head loads back bit for bit, and
    speculative decoding with it equals plain greedy decoding while accepting its drafts. With
    `lm_head` "target" (and a narrower MLP than the target's) the output rows stay the target's
    through training and are not written: the loaded head gathers them again."""
    target = tiny_target(0, vocab=V, layers=4)
    L = target.cfg.num_layers
    capture = default_capture(L)
    samples, feats = _regenerated(target, capture)
    vocab = build_draft_vocab([s.response for s in samples], VD, V)
    if lm_head == "trained":
        head = _trainable(random_eagle3(target, draft_vocab_size=VD, seed=1))
        head.d2t.copy_(vocab.d2t)
    else:
        rows = target.lm_head.weight[vocab.ids]
        head = build_head(
            _Loaded(target), rows, vocab, 3, "cpu", intermediate_size=48, lm_head="target"
        )
        assert head.cfg.intermediate_size == 48 and not head.lm_head.weight.requires_grad
    rows = head.lm_head.weight.detach().clone()
    # One batch, so every step sees the same data and the losses compare.
    one_batch = len(feats) * max(len(f.ids) for f in feats)
    cfg = TrainConfig(
        epochs=20, lr=1e-2, warmup_steps=2, ttt_steps=STEPS, dtype="float32", batch_tokens=one_batch
    )
    history = train(head, feats, vocab, target.lm_head.weight[vocab.ids], cfg)
    losses = [h.loss for h in history]  # each before its step's update
    assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.8 * losses[0]

    folder = save_eagle3(head.eval(), tmp_path / "draft", capture, num_target_layers=L)
    stored = load_file(str(folder / "model.safetensors"))
    if lm_head == "target":
        assert torch.equal(head.lm_head.weight, rows)  # frozen: the target's rows still
        assert torch.equal(rows, target.lm_head.weight[vocab.ids])
        assert "lm_head.weight" not in stored and "d2t" in stored
    else:
        assert not torch.equal(head.lm_head.weight, rows)  # trained
    loaded = load_eagle3(folder, target)
    assert loaded.capture == capture
    assert loaded.head.cfg.intermediate_size == head.cfg.intermediate_size
    mine = dict(loaded.head.named_parameters())
    for name, p in head.named_parameters():
        assert torch.equal(mine[name], p.detach()), name
    assert torch.equal(loaded.head.d2t, vocab.d2t)

    plain = collect_outputs(generate_stream(target, NullTokenizer(), PROMPTS, PARAMS))
    proposer = Eagle3Proposer(loaded.head, loaded.capture)
    spec = collect_outputs(
        generate_speculative(target, proposer, NullTokenizer(), PROMPTS, PARAMS, num_draft=3)
    )
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    # The trained head's drafts are accepted (a random head's almost never are: about 1.0), so
    # both the accept and the reject paths ran with the loaded head and its d2t.
    accept = [o.stats.mean_accept_length for o in spec]
    assert sum(accept) / len(accept) > 1.5, accept


def test_training_stops_at_its_deadline_and_keeps_the_part_epoch(tmp_path: Path) -> None:
    """`--train-seconds`: with a clock that moves a second at each reading (one reading made the
    deadline, one before each step), training takes exactly the steps that fit, then evaluates
    and checkpoints the part epoch; resuming without a deadline runs the rest of the schedule."""
    target = tiny_target(0, vocab=V, layers=4)
    samples, feats = _regenerated(target, default_capture(target.cfg.num_layers))
    vocab = build_draft_vocab([s.response for s in samples], VD, V)
    head = _trainable(random_eagle3(target, draft_vocab_size=VD, seed=1))
    head.d2t.copy_(vocab.d2t)
    cfg = TrainConfig(
        epochs=2, lr=1e-2, warmup_steps=1, ttt_steps=2, dtype="float32", batch_tokens=32
    )
    rows = target.lm_head.weight[vocab.ids]
    per_epoch = len(length_batches([len(f.ids) for f in feats], cfg.batch_tokens))
    assert per_epoch >= 3
    ticks = iter(range(10**6))
    deadline = Deadline.after(2.5, lambda: float(next(ticks)))  # made at 0: steps at 1 and 2
    epochs: list[int] = []
    ckpt = tmp_path / "checkpoint.pt"
    history = train(
        head, feats, vocab, rows, cfg, checkpoint=ckpt, on_epoch=epochs.append, deadline=deadline
    )
    assert [h.step for h in history] == [1, 2] and epochs == [0]
    assert torch.load(ckpt, weights_only=False)["step"] == 2
    rest = train(head, feats, vocab, rows, cfg, checkpoint=ckpt)
    assert [h.step for h in rest] == list(range(3, 2 * per_epoch + 1))


def test_train_dtype_auto_is_bf16_only_where_the_device_has_bf16_matmuls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--train-dtype auto` (the default): bf16 autocast where the device has bf16 matmul
    kernels, none (fp32) where it does not, as on an AVX2 CPU; an explicit dtype is kept."""
    cpu = torch.device("cpu")
    cfg = TrainConfig()
    assert cfg.dtype == "auto"
    for has, want in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(trainer, "has_bf16_matmul", lambda device, has=has: has)
        assert autocast_dtype("auto", cpu) == ("bfloat16" if has else "float32")
        assert autocast_dtype("float16", cpu) == "float16"
        with cfg.autocast(cpu):
            y = torch.ones(2, 2) @ torch.ones(2, 2)
        assert y.dtype == (want or torch.float32)
    with pytest.raises(ValueError, match="auto or one of"):
        TrainConfig(dtype="int8")


def test_regen_budget_leaves_the_summaries_their_share() -> None:
    """`--regen-seconds 100` with 300 prompt turns planned and 100 summaries and completions:
    the prompts' round is due at 75 s, the second round at 100 s; no budget, no deadline."""
    clock = lambda: 10.0  # noqa: E731
    prompts, extra = regen_deadlines(100.0, 300, 100, clock)
    assert (prompts.at, extra.at) == (85.0, 110.0)
    assert regen_deadlines(100.0, 300, 0, clock)[0].at == 110.0
    assert regen_deadlines(None, 300, 100) == (NEVER, NEVER)


def test_halfway_leaves_half_the_time_left() -> None:
    now = [10.0]
    due = Deadline(30.0, lambda: now[0])
    assert due.halfway().at == 20.0
    now[0] = 26.0
    assert due.halfway().at == 28.0 and not due.halfway().passed()
    now[0] = 31.0
    assert due.halfway().passed() and due.halfway().at == 31.0
    assert NEVER.halfway() is NEVER


def test_a_resumed_run_plans_only_the_turns_not_yet_answered() -> None:
    convs = [Conversation(("a",), "f:1"), Conversation(("b", "c"), "f:2")]
    assert turns_to_answer(convs, set()) == 3
    assert turns_to_answer(convs, {"f:1#0", "f:2#0", "other#0"}) == 1
    assert turns_to_answer(convs, {"f:1#0", "f:2#0", "f:2#1"}) == 0


def test_truncated_json_array_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "cut.json"
    path.write_text('[{"conversations": [{"from": "human", "value": "Hi"}]},\n {"conversa')
    with pytest.raises(InvalidRequestError, match="cut.json: not valid JSON"):
        read_conversations(path)


def test_length_batches_docstring_example_and_row_cap() -> None:
    assert length_batches([5, 2, 3, 9], 8) == [[1, 2], [0], [3]]
    assert length_batches([1] * 5, 100, max_rows=2) == [[0, 1], [2, 3], [4]]


def test_a_killed_runs_half_written_line_is_dropped_before_resuming(tmp_path: Path) -> None:
    """regen and synth append one JSON line per item; a run killed mid-write leaves a partial
    last line, which resuming cuts off (and appends after) instead of failing to parse it."""
    path = tmp_path / "responses.jsonl"
    path.write_text('{"key": "a"}\n{"key": "b"}\n{"key": "c", "resp')
    assert drop_partial_tail(path) == len('{"key": "c", "resp')
    assert [d["key"] for d in read_jsonl(path)] == ["a", "b"]
    with path.open("a") as f:
        f.write('{"key": "c"}\n')
    assert [d["key"] for d in read_jsonl(path)] == ["a", "b", "c"]
    assert drop_partial_tail(path) == 0  # a complete file is left alone
    assert drop_partial_tail(tmp_path / "missing.jsonl") == 0
