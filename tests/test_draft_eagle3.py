"""EAGLE-3 draft head: published checkpoint layouts, an independent reference forward, the cache
protocol (incremental and tree-masked), RoPE base, capture resolution, d2t, sharing with the
target, every bad-input error, and save/load round trips. Tiny seeded models, CPU, fp32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from draft_fixtures import (
    N_LAYERS,
    VD,
    C,
    DraftSpec,
    RefFlags,
    V,
    draft_tensors,
    native_config,
    reference_draft,
    speculators_config,
    tiny_target,
    write_draft,
)
from eaglespec.cache import KVCache
from eaglespec.draft import (
    DraftConfig,
    Eagle3Head,
    load_eagle3,
    random_eagle3,
    resolve_capture_layers,
    save_eagle3,
)
from eaglespec.errors import InvalidRequestError, ModelLoadError
from eaglespec.model.layers import rope_inv_freq
from eaglespec.model.llama import Transformer


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_target()


def _inputs(B: int, T: int, num_aux: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    aux = [torch.randn(B, T, C, generator=g) for _ in range(num_aux)]
    return ids, aux


def _positions(B: int, T: int, start: int = 0) -> torch.Tensor:
    return (start + torch.arange(T)).expand(B, T)


def _run(head: Eagle3Head, ids: torch.Tensor, hidden: torch.Tensor, **kw: Any) -> Any:
    B, T = ids.shape
    cache = head.new_cache(B, 64)
    return head(ids, hidden, _positions(B, T), cache, **kw)


def _check_reference(
    head: Eagle3Head,
    tensors: dict[str, torch.Tensor],
    target: Transformer,
    flags: RefFlags,
    num_aux: int,
) -> None:
    ids, aux = _inputs(2, 7, num_aux)
    out = _run(head, ids, head.combine(aux))
    ref_logits, ref_state = reference_draft(tensors, target, flags, ids, aux, _positions(2, 7))
    assert out.logits.dtype == torch.float32
    _close(out.logits, ref_logits)
    _close(out.prenorm, ref_state)


# ------------------------------------------------------------------------- published layouts


@pytest.mark.parametrize("fmt", ["st", "bin"])
@pytest.mark.parametrize("arch", ["LlamaForCausalLMEagle3", "LlamaForCausalLM"])
def test_native_layout_matches_reference(
    target: Transformer, tmp_path: Path, fmt: str, arch: str
) -> None:
    tensors = draft_tensors(DraftSpec())
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["fc.weight"].dtype == torch.float16
    folder = write_draft(tmp_path / "draft", native_config(arch), tensors, fmt)
    loaded = load_eagle3(folder, target)
    assert loaded.format == "native"
    assert loaded.capture == (2, N_LAYERS // 2, N_LAYERS - 3)
    assert loaded.report.weights.name == (
        "model.safetensors" if fmt == "st" else "pytorch_model.bin"
    )
    assert loaded.head.dtype == torch.float32  # the target's dtype
    _check_reference(loaded.head, tensors, target, RefFlags(), 3)


VARIANTS: dict[str, tuple[DraftSpec, dict[str, Any], RefFlags]] = {
    "norm_before_residual": (
        DraftSpec(),
        {"norm_before_residual": True},
        RefFlags(norm_before_residual=True),
    ),
    "fc_norm": (DraftSpec(fc_norm=True), {"fc_norm": True}, RefFlags(fc_norm=True)),
    "norm_before_fc": (
        DraftSpec(norm_before_fc=True),
        {"eagle_config": {"norm_before_fc": True}},
        RefFlags(norm_before_fc=True),
    ),
    "multi_layer_midlayers": (
        DraftSpec(num_layers=3),
        {"num_hidden_layers": 3},
        RefFlags(num_layers=3),
    ),
    "multi_layer_layers_names": (
        DraftSpec(num_layers=2, layer_prefix="layers", extra_prefix="layers"),
        {"num_hidden_layers": 2},
        RefFlags(num_layers=2, prefix="layers.0", extra_prefix="layers"),
    ),
    "fc_bias": (DraftSpec(fc_bias=True), {"bias": True}, RefFlags()),
    "specforge_no_final_norm": (DraftSpec(), {"norm_output": False}, RefFlags(final_norm=False)),
    "four_states": (
        DraftSpec(num_aux=4),
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4, 5]}},
        RefFlags(),
    ),
    "rope_theta_explicit": (DraftSpec(), {"rope_theta": 500000.0}, RefFlags(rope_theta=500000.0)),
    "no_gqa": (DraftSpec(kv_heads=4), {"num_key_value_heads": 4}, RefFlags(kv_heads=4)),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_match_reference(target: Transformer, tmp_path: Path, name: str) -> None:
    spec, changes, flags = VARIANTS[name]
    tensors = draft_tensors(spec)
    folder = write_draft(tmp_path / name, native_config(**changes), tensors)
    loaded = load_eagle3(folder, target)
    assert loaded.head.num_aux == spec.num_aux == len(loaded.capture)
    _check_reference(loaded.head, tensors, target, flags, spec.num_aux)


def test_speculators_layout(target: Transformer, tmp_path: Path) -> None:
    spec = DraftSpec(layer_prefix="layers", dtype=torch.bfloat16)
    spec.extra = {
        "verifier_lm_head.weight": torch.randn(VD, C).bfloat16(),
        "verifier_norm.weight": torch.ones(C).bfloat16(),
    }
    tensors = draft_tensors(spec)
    config = speculators_config(eagle_aux_hidden_state_layer_ids=[1, 3, 5], norm_output=True)
    loaded = load_eagle3(write_draft(tmp_path / "spec", config, tensors), target)
    cfg = loaded.config
    assert loaded.format == "speculators"
    assert cfg.norm_before_residual  # speculators' default when the key is absent
    assert cfg.feed_normed and cfg.final_norm  # vLLM's norm_output: post-norm state fed back
    assert loaded.capture == (1, 3, 5)  # top-level ids are boundaries, even with a first id of 1
    assert cfg.hidden_size == C and cfg.vocab_size == V and cfg.draft_vocab_size == VD
    flags = RefFlags(norm_before_residual=True, feed_normed=True, prefix="layers.0")
    _check_reference(loaded.head, tensors, target, flags, 3)


def test_speculators_defaults(target: Transformer, tmp_path: Path) -> None:
    """Null ids -> default capture; norm_before_residual written false is honoured."""
    config = speculators_config(norm_before_residual=False)
    tensors = draft_tensors(DraftSpec(layer_prefix="layers"))
    loaded = load_eagle3(write_draft(tmp_path / "spec", config, tensors), target)
    assert loaded.capture == (2, 3, 3) and not loaded.config.norm_before_residual
    assert not loaded.config.feed_normed
    _check_reference(loaded.head, tensors, target, RefFlags(prefix="layers.0"), 3)


def test_target_features_end_to_end(target: Transformer, tmp_path: Path) -> None:
    """The target's captured states feed combine(); alignment pairs x_{p+1} with g_p."""
    tensors = draft_tensors(DraftSpec())
    loaded = load_eagle3(write_draft(tmp_path / "d", native_config(), tensors), target)
    prompt = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(3))
    t_out = target(prompt, _positions(1, 9), target.new_cache(1, 16), capture=loaded.capture)
    ids = prompt[:, 1:]  # x_{p+1}
    aux = [h[:, :-1] for h in t_out.hidden]  # g_p
    out = _run(loaded.head, ids, loaded.head.combine(aux))
    ref, _ = reference_draft(tensors, target, RefFlags(), ids, aux, _positions(1, 8))
    _close(out.logits, ref)


