"""`eaglespec export`: the written folder against the real LLaMA-3.1-8B EAGLE-3 draft's config keys
and the spec's tensor table (section 2.1), exact round trips through `load_eagle3`, speculators ->
native conversion, the user errors, and the CLI command on a tiny HF target. Tiny models, CPU."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from draft_fixtures import (
    EPS,
    HEAD_DIM,
    HEADS,
    INTER,
    KV_HEADS,
    VD,
    C,
    DraftSpec,
    V,
    draft_tensors,
    native_config,
    speculators_config,
    tiny_target,
    write_draft,
)
from eaglespec.draft import Eagle3Head, load_eagle3, random_eagle3, save_eagle3
from eaglespec.errors import (
    InvalidRequestError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from eaglespec.model.llama import Transformer
from eaglespec.train.export import add_export_parser, cmd_export, export_for_target

# The key set of the real draft's config.json (research/eagle3-llama31-8b-draft-config.json,
# = EAGLE's traineagle3/config.json and SpecForge's configs/llama3-8B-eagle3.json), embedded so
# the test runs without ../shared; checked against the file below when it is there.
REAL_KEYS = frozenset(
    {
        "architectures", "bos_token_id", "eos_token_id", "hidden_act", "hidden_size",
        "initializer_range", "intermediate_size", "max_position_embeddings", "model_type",
        "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "pad_token_id",
        "rms_norm_eps", "tie_word_embeddings", "torch_dtype", "transformers_version",
        "use_cache", "vocab_size", "draft_vocab_size",
    }
)  # fmt: skip
REAL_CONFIG = Path(__file__).parents[2] / "shared/research/eagle3-llama31-8b-draft-config.json"
# Real keys the export leaves out, and why.
OMITTED = {
    "transformers_version": "names the library that wrote the file; transformers did not, and "
    "no reader (vLLM, SGLang, llama.cpp's converter) requires it",
}
# Keys the export may add, and why; the first two are always written.
EXTRA = {
    "head_dim": "explicit head size: drafts whose head_dim != hidden/heads need it (SpecForge's "
    "Qwen3 configs write it); transformers, vLLM and llama.cpp's converter read it",
    "rope_theta": "the draft's own RoPE base, never the target's (spec 1.6); written so no reader "
    "falls back to a different default",
    "target_hidden_size": "only when the draft's width differs from the target's",
    "rope_scaling": "only when the draft uses RoPE scaling",
    "norm_before_residual": "speculators-trained drafts (vLLM and llama.cpp read it)",
    "norm_before_fc": "gpt-oss style input_norm before fc",
    "fc_norm": "Eagle 3.1 per-state norms before fc",
    "bias": "fc bias (SGLang's meaning)",
    "norm_output": "false only: SpecForge drafts without a final norm",
    "eagle_config": "capture ids when not the default (SGLang reads them here), or "
    "use_aux_hidden_state false",
    "eagle_aux_hidden_state_layer_ids": "capture ids when not the default (the key vLLM reads)",
}
ALWAYS_EXTRA = {"head_dim", "rope_theta"}
IDS = "eagle_aux_hidden_state_layer_ids"


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_target()


@pytest.fixture
def native(tmp_path: Path) -> Path:
    return write_draft(tmp_path / "native", native_config(), draft_tensors(DraftSpec()))


def _speculators(folder: Path, **top: Any) -> Path:
    spec = DraftSpec(layer_prefix="layers", dtype=torch.bfloat16)
    spec.extra = {"verifier_norm.weight": torch.ones(C, dtype=torch.bfloat16)}
    return write_draft(folder, speculators_config(**top), draft_tensors(spec))


def _logits(head: Eagle3Head, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, 6), generator=g)
    aux = [torch.randn(2, 6, C, generator=g) for _ in range(head.num_aux)]
    out = head(ids, head.combine(aux), torch.arange(6).expand(2, 6), head.new_cache(2, 16))
    logits: torch.Tensor = out.logits
    return logits


def _config(folder: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    return config


# --------------------------------------------------------------------------- config.json keys


def test_real_key_set_constant_matches_the_file() -> None:
    if not REAL_CONFIG.is_file():
        pytest.skip(f"{REAL_CONFIG} not present")
    assert set(json.loads(REAL_CONFIG.read_text())) == REAL_KEYS


def test_config_has_the_real_drafts_keys(target: Transformer, native: Path, tmp_path: Path) -> None:
    report = export_for_target(native, target, tmp_path / "out", dtype="float32")
    config = _config(report.out)
    assert set(config) == (REAL_KEYS - set(OMITTED)) | ALWAYS_EXTRA
    # dims scaled to the tiny target (C 4096 -> 64, I 14336 -> 224, V 128256 -> 256, Vd -> 96)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama" and config["hidden_act"] == "silu"
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == VD
    assert config["hidden_size"] == C and config["intermediate_size"] == INTER
    assert config["vocab_size"] == V
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert config["head_dim"] == HEAD_DIM and config["rms_norm_eps"] == EPS
    assert config["rope_theta"] == 10000.0 and config["max_position_embeddings"] == 2048
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "float32"
    # bookkeeping keys keep the source's values
    source = native_config()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache"):
        assert config[key] == source[key], key
    assert not report.capture_written and report.capture == (2, 3, 3)


@pytest.mark.parametrize("case", ["capture_override", "speculators", "first_boundary_1"])
def test_extra_keys_are_documented(target: Transformer, tmp_path: Path, case: str) -> None:
    if case == "speculators":
        source = _speculators(tmp_path / "src", eagle_aux_hidden_state_layer_ids=[0, 2, 4])
        capture = None
    else:
        source = write_draft(tmp_path / "src", native_config(), draft_tensors(DraftSpec()))
        capture = (1, 3, 5) if case == "first_boundary_1" else (0, 2, 4)
    report = export_for_target(source, target, tmp_path / "out", capture=capture)
    config = _config(report.out)
    assert REAL_KEYS - set(OMITTED) <= set(config)
    assert set(config) - REAL_KEYS <= set(EXTRA), set(config) - REAL_KEYS - set(EXTRA)
    assert report.capture_written
    assert config[IDS] == list(report.capture)  # vLLM's key, boundaries
    if report.capture[0] == 1:  # no eagle_config form: it would read as output-of-layer ids
        assert "eagle_config" not in config and any("SGLang" in n for n in report.notes)
    else:
        assert config["eagle_config"] == {IDS: list(report.capture)}


# ------------------------------------------------------------------------------ tensors


def test_tensor_names_shapes_and_dtypes(target: Transformer, native: Path, tmp_path: Path) -> None:
    report = export_for_target(native, target, tmp_path / "out", dtype="float16")
    stored = load_file(str(report.out / "model.safetensors"))
    q, kv, layer = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, "midlayer"
    expected = {  # spec section 2.1's table, scaled; no embed_tokens: the target's is shared
        "fc.weight": (C, 3 * C),
        f"{layer}.input_layernorm.weight": (C,),
        f"{layer}.hidden_norm.weight": (C,),
        f"{layer}.post_attention_layernorm.weight": (C,),
        f"{layer}.self_attn.q_proj.weight": (q, 2 * C),
        f"{layer}.self_attn.k_proj.weight": (kv, 2 * C),
        f"{layer}.self_attn.v_proj.weight": (kv, 2 * C),
        f"{layer}.self_attn.o_proj.weight": (C, q),
        f"{layer}.mlp.gate_proj.weight": (INTER, C),
        f"{layer}.mlp.up_proj.weight": (INTER, C),
        f"{layer}.mlp.down_proj.weight": (C, INTER),
        "norm.weight": (C,),
        "lm_head.weight": (VD, C),
        "d2t": (VD,),
        "t2d": (V,),
    }
    assert {k: tuple(t.shape) for k, t in stored.items()} == expected
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    assert all(t.dtype == torch.float16 for k, t in stored.items() if k not in ("d2t", "t2d"))
    source = draft_tensors(DraftSpec())
    for name, t in stored.items():  # fp16 in, fp16 out: bit-exact
        assert torch.equal(t, source[name]), name
    assert report.tensors == len(expected) and report.shared == ("embed_tokens",)
    assert report.bytes == (report.out / "model.safetensors").stat().st_size


# -------------------------------------------------------------------------------- round trips


def test_fp32_round_trip_is_exact(target: Transformer, native: Path, tmp_path: Path) -> None:
    original = load_eagle3(native, target)
    report = export_for_target(native, target, tmp_path / "out", dtype="float32")
    again = load_eagle3(report.out, target)
    assert again.capture == original.capture and again.format == "native"
    torch.testing.assert_close(_logits(again.head), _logits(original.head), atol=0, rtol=0)
    assert torch.equal(again.head.d2t, original.head.d2t)


def test_a_head_of_the_targets_rows_exports_them(target: Transformer, tmp_path: Path) -> None:
    """Stored without its output rows (the target's, trained frozen), a head exports with them:
    vLLM and SGLang read a reduced vocabulary's lm_head only from the file."""
    head = random_eagle3(target, draft_vocab_size=VD, seed=3)
    ids = torch.arange(VD) + head.d2t
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[ids])
    head.lm_head_is_target_rows = True
    folder = save_eagle3(head, tmp_path / "rows", (2, 3, 3))
    report = export_for_target(folder, target, tmp_path / "out", dtype="float32")
    stored = load_file(str(report.out / "model.safetensors"))
    assert torch.equal(stored["lm_head.weight"], target.lm_head.weight[ids])
    assert "lm_head rows" not in report.shared
    assert not any("lm_head" in note for note in report.notes)


