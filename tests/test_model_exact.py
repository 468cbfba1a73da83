"""The runtime's logits and captured hidden states equal transformers' on tiny random models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eaglespec.config import ModelConfig
from eaglespec.model.checkpoint import HFCheckpoint
from eaglespec.model.llama import Transformer
from eaglespec.model.loader import build_model

transformers = pytest.importorskip("transformers")

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
VARIANTS = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-mha-tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"num_key_value_heads": 4, "tie_word_embeddings": True},
    ),
    "llama3-scaling": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096, "head_dim": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    # Gemma 3: a window of 6 keys, shorter than every test's sequence, on three of four layers
    # (each kind with its own RoPE base), and a query scale other than head_dim ** -0.5.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 32,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention"] + ["sliding_attention"] * 2,
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        },
    ),
    # the larger Gemma 3s' layout: linear RoPE scaling on the global layers only, the local
    # base given as rope_local_base_freq (transformers 4.x keys), two global layers
    "gemma3-scaled": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 5,
            "sliding_window_pattern": 2,
            "rope_theta": 500_000.0,
            "rope_local_base_freq": 20_000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        },
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(hf_model, our_model) with identical random weights, saved and reloaded through
    safetensors."""
    config_cls, model_cls, extra = VARIANTS[request.param]
    torch.manual_seed(0)
    hf_cfg = getattr(transformers, config_cls)(**{**BASE, **extra})
    hf = getattr(transformers, model_cls)(hf_cfg).eval()
    with torch.no_grad():  # HF inits biases and norms to constants; make every tensor matter
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path: Path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ckpt = HFCheckpoint.open(path)
    cfg = ModelConfig.from_hf_dict(ckpt.config)
    ours = build_model(ckpt, cfg, torch.float32, torch.device("cpu"))
    return hf, ours


def _positions(start: int, length: int, batch: int = 1) -> torch.Tensor:
    return torch.arange(start, start + length).expand(batch, length)


def test_prefill_logits_and_hidden_states_match(pair) -> None:
    hf, ours = pair
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    L = ours.cfg.num_layers
    out = ours(ids, _positions(0, 19, 2), ours.new_cache(2, 64), capture=range(L + 1))
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
    for b in range(L):  # HF hidden_states[b] for b < L is the pre-norm residual after b layers
        torch.testing.assert_close(out.hidden[b], ref.hidden_states[b], atol=1e-5, rtol=1e-5)
    # b = L is the pre-norm state; HF's last entry is post-norm, so compare after our final norm.
    torch.testing.assert_close(ours.norm(out.hidden[L]), ref.hidden_states[L], atol=1e-5, rtol=1e-5)


def test_incremental_decoding_equals_full_forward(pair) -> None:
    _, ours = pair
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(2))
    full = ours(ids, _positions(0, 24), ours.new_cache(1, 32)).logits
    cache = ours.new_cache(1, 32)
    chunks = [(0, 10), (10, 11), (11, 17), (17, 18), (18, 24)]  # prefill, single steps, chunks
    for a, b in chunks:
        step = ours(ids[:, a:b], _positions(a, b - a), cache).logits
        cache.advance([b - a])
        torch.testing.assert_close(step, full[:, a:b], atol=1e-4, rtol=1e-4)


def test_ragged_batch_rows_equal_their_solo_runs(pair) -> None:
    _, ours = pair
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (5, 12, 9)]
    T = max(len(p) for p in prompts)
    ids = torch.zeros(3, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    cache = ours.new_cache(3, 32)
    out = ours(ids, _positions(0, T, 3), cache).logits
    cache.advance([len(p) for p in prompts])
    nxt = torch.tensor([[7], [8], [9]])
    pos = torch.tensor([[len(p)] for p in prompts])
    step = ours(nxt, pos, cache).logits
    for b, p in enumerate(prompts):
        solo = ours(torch.cat([p, nxt[b]])[None], _positions(0, len(p) + 1), ours.new_cache(1, 32))
        torch.testing.assert_close(out[b, : len(p)], solo.logits[0, : len(p)], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(step[b, 0], solo.logits[0, -1], atol=1e-4, rtol=1e-4)


def test_logit_index_projects_only_requested_columns(pair) -> None:
    _, ours = pair
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(4))
    full = ours(ids, _positions(0, 8, 2), ours.new_cache(2, 16)).logits
    idx = torch.tensor([[7], [3]])
    some = ours(ids, _positions(0, 8, 2), ours.new_cache(2, 16), logit_index=idx).logits
    torch.testing.assert_close(some[:, 0], torch.stack([full[0, 7], full[1, 3]]))


def test_tree_mask_equals_each_path_alone(pair) -> None:
    """Two branches after a shared prefix, verified in one forward with a tree mask."""
    _, ours = pair
    prefix = torch.tensor([[3, 14, 15, 92, 65]])
    #   root(0) ─┬─ a(1) ── b(2)       depth: root 0, a 1, b 2, c 1
    #            └─ c(3)
    tree = torch.tensor([[11, 22, 33, 44]])
    depth = torch.tensor([[0, 1, 2, 1]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)[
        None
    ]
    cache = ours.new_cache(1, 16)
    ours(prefix, _positions(0, 5), cache)
    cache.advance([5])
    out = ours(tree, 5 + depth, cache, attn_mask=mask).logits
    for path in ([0, 1, 2], [0, 3]):
        seq = torch.cat([prefix, tree[:, path]], dim=1)
        solo = ours(seq, _positions(0, seq.shape[1]), ours.new_cache(1, 16)).logits
        torch.testing.assert_close(out[0, path], solo[0, 5:], atol=1e-4, rtol=1e-4)


def test_config_rejects_unknown_architecture() -> None:
    from eaglespec.errors import UnsupportedArchitectureError

    cfg = {**BASE, "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}
    with pytest.raises(UnsupportedArchitectureError, match="GPTNeoXForCausalLM"):
        ModelConfig.from_hf_dict(cfg)


def test_meta_build_leaves_nothing_on_meta(pair) -> None:
    _, ours = pair
    assert isinstance(ours, Transformer)
    assert not any(t.is_meta for t in [*ours.parameters(), *ours.buffers()])