def test_no_aux_hidden_state(target: Transformer, tmp_path: Path) -> None:
    tensors = draft_tensors(DraftSpec())
    del tensors["fc.weight"]
    config = native_config(eagle_config={"use_aux_hidden_state": False})
    loaded = load_eagle3(write_draft(tmp_path / "d", config, tensors), target)
    assert loaded.capture == (N_LAYERS,) and loaded.head.fc is None
    ids, (g,) = _inputs(1, 5, 1)
    assert loaded.head.combine([g]) is g
    out = _run(loaded.head, ids, g)
    ref, _ = reference_draft(tensors, target, RefFlags(use_fc=False), ids, [g], _positions(1, 5))
    _close(out.logits, ref)


# --------------------------------------------------------------------------- cache protocol


@pytest.fixture(scope="module")
def head(target: Transformer, tmp_path_factory: pytest.TempPathFactory) -> Eagle3Head:
    folder = tmp_path_factory.mktemp("draft")
    spec = DraftSpec(num_layers=2)  # two layers: both cache layers are exercised
    config = native_config(num_hidden_layers=2)
    return load_eagle3(write_draft(folder, config, draft_tensors(spec)), target).head


def _copy(cache: KVCache) -> KVCache:
    return KVCache(k=cache.k.clone(), v=cache.v.clone(), lengths=list(cache.lengths))