def test_bf16_export(target: Transformer, native: Path, tmp_path: Path) -> None:
    report = export_for_target(native, target, tmp_path / "out", dtype="bfloat16")
    assert _config(report.out)["torch_dtype"] == "bfloat16"
    stored = load_file(str(report.out / "model.safetensors"))
    source = draft_tensors(DraftSpec())  # fp16: one rounding to bf16, as a direct cast
    for name, t in stored.items():
        want = source[name].to(torch.bfloat16) if t.is_floating_point() else source[name]
        assert torch.equal(t, want), name
    original, again = load_eagle3(native, target), load_eagle3(report.out, target)
    torch.testing.assert_close(_logits(again.head), _logits(original.head), atol=0.1, rtol=0.05)


def test_save_dtype_leaves_the_head_and_target_alone(target: Transformer, tmp_path: Path) -> None:
    head = random_eagle3(target, draft_vocab_size=VD, seed=2)
    folder = save_eagle3(head, tmp_path / "h", (2, 3, 3), dtype=torch.bfloat16)
    assert head.dtype == torch.float32 and target.embed.weight.dtype == torch.float32
    stored = load_file(str(folder / "model.safetensors"))
    assert stored["fc.weight"].dtype == torch.bfloat16 and stored["d2t"].dtype == torch.int64
    with pytest.raises(ValueError, match="floating-point"):
        save_eagle3(head, tmp_path / "bad", (2, 3, 3), dtype=torch.int64)


