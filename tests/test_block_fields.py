"""A GGUF's Q4_0, Q4_1, Q4_K and Q8_0 blocks go into the w4a8 kernels as they are stored
(dequant.block_fields, w4a8.from_fields, loader.stored_layers): the layers multiply by exactly
the file's weights (Q4_K: up to an fp16 rounding of each sub-block's scale and offset), and where
the dequantize-and-fit path also recovers them exactly (Q4_1 and Q8_0 from fp32, SmolLM2's file
from bf16), the packed bytes are that path's, so nothing the default model computes changes;
only the load gets faster."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tests.helpers import tiny_target

from eaglespec.config import ModelConfig
from eaglespec.errors import ModelLoadError
from eaglespec.model import w4a8
from eaglespec.model.checkpoint import GGUFCheckpoint
from eaglespec.model.dequant import block_fields, dequantize
from eaglespec.model.loader import build_model, load_model, source_fields, stored_layers
from eaglespec.model.quant import quantize_model, w4a8_bits

pytestmark = pytest.mark.skipif(
    w4a8.available() is not None, reason=f"w4a8 kernel unavailable: {w4a8.available()}"
)


def _raw(qtype: Q, shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05
    return torch.from_numpy(gguf.quants.quantize(values, qtype).reshape(-1).copy())


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("shape", [(48, 576), (20, 64)])  # 20 rows: a partial block of 16
def test_a_layer_from_the_fields_multiplies_by_the_files_weights(
    qtype: Q, shape: tuple[int, int]
) -> None:
    raw = _raw(qtype, shape)
    fields = block_fields(raw, qtype, shape)
    assert fields is not None and fields.bits == (8 if qtype == Q.Q8_0 else 4)
    if qtype == Q.Q4_0:
        assert bool((fields.scales < 0).any())  # ggml's Q4_0 scales take the extreme's sign
    layer = w4a8.from_fields(fields, None)
    assert layer is not None
    exact = dequantize(raw, qtype, shape)
    assert torch.equal(layer.dequantize(), exact)
    x = torch.randn(3, shape[1], dtype=torch.bfloat16)
    ref = w4a8.reference8 if qtype == Q.Q8_0 else w4a8.reference
    args = (fields.codes, fields.scales.float()) + (
        () if fields.offsets is None else (fields.offsets.float(),)
    )
    torch.testing.assert_close(layer(x).float(), ref(x, *args), rtol=0.02, atol=0.02)


def _q4_k_raw(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Random Q4_K blocks (gguf cannot quantize to Q4_K) with small finite d and dmin."""
    rng = np.random.default_rng(seed)
    n = shape[0] * shape[1] // 256
    blocks = rng.integers(0, 256, (n, 144), dtype=np.uint8)
    for start in (0, 2):  # d, dmin
        scale = (np.abs(rng.standard_normal(n)) * 0.002).astype(np.float16)
        blocks[:, start : start + 2] = scale.view(np.uint8).reshape(n, 2)
    return torch.from_numpy(blocks.reshape(-1))


@pytest.mark.parametrize("shape", [(16, 512), (20, 256)])
def test_q4_k_fields_are_the_files_codes_with_fp16_scales(shape: tuple[int, int]) -> None:
    """Q4_K's sub-block scale d sc and offset -dmin m are products the kernel stores in fp16: each
    weight is the file's up to those two roundings, and every code is the file's."""
    raw = _q4_k_raw(shape)
    fields = block_fields(raw, Q.Q4_K, shape)
    assert fields is not None and fields.bits == 4
    layer = w4a8.from_fields(fields, None)
    assert layer is not None
    exact = dequantize(raw, Q.Q4_K, shape)  # (N, K) fp32
    s = fields.scales.float().repeat_interleave(32, 1)  # (N, K)
    mn = fields.offsets.float().repeat_interleave(32, 1)
    assert torch.equal(layer.dequantize(), fields.codes.float() * s + mn)
    # off by at most the two fp16 roundings (a wrong code would be off by a whole step)
    bound = 15 * _half_ulp(s) + _half_ulp(mn)
    assert bool(((layer.dequantize() - exact).abs() <= bound).all())


def _half_ulp(t: torch.Tensor) -> torch.Tensor:
    """At least half an fp16 unit in the last place of each value of t (subnormals included)."""
    return (torch.finfo(torch.float16).eps * t.abs() + 2.0**-24) / 2