def test_incremental_equals_full(head: Eagle3Head) -> None:
    ids, (g,) = _inputs(1, 9, 1, seed=5)
    full = _run(head, ids, g)
    cache = head.new_cache(1, 16)
    logits, states, start = [], [], 0
    for n in (4, 1, 3, 1):
        out = head(
            ids[:, start : start + n], g[:, start : start + n], _positions(1, n, start), cache
        )
        cache.advance([n])
        logits.append(out.logits)
        states.append(out.prenorm)
        start += n
    _close(torch.cat(logits, 1), full.logits)
    _close(torch.cat(states, 1), full.prenorm)


def test_ragged_rows_equal_each_row_alone(head: Eagle3Head) -> None:
    """Row 0 runs 9 tokens, row 1 7; after the second chunk row 1 keeps 1 of 3 new entries."""
    ids, (g,) = _inputs(2, 9, 1, seed=6)
    cache = head.new_cache(2, 16)
    head(ids[:, :4], g[:, :4], _positions(2, 4), cache)
    cache.advance([4, 4])
    out_b = head(ids[:, 4:7], g[:, 4:7], _positions(2, 3, 4), cache)
    cache.advance([3, 1])
    # row 1 continues from its committed length 5 with its own tokens 5, 6
    ids_c = torch.stack([ids[0, 7:9], ids[1, 5:7]])
    g_c = torch.stack([g[0, 7:9], g[1, 5:7]])
    pos_c = torch.tensor([[7, 8], [5, 6]])
    out_c = head(ids_c, g_c, pos_c, cache)
    alone0 = _run(head, ids[:1], g[:1])
    alone1 = _run(head, ids[1:, :7], g[1:, :7])
    _close(out_b.logits[0], alone0.logits[0, 4:7])
    _close(out_c.logits[0], alone0.logits[0, 7:9])
    _close(out_b.logits[1, :1], alone1.logits[0, 4:5])
    _close(out_c.logits[1], alone1.logits[0, 5:7])


def test_tree_mask_equals_each_path(head: Eagle3Head) -> None:
    #        0            parents [-1, 0, 0, 1, 1, 2], depths [0, 1, 1, 2, 2, 2]
    #      /   \          positions = prefix length (5) + depth
    #     1     2
    #    / \     \
    #   3   4     5
    parents = [-1, 0, 0, 1, 1, 2]
    paths = []
    for i in range(len(parents)):
        path: list[int] = []
        j = i
        while j >= 0:
            path.insert(0, j)
            j = parents[j]
        paths.append(path)
    N, P = len(parents), 5
    mask = torch.zeros(1, N, N, dtype=torch.bool)
    for i, path in enumerate(paths):
        mask[0, i, path] = True
    depth = torch.tensor([[len(p) - 1 for p in paths]])
    ids, (g,) = _inputs(1, P + N, 1, seed=7)
    cache = head.new_cache(1, 32)
    head(ids[:, :P], g[:, :P], _positions(1, P), cache)
    cache.advance([P])
    tree = head(ids[:, P:], g[:, P:], P + depth, _copy(cache), attn_mask=mask)
    for i, path in enumerate(paths):
        cols = [P + j for j in path]
        alone = head(ids[:, cols], g[:, cols], _positions(1, len(path), P), _copy(cache))
        _close(tree.logits[:, i], alone.logits[:, -1])
        _close(tree.prenorm[:, i], alone.prenorm[:, -1])