def test_speculators_to_native(target: Transformer, tmp_path: Path) -> None:
    source = _speculators(tmp_path / "spec", eagle_aux_hidden_state_layer_ids=[1, 3, 5])
    original = load_eagle3(source, target)
    assert original.config.norm_before_residual  # speculators' default when absent
    report = export_for_target(source, target, tmp_path / "out", dtype="float32")
    config = _config(report.out)
    assert report.format == "speculators" and report.flags == ("norm_before_residual",)
    assert any(n.startswith("norm_before_residual") for n in report.notes)  # SGLang ignores it
    assert config["norm_before_residual"] is True and "transformer_layer_config" not in config
    assert config[IDS] == [1, 3, 5]  # top-level boundaries, as the source had them
    stored = load_file(str(report.out / "model.safetensors"))
    assert "midlayer.hidden_norm.weight" in stored and not any(
        k.startswith(("layers.", "verifier_")) for k in stored
    )
    again = load_eagle3(report.out, target)
    assert again.format == "native" and again.config.norm_before_residual
    assert again.capture == original.capture == (1, 3, 5)
    torch.testing.assert_close(_logits(again.head), _logits(original.head), atol=0, rtol=0)


# --------------------------------------------------------------------------------- user errors


def test_post_norm_feedback_is_refused(target: Transformer, tmp_path: Path) -> None:
    source = _speculators(tmp_path / "spec", norm_output=True)
    with pytest.raises(UnsupportedArchitectureError, match="norm_output true .* no native form"):
        export_for_target(source, target, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec"]  # nothing written


def test_output_folder_errors(target: Transformer, native: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="is the draft folder itself"):
        export_for_target(native, target, native)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(InvalidRequestError, match="not an empty folder"):
        export_for_target(native, target, tmp_path / "full")
    (tmp_path / "empty").mkdir()
    assert export_for_target(native, target, tmp_path / "empty").out == tmp_path / "empty"
    with pytest.raises(ModelNotFoundError, match="no such draft folder"):
        export_for_target(tmp_path / "missing", target, tmp_path / "out")
    with pytest.raises(InvalidRequestError, match="capture override"):
        export_for_target(native, target, tmp_path / "out", capture=(0, 1, 99))
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


# ------------------------------------------------------------------------------------- CLI


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="eaglespec")
    add_export_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["export", *argv])