def test_other_types_and_shapes_have_no_fields() -> None:
    assert block_fields(_raw(Q.Q5_0, (16, 64)), Q.Q5_0, (16, 64)) is None
    assert block_fields(_raw(Q.Q4_1, (16, 64)), Q.Q4_1, (1024,)) is None  # not a matrix


@pytest.mark.parametrize("mode", ["w4a8", "w4a8-all", "w4a8-mixed"])
def test_the_widths_are_the_ones_quantize_model_makes(mode: str) -> None:
    """stored_layers builds each layer at w4a8_bits' width: what quantize_model makes it."""
    wide = {"layers.1.mlp.w2", "layers.0.attn.wqkv"} if mode == "w4a8-mixed" else set()
    model = quantize_model(tiny_target(0, vocab=96, layers=2), mode, wide)
    kinds = {w4a8.W4A8Linear: 4, w4a8.W8A8Linear: 8}
    made = {n: kinds[type(m)] for n, m in model.named_modules() if type(m) in kinds}
    assert len(made) == 2 * 4 + 1
    assert made == {name: w4a8_bits(mode, name, wide) for name in made}
    assert w4a8_bits("int4", "lm_head") is None


def _tiny_llama_gguf(path: Path, head: Q | None, decoder: Q = Q.Q4_1) -> None:
    """A 2-layer llama GGUF: the decoder's matrices as `decoder`, the output head as `head`
    (None: tied to a Q8_0 embedding), norms in fp32. No tokenizer: build_model needs none."""
    hidden, inter, heads, kv, vocab = 64, 96, 4, 2, 128
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_context_length(256)
    rng = np.random.default_rng(1)

    def add(name: str, shape: tuple[int, ...], qtype: Q) -> None:
        values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, values + 1)
        else:
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", (vocab, hidden), Q.Q8_0)
    add("output_norm.weight", (hidden,), Q.F32)
    if head is not None:
        add("output.weight", (vocab, hidden), head)
    d = hidden // heads
    for i in range(2):
        add(f"blk.{i}.attn_norm.weight", (hidden,), Q.F32)
        add(f"blk.{i}.ffn_norm.weight", (hidden,), Q.F32)
        add(f"blk.{i}.attn_q.weight", (heads * d, hidden), decoder)
        add(f"blk.{i}.attn_k.weight", (kv * d, hidden), decoder)
        add(f"blk.{i}.attn_v.weight", (kv * d, hidden), decoder)
        add(f"blk.{i}.attn_output.weight", (hidden, heads * d), decoder)
        add(f"blk.{i}.ffn_gate.weight", (inter, hidden), decoder)
        add(f"blk.{i}.ffn_up.weight", (inter, hidden), decoder)
        add(f"blk.{i}.ffn_down.weight", (hidden, inter), Q.Q5_0 if i == 1 else decoder)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _both_ways(path: Path, dtype: torch.dtype, quant: str = "w4a8"):
    """The model built with the stored layers and without them, each quantized as load_model
    quantizes it, and the stored layers' paths."""
    ckpt = GGUFCheckpoint.open(path)
    cfg = ModelConfig.from_hf_dict(ckpt.config, source=str(path))
    stored = stored_layers(ckpt, cfg, quant)
    cpu = torch.device("cpu")
    direct = quantize_model(build_model(ckpt, cfg, dtype, cpu, stored), quant)
    fitted = quantize_model(build_model(ckpt, cfg, dtype, cpu), quant)
    return direct, fitted, stored


@pytest.mark.parametrize("head", [None, Q.Q8_0, Q.Q5_1], ids=["tied", "q8_0", "q5_1"])
def test_a_gguf_builds_the_same_layers_source_by_source(tmp_path: Path, head: Q | None) -> None:
    """From fp32, the fitting path recovers Q4_1 and Q8_0 blocks exactly, so both ways give the
    same bytes, q and k rows put back in HF order (llama) included; a Q5_0 matrix and a Q5_1
    head are fitted from their own weights, as quantize_model fits them."""
    path = tmp_path / "tiny.gguf"
    _tiny_llama_gguf(path, head)
    direct, fitted, stored = _both_ways(path, torch.float32)
    linears = {f"layers.{i}.{m}" for i in range(2) for m in ("attn.wqkv", "attn.wo", "mlp.w13")}
    assert set(stored) == linears | {"layers.0.mlp.w2", "layers.1.mlp.w2", "lm_head"}
    assert stored["lm_head"].bits == 8 and stored["layers.1.mlp.w2"].bits == 4
    _same_model(direct, fitted)