def test_logit_index_and_draft_chain(head: Eagle3Head) -> None:
    """logit_index selects columns; a draft step feeds back prenorm without fc."""
    ids, (g,) = _inputs(2, 6, 1, seed=8)
    full = _run(head, ids, g)
    last = torch.tensor([[5], [3]])
    picked = _run(head, ids, g, logit_index=last)
    _close(picked.logits[:, 0], full.logits[[0, 1], [5, 3]])
    cache = head.new_cache(1, 16)
    first = head(ids[:1], g[:1], _positions(1, 6), cache)
    cache.advance([6])
    token = head.to_target(first.logits[:, -1].argmax(-1))[:, None]
    step = head(token, first.prenorm[:, -1:], torch.tensor([[6]]), cache)
    again = _run(head, torch.cat([ids[:1], token], 1), torch.cat([g[:1], first.prenorm[:, -1:]], 1))
    _close(step.logits[:, 0], again.logits[:, -1])


# ------------------------------------------------------------------------- RoPE, capture, d2t


def test_rope_base_is_the_drafts_own(target: Transformer, tmp_path: Path) -> None:
    """Pitfall: the official drafts have no rope_theta and must run at 10000, not the target's."""
    assert target.cfg.rope_theta == 100000.0
    tensors = draft_tensors(DraftSpec())
    loaded = load_eagle3(write_draft(tmp_path / "d", native_config(), tensors), target)
    assert loaded.config.rope_theta == 10000.0
    torch.testing.assert_close(loaded.head.inv_freq, rope_inv_freq(16, 10000.0, None))
    ids, aux = _inputs(1, 12, 3)
    out = _run(loaded.head, ids, loaded.head.combine(aux))
    pos = _positions(1, 12)
    right, _ = reference_draft(tensors, target, RefFlags(rope_theta=10000.0), ids, aux, pos)
    wrong, _ = reference_draft(tensors, target, RefFlags(rope_theta=100000.0), ids, aux, pos)
    _close(out.logits, right)
    assert not torch.allclose(out.logits, wrong, atol=1e-3)


def test_rope_theta_sources() -> None:
    base = native_config()
    assert DraftConfig.from_dict(base).rope_theta == 10000.0
    v5 = native_config(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert DraftConfig.from_dict(v5).rope_theta == 1e6
    scaled = native_config(
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
        },
    )
    cfg = DraftConfig.from_dict(scaled)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is not None
    assert cfg.rope_scaling.kind == "llama3"
    spec = speculators_config()
    spec["transformer_layer_config"]["rope_theta"] = 123.0
    assert DraftConfig.from_dict(spec).rope_theta == 123.0


@pytest.mark.parametrize(
    ("changes", "expected", "convention"),
    [
        ({}, (2, 18, 33), "default"),
        (
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 32]}},
            (2, 18, 33),
            "output-of-layer",
        ),
        (
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 18, 33]}},
            (2, 18, 33),
            "boundary",
        ),
        ({"eagle_aux_hidden_state_layer_ids": [1, 18, 35]}, (1, 18, 35), "boundary"),
        (
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 35]}},
            (2, 18, 36),
            "output-of-layer",
        ),
        ({"eagle_config": {"use_aux_hidden_state": False}}, (36,), "default"),
    ],
)
def test_capture_resolution_table(
    changes: dict[str, Any], expected: tuple[int, ...], convention: str
) -> None:
    cfg = DraftConfig.from_dict(native_config(**changes))
    assert cfg.aux_layer_convention == convention
    assert resolve_capture_layers(cfg, 36) == expected


def test_capture_override_and_range() -> None:
    cfg = DraftConfig.from_dict(native_config())
    assert resolve_capture_layers(cfg, 36, override=(1, 2, 3)) == (1, 2, 3)  # as given
    assert resolve_capture_layers(cfg, 36, override=[0, 36, 5]) == (0, 36, 5)
    with pytest.raises(InvalidRequestError, match=r"override \[2, 37, 3\]"):
        resolve_capture_layers(cfg, 36, override=(2, 37, 3))
    past = DraftConfig.from_dict(
        native_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 17, 36]}),
        source="drafts/x/config.json",
    )
    with pytest.raises(ModelLoadError, match=r"drafts/x/config.json: capture boundary 37"):
        resolve_capture_layers(past, 36)