def test_cli_export_on_a_hf_target(tiny_hf_folder: Path, tmp_path: Path, capsys) -> None:
    from eaglespec.model.loader import load_model

    loaded = load_model(tiny_hf_folder)
    head = random_eagle3(loaded.model, draft_vocab_size=64, seed=3)
    source = save_eagle3(head, tmp_path / "src", (0, 1, 2), num_target_layers=2)
    out = tmp_path / "out"
    flags = ["--dtype", "float16", "--capture", "0,2,2"]
    args = _parse(str(source), "--target", str(tiny_hf_folder), "--out", str(out), *flags)
    assert cmd_export(args) == 0
    printed = capsys.readouterr()
    line = printed.out.strip()
    assert "\n" not in line and line.startswith("exported native draft")
    assert "float16" in line and "[0, 2, 2] (written to config.json)" in line
    assert "embed_tokens shared with the target" in line and "llama.cpp" in printed.err
    config = _config(out)
    assert config["eos_token_id"] == loaded.tokenizer.eos_ids[0]  # from the target tokenizer
    assert config["bos_token_id"] is None and config["torch_dtype"] == "float16"
    again = load_eagle3(out, loaded.model)
    assert again.capture == (0, 2, 2)
    assert torch.equal(again.head.fc.weight, head.fc.weight.half().float())


@pytest.mark.parametrize(
    ("argv", "error", "pattern"),
    [
        (["--target", "no-such-model"], ModelNotFoundError, "unknown model 'no-such-model'"),
        (["--capture", "a,b"], InvalidRequestError, "comma-separated integers"),
    ],
)
def test_cli_errors(
    native: Path, tmp_path: Path, argv: list[str], error: type[Exception], pattern: str
) -> None:
    base = {"--target": "no-such-model", "--out": str(tmp_path / "out")}
    base.update(dict(zip(argv[::2], argv[1::2], strict=True)))
    args = _parse(str(native), *[x for kv in base.items() for x in kv])
    with pytest.raises(error, match=pattern):
        cmd_export(args)
    assert not (tmp_path / "out").exists()
