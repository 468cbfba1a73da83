"""Bad input gets one clear line naming the file and the problem, never a deep traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from eaglespec.cli import main
from eaglespec.errors import ModelLoadError, ModelNotFoundError, UnsupportedArchitectureError
from eaglespec.model.loader import load_model
from eaglespec.registry import resolve_model


@pytest.fixture
def folder(tiny_hf_folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_hf_folder, dst)
    return dst


def _edit_config(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_missing_tensor_is_named(folder: Path) -> None:
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj"):
        load_model(folder)


def test_wrong_shape_is_named(folder: Path) -> None:
    _edit_config(folder, intermediate_size=96)
    with pytest.raises(
        ModelLoadError, match=r"gate_proj\.weight' has shape \(128, 64\).*\(96, 64\)"
    ):
        load_model(folder)


def test_unknown_architecture_is_named(folder: Path) -> None:
    _edit_config(folder, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    with pytest.raises(UnsupportedArchitectureError, match="GPTNeoXForCausalLM"):
        load_model(folder)


def test_corrupt_safetensors_names_the_file(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(folder)


def _tiny_gguf(path: Path, arch: str) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_truncated_gguf(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _tiny_gguf(path, "llama")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match=rf"{path.name}.*truncated"):
        load_model(path)


def test_gguf_of_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "g.gguf"
    _tiny_gguf(path, "gemma3n")
    with pytest.raises(UnsupportedArchitectureError, match="'gemma3n'"):
        load_model(path)


@pytest.mark.parametrize(
    ("arch", "named"),
    [
        ("Gemma3ForConditionalGeneration", "vision-language"),
        ("Gemma3nForCausalLM", "Gemma 3n"),
        ("Gemma2ForCausalLM", "Gemma 2"),
    ],
)
def test_gemma_variants_not_implemented_are_named(folder: Path, arch: str, named: str) -> None:
    _edit_config(folder, architectures=[arch], model_type="gemma3")
    with pytest.raises(UnsupportedArchitectureError, match=f"{arch} is not implemented: .*{named}"):
        load_model(folder)


def test_unknown_model_name() -> None:
    with pytest.raises(ModelNotFoundError, match="unknown model 'no-such-model'.*smollm2-135m"):
        resolve_model("no-such-model", pull_missing=False)


def test_cli_prints_one_line_and_exits_2(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _edit_config(folder, architectures=["FalconForCausalLM"], model_type="falcon")
    assert main(["generate", "--model", str(folder), "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.count("\n") == 0 and "FalconForCausalLM" in err and err.startswith("eaglespec: error")
    )
    assert main(["generate", "--model", "no-such-model", "hi"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_cli_rejects_bad_sampling_values(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(folder), "--top-p", "0", "hi"]) == 2
    assert "top_p" in capsys.readouterr().err