def test_capture_override_at_load(target: Transformer, tmp_path: Path) -> None:
    folder = write_draft(tmp_path / "d", native_config(), draft_tensors(DraftSpec()))
    loaded = load_eagle3(folder, target, capture=(0, 3, 6))
    assert loaded.capture == (0, 3, 6)
    assert loaded.report.capture_origin.startswith("override")


def test_d2t_maps_draft_ids_to_target_ids(target: Transformer, tmp_path: Path) -> None:
    tensors = draft_tensors(DraftSpec())
    head = load_eagle3(write_draft(tmp_path / "d", native_config(), tensors), target).head
    used = torch.arange(VD) + tensors["d2t"]
    assert torch.equal(head.d2t, tensors["d2t"])
    assert torch.equal(head.to_target(torch.arange(VD)), used)
    assert torch.equal(used, tensors["t2d"].nonzero()[:, 0])
    picks = torch.tensor([[0, 5], [VD - 1, 7]])
    assert torch.equal(head.to_target(picks), used[picks])


# --------------------------------------------------------------------------- sharing, bytes


def test_embedding_shared_and_own_lm_head(target: Transformer, tmp_path: Path) -> None:
    loaded = load_eagle3(
        write_draft(tmp_path / "d", native_config(), draft_tensors(DraftSpec())), target
    )
    head, report = loaded.head, loaded.report
    assert head.embed.weight is target.embed.weight
    assert head.embed.weight.data_ptr() == target.embed.weight.data_ptr()
    assert head.lm_head.weight is not target.lm_head.weight
    assert report.shared == ("embed_tokens",)
    assert report.shared_bytes == V * C * 4
    own = sum(p.numel() * 4 for p in head.parameters() if p is not target.embed.weight)
    assert report.own_bytes == own + VD * 8 + 8 * 4  # + int64 d2t and fp32 inv_freq (D/2)
    assert target.embed.weight.requires_grad is False


def test_lm_head_inherited_without_one(target: Transformer, tmp_path: Path) -> None:
    tensors = draft_tensors(DraftSpec(draft_vocab=None))
    config = native_config(draft_vocab_size=None)
    loaded = load_eagle3(write_draft(tmp_path / "d", config, tensors), target)
    head = loaded.head
    assert head.lm_head is target.lm_head and head.lm_head.weight is target.lm_head.weight
    assert loaded.report.shared == ("embed_tokens", "lm_head")
    assert loaded.report.shared_bytes == 2 * V * C * 4
    assert torch.equal(head.to_target(torch.arange(V)), torch.arange(V))  # identity d2t
    _check_reference(head, tensors, target, RefFlags(), 3)


def test_lm_head_of_the_targets_rows_is_not_stored(target: Transformer, tmp_path: Path) -> None:
    """A head whose output layer is the target's rows of its draft vocabulary (trained frozen,
    `eaglespec train --lm-head target`): saved without lm_head.weight but with d2t, loaded with
    those rows gathered from the target, computing what it computed before it was saved."""
    head = random_eagle3(target, draft_vocab_size=VD, seed=5)
    ids = torch.arange(VD) + head.d2t  # (VD,) target ids
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[ids])
    head.lm_head_is_target_rows = True
    folder = save_eagle3(head, tmp_path / "rows", (2, 3, 3), num_target_layers=N_LAYERS)
    stored = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in stored and torch.equal(stored["d2t"], head.d2t)
    loaded = load_eagle3(folder, target)
    assert loaded.head.lm_head_is_target_rows and loaded.head.lm_head is not target.lm_head
    assert torch.equal(loaded.head.lm_head.weight, target.lm_head.weight[ids])
    assert loaded.report.shared == ("embed_tokens", "lm_head rows")
    assert loaded.report.shared_bytes == (V + VD) * C * 4
    x, aux = _inputs(2, 6, 3)
    a = _run(head, x, head.combine(aux))
    b = _run(loaded.head, x, loaded.head.combine(aux))
    torch.testing.assert_close(a.logits, b.logits, atol=0, rtol=0)
    # Saved again (export does so), the rows stay the target's: still not stored.
    again = load_file(
        str(save_eagle3(loaded.head, tmp_path / "again", (2, 3, 3)) / "model.safetensors")
    )
    assert "lm_head.weight" not in again