def _same_model(direct: torch.nn.Module, fitted: torch.nn.Module) -> None:
    a, b = direct.state_dict(), fitted.state_dict()
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert [type(m) for m in direct.modules()] == [type(m) for m in fitted.modules()]
    tokens, positions = torch.tensor([[1, 5, 9, 2]]), torch.arange(4)[None]
    logits = [m(tokens, positions, m.new_cache(1, 8)).logits for m in (direct, fitted)]
    assert torch.equal(*logits)


def test_a_q8_0_code_of_minus_128_is_fitted(tmp_path: Path) -> None:
    """The 8-bit kernel's codes are -127..127: a Q8_0 matrix holding -128 is fitted from its
    weights instead of taken as stored."""
    path = tmp_path / "tiny.gguf"
    _tiny_llama_gguf(path, Q.Q8_0)
    info = GGUFCheckpoint.open(path).file.tensors["output.weight"]
    data = bytearray(path.read_bytes())
    data[info.offset + 3 * 34 + 2 + 5] = 0x80  # block 3's code 5: int8 -128
    path.write_bytes(bytes(data))
    ckpt = GGUFCheckpoint.open(path)
    assert int(ckpt.fields("lm_head.weight").codes.min()) == -128
    fitted_head = source_fields(ckpt, "lm_head.weight", 8, torch.float32)
    assert int(fitted_head.codes.min()) >= -127
    direct, fitted, _ = _both_ways(path, torch.float32)
    _same_model(direct, fitted)


@pytest.mark.parametrize("quant", ["w4a8", "w4a8-mixed"])
def test_a_missing_tensor_is_named_at_every_w4a8_mode(
    tmp_path: Path, quant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The widths are read from the file before the shape checks: a missing matrix is still a
    ModelLoadError naming it, not a KeyError."""
    add = gguf.GGUFWriter.add_tensor

    def leave_out_up(self, name, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name != "blk.1.ffn_up.weight":
            add(self, name, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", leave_out_up)
    path = tmp_path / "tiny.gguf"
    _tiny_llama_gguf(path, Q.Q8_0)
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj"):
        load_model(path, dtype="bfloat16", quant=quant)


def test_from_bf16_the_blocks_are_the_files_weights_exactly(tmp_path: Path) -> None:
    """In the commands' dtype the fitting path re-rounds weights that bf16 cannot hold; the
    stored layers keep the file's own (Q4_0 included: its scales' signs and offsets as stored)."""
    path = tmp_path / "tiny.gguf"
    _tiny_llama_gguf(path, Q.Q8_0, decoder=Q.Q4_0)
    direct, _, stored = _both_ways(path, torch.bfloat16)
    ckpt = GGUFCheckpoint.open(path)
    as_stored = {n: m for n, m in stored.items() if ckpt.qtype(m.sources[0]) in (Q.Q4_0, Q.Q8_0)}
    assert len(as_stored) == len(stored) - 1  # all but layer 1's Q5_0 w2
    for name, layer in as_stored.items():
        exact = torch.cat([ckpt.load(s, torch.float32) for s in layer.sources])
        assert torch.equal(direct.get_submodule(name).dequantize(), exact), name


def test_the_default_model_loads_the_same_bytes_from_its_blocks(
    real_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2's Q4_1 file came from bf16 weights, so the fitting path recovered its blocks
    exactly from bf16 too: the stored layers change no bit of the model users run."""
    import eaglespec.model.loader as loader

    direct = load_model(real_gguf, dtype="auto", quant="auto")
    ckpt = GGUFCheckpoint.open(real_gguf)
    assert len(stored_layers(ckpt, direct.config, direct.precision.quant)) == 30 * 4 + 1
    monkeypatch.setattr(loader, "stored_layers", lambda *args: {})
    fitted = load_model(real_gguf, dtype="auto", quant="auto")
    a, b = direct.model.state_dict(), fitted.model.state_dict()
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
