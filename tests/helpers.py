"""Small shared test helpers: a tokenizer stand-in, tiny seeded random targets, and an LLM over
the tiny Hugging Face folder with a random EAGLE-3 head."""

from __future__ import annotations

from pathlib import Path

import torch

from eaglespec.config import ModelConfig, SamplingParams, TreeConfig
from eaglespec.generate import generate_stream
from eaglespec.llm import LLM
from eaglespec.model.llama import Transformer
from eaglespec.requests import collect_outputs

TINY_TREE = TreeConfig(depth=2, top_k=2, num_nodes=3)


def tiny_adaptive_llm(folder: Path, compile: str = "none") -> LLM:
    """The tiny folder's model (`tiny_hf_folder`) drafting with a seeded random EAGLE-3 head:
    chains of up to 2 and TINY_TREE, chosen by the adaptive policy (never stopped on the head's
    doubt: a random head doubts every chain)."""
    return LLM(
        str(folder),
        progress=False,
        method="eagle3",
        draft="random",
        num_draft=2,
        tree=TINY_TREE,
        compile=compile,
        speculation="adaptive",
        lookup_tokens=0,
        draft_min_prob=0.0,
    )


class NullTokenizer:
    """Enough of a tokenizer for the decoding loops: no EOS, the text of id i is "<i>"."""

    eos_ids: tuple[int, ...] = ()

    def stream_decoder(self, prompt_ids=()):
        class _Decoder:
            def push(self, tid: int) -> str:
                return f"<{tid}>"

            def flush(self) -> str:
                return ""

        return _Decoder()


def tiny_target(
    seed: int,
    *,
    vocab: int,
    layers: int = 6,
    hidden: int = 64,
    kv_heads: int = 2,
    max_position: int = 256,
    tied: bool = False,
    wide_init: bool = True,
) -> Transformer:
    """A Llama-family target with 4 query heads. `wide_init` draws weights from N(0, 0.3) and
    norms from U(0.8, 1.2), so greedy continuations vary (the default init is nearly uniform)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        family="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=kv_heads,
        head_dim=hidden // 4,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position=max_position,
        tie_word_embeddings=tied,
    )
    model = Transformer(cfg).eval().requires_grad_(False)
    if wide_init:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    return model


# Forwards over two ragged rows after a 6-token prefill (row 1 keeps 3 entries): one-token steps,
# a 3-token tree (a root and two siblings, each row keeping a different path length), one more
# step. Each item: new token ids (B, T), the tree mask among them or None, entries kept per row.
RAGGED_PROMPTS = torch.tensor([[5, 17, 33, 2, 8, 1], [9, 1, 4, 0, 0, 0]])
RAGGED_KEEP = [6, 3]


def ragged_steps() -> list[tuple[torch.Tensor, torch.Tensor | None, list[int]]]:
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3)
    return [
        (torch.tensor([[7], [8]]), None, [1, 1]),
        (torch.tensor([[3], [4]]), None, [1, 1]),
        (torch.tensor([[11, 12, 13], [21, 22, 23]]), tree, [2, 1]),
        (torch.tensor([[30], [31]]), None, [1, 1]),
    ]


def step_positions(lengths: list[int], mask: torch.Tensor | None, num_new: int) -> torch.Tensor:
    """RoPE positions (B, T) of a ragged step: each row's length, plus tree depths (root 0,
    siblings 1) under a tree mask."""
    depth = torch.tensor([0, 1, 1])[:num_new] if mask is not None else torch.zeros(1)
    return torch.tensor(lengths)[:, None] + depth.long()[None]


def _first_lap(tokens: list[int]) -> int:
    """End of the first full lap of an eventually periodic sequence: the cycle starts at p with
    period c, so tokens[: p + c] holds one whole lap."""
    for c in range(1, len(tokens) // 2):
        if all(tokens[j] == tokens[j + c] for j in range(len(tokens) - 2 * c, len(tokens) - c)):
            p = len(tokens) - 2 * c
            while p > 0 and tokens[p - 1] == tokens[p - 1 + c]:
                p -= 1
            return p + c
    raise AssertionError(f"no cycle in {tokens}")


def cycling_target(prompts: list[list[int]], vocab: int) -> tuple[Transformer, list[list[int]]]:
    """A target whose attention is zeroed: each next token depends on the current token only, so
    greedy decoding follows a map on the vocabulary and falls into a cycle. The returned prompts
    hold one lap of it, so the latest earlier occurrence of any suffix is followed by the right
    tokens (prompt lookup is always right)."""
    bigram = tiny_target(5, vocab=vocab, layers=2)
    with torch.no_grad():
        for block in bigram.layers:
            block.attn.wo.weight.zero_()
    params = [SamplingParams(max_tokens=60, ignore_eos=True) for _ in prompts]
    plain = collect_outputs(generate_stream(bigram, NullTokenizer(), prompts, params))
    laps = [p + o.token_ids[: _first_lap(o.token_ids)] for p, o in zip(prompts, plain, strict=True)]
    return bigram, laps