def test_embedding_equal_to_targets_is_shared(target: Transformer, tmp_path: Path) -> None:
    same = DraftSpec(
        dtype=torch.float32, extra={"embed_tokens.weight": target.embed.weight.clone()}
    )
    loaded = load_eagle3(write_draft(tmp_path / "a", native_config(), draft_tensors(same)), target)
    assert loaded.head.embed.weight is target.embed.weight
    own_spec = DraftSpec(embed=True)
    tensors = draft_tensors(own_spec)
    loaded = load_eagle3(write_draft(tmp_path / "b", native_config(), tensors), target)
    assert loaded.head.embed.weight is not target.embed.weight
    assert loaded.report.shared == ()
    _check_reference(loaded.head, tensors, target, RefFlags(), 3)


# ------------------------------------------------------------------------------- bad inputs


def _edit_tensors(t: dict[str, torch.Tensor], case: str) -> None:
    if case == "d2t_outside":
        t["d2t"][-1] += V
    elif case == "d2t_duplicate":
        t["d2t"][1] = t["d2t"][0] - 1  # draft ids 0 and 1 -> the same target id
    elif case == "d2t_length":
        t["d2t"] = t["d2t"][:-1]
    elif case == "missing":
        del t["midlayer.mlp.down_proj.weight"]
    elif case == "shape":
        t["midlayer.self_attn.k_proj.weight"] = t["midlayer.self_attn.k_proj.weight"][:16]
    elif case == "fc_in_dim":
        t["fc.weight"] = torch.zeros(C, 4 * C, dtype=torch.float16)
    elif case == "no_d2t":
        del t["d2t"]
    elif case == "unexpected":
        t["midlayer.self_attn.q_norm.weight"] = torch.ones(16, dtype=torch.float16)


BAD_CONFIG: dict[str, tuple[dict[str, Any], str]] = {
    "target_hidden": ({"target_hidden_size": 96}, r"target_hidden_size 96 .*hidden size 64"),
    "vocab": ({"vocab_size": 300}, r"vocab_size 300 != the target's vocabulary 256"),
    "capture_past_n": (
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 9]}},
        r"capture boundary 9 .*outside \[0, 6\]",
    ),
    "capture_past_n_output_of_layer": (
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}},
        r"capture boundary 7 from eagle_config.* id 6 \(output-of-layer\)",
    ),
}
BAD_WEIGHTS: dict[str, tuple[dict[str, Any], str | None, str]] = {
    "hidden_without_embed": (
        {"hidden_size": 96, "target_hidden_size": 64},
        None,
        r"no embed_tokens.weight, and the draft's hidden size 96 differs from the target's 64",
    ),
    "d2t_outside": ({}, "d2t_outside", r"d2t maps draft id 95 to target id \d+, outside .*256"),
    "d2t_duplicate": ({}, "d2t_duplicate", r"several draft ids to target id \d+ .*unique"),
    "d2t_length": ({}, "d2t_length", r"d2t has 95 entries, draft_vocab_size is 96"),
    "missing": ({}, "missing", r"missing tensor 'midlayer.mlp.down_proj.weight'"),
    "shape": (
        {},
        "shape",
        r"'midlayer.self_attn.k_proj.weight' has shape \(16, 128\), expected \(32, 128\)",
    ),
    "fc_in_dim": ({}, "fc_in_dim", r"fc.weight has in-dim 256, .*\[2, 3, 3\] gives 3 states .*192"),
    "fc_vs_override": ({}, None, r"fc.weight has in-dim 192, .*\[1, 2\] gives 2 states"),
    "no_d2t": ({}, "no_d2t", r"missing tensor 'd2t'"),
    "unexpected": ({}, "unexpected", r"unexpected tensor 'midlayer.self_attn.q_norm.weight'"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIG))
def test_bad_config_names_config_json(target: Transformer, tmp_path: Path, case: str) -> None:
    changes, pattern = BAD_CONFIG[case]
    folder = write_draft(tmp_path / case, native_config(**changes), draft_tensors(DraftSpec()))
    with pytest.raises(ModelLoadError, match=pattern) as info:
        load_eagle3(folder, target)
    msg = str(info.value)
    assert msg.startswith(str(folder / "config.json")) and "\n" not in msg


@pytest.mark.parametrize("fmt", ["st", "bin"])
@pytest.mark.parametrize("case", list(BAD_WEIGHTS))
def test_bad_weights_name_the_file(
    target: Transformer, tmp_path: Path, case: str, fmt: str
) -> None:
    changes, edit, pattern = BAD_WEIGHTS[case]
    tensors = draft_tensors(DraftSpec())
    if edit:
        _edit_tensors(tensors, edit)
    folder = write_draft(tmp_path / case, native_config(**changes), tensors, fmt)
    capture = (1, 2) if case == "fc_vs_override" else None
    with pytest.raises(ModelLoadError, match=pattern) as info:
        load_eagle3(folder, target, capture=capture)
    msg = str(info.value)
    weights = "model.safetensors" if fmt == "st" else "pytorch_model.bin"
    assert msg.startswith(str(folder / weights)) and "\n" not in msg


def test_unreadable_folder(target: Transformer, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_eagle3(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps(native_config()))
    with pytest.raises(ModelLoadError, match="no model.safetensors or pytorch_model.bin"):
        load_eagle3(tmp_path, target)
    for name in ("model.safetensors", "pytorch_model.bin"):
        (tmp_path / name).write_bytes(b"\x00garbage")
        with pytest.raises(ModelLoadError, match=f"{name}: unreadable weights file") as info:
            load_eagle3(tmp_path, target)
        assert "\n" not in str(info.value)
        (tmp_path / name).unlink()


# ------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize(
    ("capture", "written"),
    [
        (None, None),  # the default: no ids written
        ((0, 2, 4), ("eagle_config", [0, 2, 4])),
        ((1, 3, 6), ("top", [1, 3, 6])),  # first boundary 1: top-level key, never +1'd
    ],
)
def test_save_load_round_trip(
    target: Transformer,
    tmp_path: Path,
    capture: tuple[int, ...] | None,
    written: tuple[str, list[int]] | None,
) -> None:
    head = random_eagle3(target, draft_vocab_size=VD, seed=4, capture=capture)
    bounds = capture or (2, 3, 3)
    folder = save_eagle3(head, tmp_path / "saved", bounds, num_target_layers=N_LAYERS)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == VD and "target_hidden_size" not in config
    ids_key = "eagle_aux_hidden_state_layer_ids"
    if written is None:
        assert ids_key not in config and "eagle_config" not in config
    elif written[0] == "top":
        assert config[ids_key] == written[1] and "eagle_config" not in config
    else:
        assert config["eagle_config"][ids_key] == written[1]
    stored = load_file(str(folder / "model.safetensors"))
    assert "embed_tokens.weight" not in stored
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    assert "midlayer.self_attn.q_proj.weight" in stored
    loaded = load_eagle3(folder, target)
    assert loaded.capture == bounds
    assert loaded.head.embed.weight is target.embed.weight
    ids, aux = _inputs(2, 6, 3)
    a = _run(head, ids, head.combine(aux))
    b = _run(loaded.head, ids, loaded.head.combine(aux))
    torch.testing.assert_close(a.logits, b.logits, atol=0, rtol=0)
    assert torch.equal(head.d2t, loaded.head.d2t)


def test_round_trip_of_a_loaded_variant(target: Transformer, tmp_path: Path) -> None:
    """A multi-layer fc_norm draft with its own embedding survives save -> load unchanged."""
    spec = DraftSpec(num_layers=2, fc_norm=True, embed=True)
    config = native_config(num_hidden_layers=2, fc_norm=True, norm_before_residual=True)
    first = load_eagle3(write_draft(tmp_path / "a", config, draft_tensors(spec)), target)
    folder = save_eagle3(first.head, tmp_path / "b", first.capture)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    second = load_eagle3(folder, target)
    assert second.capture == first.capture and second.config.fc_norm
    assert (
        second.config.norm_before_residual and second.head.embed.weight is not target.embed.weight
    )
    ids, aux = _inputs(1, 5, 3)
    a = _run(first.head, ids, first.head.combine(aux))
    b = _run(second.head, ids, second.head.combine(aux))
    torch.testing.assert_close(a.logits, b.logits, atol=0, rtol=0)


def test_random_head_is_seeded(target: Transformer) -> None:
    a = random_eagle3(target, draft_vocab_size=VD, seed=0)
    b = random_eagle3(target, draft_vocab_size=VD, seed=0)
    c = random_eagle3(target, draft_vocab_size=VD, seed=1)
    assert torch.equal(a.fc.weight, b.fc.weight) and not torch.equal(a.fc.weight, c.fc.weight)
    assert torch.equal(a.d2t, b.d2t)
    used = torch.arange(VD) + a.d2t
    assert used.unique().numel() == VD and int(used.max()) < V
    ids, aux = _inputs(1, 4, 3)
    out = _run(a, ids, a.combine(aux))
    assert torch.isfinite(out.logits).all() and out.logits.abs().max() < 50


def test_zero_draft_catch_ups_are_fed_together_when_drafting_resumes() -> None:
    """Plain rounds (one token per row) leave their catch-ups pending; the next proposal feeds
    them in one head forward. The head ends in the state single-token catch-ups would give it
    (cache entries, logits, pre-norm state), and select_rows / concat carry the pending along."""
    from eaglespec.draft.loader import random_eagle3
    from eaglespec.draft.proposer import Eagle3Proposer
    from helpers import tiny_target

    target = tiny_target(0, vocab=96, layers=4)
    head = random_eagle3(target, seed=1)
    proposer = Eagle3Proposer(head, (1, 2, 3))
    gen = torch.Generator().manual_seed(0)
    Ct = target.cfg.hidden_size
    prompts = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]])

    def started():  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(1)
        aux = [torch.randn(2, 4, Ct, generator=g) for _ in range(3)]
        return proposer.start(prompts, torch.tensor([3, 4]), aux, [4, 3], 32)

    steps = [
        (
            torch.randint(0, 96, (2, 1), generator=gen),
            [torch.randn(2, 1, Ct, generator=gen) for _ in range(3)],
        )
        for _ in range(3)
    ]
    deferred, eager = started(), started()
    for tokens, aux in steps:
        deferred = proposer.catch_up(deferred, tokens, aux, [1, 1])
        eager = proposer._advance(eager.cache, tokens, aux, [1, 1])  # one head step each
    assert [p.tokens.shape for p in deferred.pending] == [(2, 1)] * 3
    assert deferred.cache.lengths == [4, 3]  # nothing fed yet
    kept = proposer.select_rows(deferred, [1])
    assert [p.tokens.shape for p in kept.pending] == [(1, 1)] * 3
    assert torch.equal(kept.pending[2].aux[1], deferred.pending[2].aux[1][1:])
    drafts = proposer.propose(deferred, 2)  # feeds the three pending tokens first
    assert not deferred.pending and deferred.cache.lengths == eager.cache.lengths
    torch.testing.assert_close(deferred.logits, eager.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(deferred.prenorm, eager.prenorm, atol=1e-4, rtol=1e-4)
    for b, n in enumerate(eager.cache.lengths):  # committed entries (propose left scratch past)
        for c in ("k", "v"):
            got, want = getattr(deferred.cache, c), getattr(eager.cache, c)
            torch.testing.assert_close(got[:, b, :, :n], want[:, b, :, :n], atol=1e-4, rtol=1e-4)
    assert torch.equal(drafts, proposer.propose(eager, 2))
    merged = proposer.concat([kept, started()])  # a pending part is fed before the concat
    assert not merged.pending and merged.cache.lengths == [6, 4, 3]
