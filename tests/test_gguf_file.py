"""GGUFFile reads what gguf.GGUFWriter writes, agrees with gguf.GGUFReader, dequantizes bitwise
like gguf.quants.dequantize, and fails on broken files with one-line ModelLoadErrors."""

from __future__ import annotations

import struct
import time
from math import prod
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from eaglespec.errors import ModelLoadError
from eaglespec.gguf_file import GGUFFile
from eaglespec.model.dequant import SUPPORTED_QTYPES, dequantize

# Types gguf can quantize: their bytes come from gguf.quants.quantize of random floats.
QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
# Types gguf cannot quantize: random bytes, with these fp16 scale fields (byte offsets in each
# block) overwritten by small finite values so every decoded value is finite.
RANDOM_BYTES = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ2_XXS: (0,),  # not supported by eaglespec: load must say so
}

# key → (value, value type, array item type); one of every value type, arrays nested two deep
METADATA: dict[str, tuple[Any, V, V | None]] = {
    "test.u8": (200, V.UINT8, None),
    "test.i8": (-100, V.INT8, None),
    "test.u16": (60000, V.UINT16, None),
    "test.i16": (-30000, V.INT16, None),
    "test.u32": (4_000_000_000, V.UINT32, None),
    "test.i32": (-2_000_000_000, V.INT32, None),
    "test.u64": (2**63 + 5, V.UINT64, None),
    "test.i64": (-(2**62), V.INT64, None),
    "test.f32": (-1.25, V.FLOAT32, None),  # exactly representable in float32
    "test.f64": (0.1, V.FLOAT64, None),
    "test.bool_true": (True, V.BOOL, None),
    "test.bool_false": (False, V.BOOL, None),
    "test.string": ("héllo wörld ✓", V.STRING, None),
    "test.empty_string": ("", V.STRING, None),
    "test.strings": (["<s>", "", "Ġthe", "日本", "a b"], V.ARRAY, V.STRING),
    "test.i32s": ([3, -1, 7], V.ARRAY, V.INT32),
    "test.f32s": ([0.5, -2.0, 3.25], V.ARRAY, V.FLOAT32),
    "test.u8s": ([0, 255, 7], V.ARRAY, V.UINT8),
    "test.bools": ([True, False, True], V.ARRAY, V.BOOL),
    "test.nested_ints": ([[1, 2, 3], [4]], V.ARRAY, None),
    "test.nested_strings": ([["a", "bc"], ["", "d"]], V.ARRAY, None),
}


def _tensor_bytes(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Stored data for a tensor of PyTorch `shape`: floats or (rows, bytes per row) uint8."""
    if qtype in QUANTIZABLE:
        values = rng.standard_normal(shape).astype(np.float32)
        return gguf.quants.quantize(values, qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_size
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for start in RANDOM_BYTES[qtype]:
        scale = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        blocks[:, start : start + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(*shape[:-1], -1)


def _tensor_specs() -> dict[str, tuple[Q, tuple[int, ...]]]:
    specs = {}
    for qtype in [*QUANTIZABLE, *RANDOM_BYTES]:
        block_size = gguf.GGML_QUANT_SIZES[qtype][0]
        cols = 2 * block_size if block_size > 1 else 40
        specs[f"blk.0.{qtype.name.lower()}.weight"] = (qtype, (3, cols))
    specs["norm_1d.weight"] = (Q.F32, (24,))
    specs["stack_3d.weight"] = (Q.Q8_0, (2, 3, 64))
    return specs


def _write_gguf(path: Path, alignment: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Write a small GGUF with every metadata type and every tensor type; returns the data."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch="llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value, vtype, sub_type) in METADATA.items():
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    data = {}
    for name, (qtype, shape) in _tensor_specs().items():
        data[name] = _tensor_bytes(qtype, shape, rng)
        writer.add_tensor(name, data[name], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return data


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    return path, _write_gguf(path)


def test_metadata_round_trip(small_gguf: tuple[Path, dict[str, Any]]) -> None:
    path, _ = small_gguf
    f = GGUFFile.open(path)
    assert f.version == 3 and f.alignment == 32
    assert f.metadata["general.architecture"] == "llama"
    for key, (value, _, _) in METADATA.items():
        assert f.metadata[key] == value, key
        assert type(f.metadata[key]) is type(value), key
    assert list(f.metadata) == ["general.architecture", *METADATA]


def test_tensor_infos_and_load(small_gguf: tuple[Path, dict[str, Any]]) -> None:
    path, data = small_gguf
    f = GGUFFile.open(path)
    specs = _tensor_specs()
    assert list(f.tensors) == list(specs)
    for name, (qtype, shape) in specs.items():
        info = f.tensors[name]
        assert (info.qtype, info.shape, info.nbytes) == (qtype, shape, data[name].nbytes), name
        assert info.offset % f.alignment == 0
        stored = data[name].view(np.uint8).reshape(-1)
        assert torch.equal(f.raw(name), torch.from_numpy(stored)), name
        if qtype not in SUPPORTED_QTYPES:
            continue
        expected = torch.from_numpy(gguf.quants.dequantize(data[name], qtype).reshape(shape))
        loaded = f.load(name)
        assert loaded.dtype == torch.float32 and loaded.shape == shape
        assert torch.isfinite(loaded).all(), name
        assert torch.equal(loaded, expected.float()), name  # bitwise
        for dtype in (torch.float16, torch.bfloat16):
            assert torch.equal(f.load(name, dtype), expected.to(dtype)), (name, dtype)


def test_narrow_loads_decode_a_chunk_at_a_time(
    small_gguf: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load into fp16 or bf16 decodes a chunk of blocks at a time into the result (never the
    whole tensor in float32 beside it), plain float types too (an F16 GGUF into bf16), and has
    the bits of the whole tensor decoded and cast."""
    from eaglespec.model import dequant

    path, data = small_gguf
    f = GGUFFile.open(path)
    decoded: list[int] = []
    for table in (dequant._BLOCK_DEQUANT, dequant._PLAIN_DEQUANT):
        for qtype, fn in list(table.items()):

            def counted(blocks: torch.Tensor, fn: Any = fn) -> torch.Tensor:
                out = fn(blocks)
                decoded.append(out.numel())
                return out

            monkeypatch.setitem(table, qtype, counted)
    made: list[tuple[int, torch.dtype]] = []  # (values, dtype) of every torch.empty
    empty = torch.empty

    def recorded(*size: Any, dtype: torch.dtype | None = None, **kw: Any) -> torch.Tensor:
        out = empty(*size, dtype=dtype, **kw)
        made.append((out.numel(), out.dtype))
        return out

    monkeypatch.setattr(torch, "empty", recorded)
    for name, (qtype, shape) in _tensor_specs().items():
        if qtype not in SUPPORTED_QTYPES:
            continue
        expected = torch.from_numpy(gguf.quants.dequantize(data[name], qtype).reshape(shape))
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        for chunk in (1, block + 1, 10**9):  # one block, one block again, the whole tensor
            monkeypatch.setattr(dequant, "_CHUNK_VALUES", chunk)
            for dtype in (torch.float16, torch.bfloat16):
                decoded.clear()
                made.clear()
                loaded = f.load(name, dtype)
                assert loaded.dtype == dtype and loaded.shape == shape
                assert torch.equal(loaded, expected.to(dtype)), (name, dtype, chunk)
                if dequant.FLOAT_DTYPES.get(qtype) != dtype:  # else stored as asked: one copy
                    per_call = min(prod(shape), max(block, chunk // block * block))
                    assert max(decoded) == per_call and sum(decoded) == prod(shape), name
                    if per_call < prod(shape):  # no float32 result made beside the narrow one
                        assert (prod(shape), torch.float32) not in made, name


def test_matches_gguf_reader(small_gguf: tuple[Path, dict[str, Any]]) -> None:
    path, _ = small_gguf
    f = GGUFFile.open(path)
    reader = gguf.GGUFReader(path)
    assert [t.name for t in reader.tensors] == list(f.tensors)
    for t in reader.tensors:
        info = f.tensors[t.name]
        assert info.shape == tuple(reversed(t.shape.tolist()))
        assert (info.qtype, info.offset, info.nbytes) == (t.tensor_type, t.data_offset, t.n_bytes)
    assert f.data_offset == reader.data_offset
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key.startswith("test.nested"):
            continue  # GGUFReader has no real fields for these (and flattens nested arrays)
        assert f.metadata[key] == field.contents(), key


def test_custom_alignment(tmp_path: Path) -> None:
    path = tmp_path / "aligned.gguf"
    data = _write_gguf(path, alignment=256, seed=1)
    f = GGUFFile.open(path)
    assert f.alignment == 256 == f.metadata["general.alignment"]
    for name, info in f.tensors.items():
        assert info.offset % 256 == 0
        assert torch.equal(f.raw(name), torch.from_numpy(data[name].view(np.uint8).reshape(-1)))


def test_unsupported_quant_type(small_gguf: tuple[Path, dict[str, Any]]) -> None:
    path, _ = small_gguf
    with pytest.raises(ModelLoadError) as e:
        GGUFFile.open(path).load("blk.0.iq2_xxs.weight")
    msg = str(e.value)
    assert msg.startswith(f"{path}: tensor blk.0.iq2_xxs.weight has quantization type IQ2_XXS")
    assert "does not support (supported: " in msg and "Q4_K" in msg and "\n" not in msg


def test_unknown_tensor_name(small_gguf: tuple[Path, dict[str, Any]]) -> None:
    path, _ = small_gguf
    f = GGUFFile.open(path)
    for method in (f.raw, f.load, f.info):
        with pytest.raises(ModelLoadError, match="no tensor named 'nope.weight'"):
            method("nope.weight")


@pytest.mark.parametrize("where", ["version", "first key", "vocab", "tensor infos", "data"])
def test_truncated_file(
    small_gguf: tuple[Path, dict[str, Any]], tmp_path: Path, where: str
) -> None:
    path, _ = small_gguf
    full = path.read_bytes()
    f = GGUFFile.open(path)
    last = max(f.tensors.values(), key=lambda t: t.offset)
    cut = {
        "version": 6,
        "first key": 30,
        "vocab": full.index(b"\xe6\x97\xa5") + 1,  # inside a string of the "test.strings" array
        "tensor infos": full.index(b"blk.0.q4_0.weight") + 3,
        "data": last.offset + last.nbytes - 1,
    }[where]
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(full[:cut])
    with pytest.raises(ModelLoadError) as e:
        GGUFFile.open(bad)
    assert str(bad) in str(e.value) and "truncated" in str(e.value)


@pytest.mark.parametrize("content", [b"", b"GG", b"GGML" + bytes(60), b'{"not": "gguf"}'])
def test_not_a_gguf_file(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(content)
    with pytest.raises(ModelLoadError) as e:
        GGUFFile.open(bad)
    assert str(bad) in str(e.value) and "not a GGUF file" in str(e.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="cannot read file"):
        GGUFFile.open(tmp_path / "missing.gguf")


@pytest.mark.parametrize("version", [1, 4])
def test_unsupported_version(
    small_gguf: tuple[Path, dict[str, Any]], tmp_path: Path, version: int
) -> None:
    path, _ = small_gguf
    bad = tmp_path / "v.gguf"
    bad.write_bytes(path.read_bytes()[:4] + struct.pack("<I", version) + path.read_bytes()[8:])
    with pytest.raises(ModelLoadError, match=f"GGUF version {version} is not supported"):
        GGUFFile.open(bad)


def test_big_endian(tmp_path: Path) -> None:
    path = tmp_path / "be.gguf"
    writer = gguf.GGUFWriter(path, arch="llama", endianess=gguf.GGUFEndian.BIG)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="big-endian"):
        GGUFFile.open(path)


def test_unknown_value_type(small_gguf: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, _ = small_gguf
    full = bytearray(path.read_bytes())
    # header (24 bytes), then the key "general.architecture" (8 + 20 bytes), then its value type
    assert full[32:52] == b"general.architecture"
    full[52:56] = struct.pack("<I", 99)
    bad = tmp_path / "vt.gguf"
    bad.write_bytes(bytes(full))
    with pytest.raises(ModelLoadError, match="'general.architecture' has unknown value type 99"):
        GGUFFile.open(bad)


def test_dequantize_chunked_and_unaligned() -> None:
    # more blocks than one chunk, and bytes starting at an odd address
    rng = np.random.default_rng(2)
    values = rng.standard_normal((70, 32 * 1024)).astype(np.float32)
    stored = gguf.quants.quantize(values, Q.Q4_1)
    padded = torch.from_numpy(np.concatenate([[7], stored.reshape(-1)]).astype(np.uint8))
    out = dequantize(padded[1:], Q.Q4_1, values.shape)
    assert torch.equal(out, torch.from_numpy(gguf.quants.dequantize(stored, Q.Q4_1)))


@pytest.mark.real
def test_real_file(real_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.perf_counter()
    f = GGUFFile.open(real_gguf)
    t_open = time.perf_counter() - t0
    assert f.metadata["general.architecture"] == "llama"
    assert len(f.metadata["tokenizer.ggml.tokens"]) == f.metadata["llama.vocab_size"]
    spans = sorted((t.offset, t.offset + t.nbytes) for t in f.tensors.values())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))

    # Timed on one thread: on a machine whose cores are busy (other test runs), torch's intra-op
    # threads wait for each other at every op and the time varies 10x; one thread does not.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        loaded = {name: f.load(name) for name in f.tensors}
        t_load = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    # one tensor of each stored type, against gguf's numpy on the same bytes
    by_type = {info.qtype: name for name, info in f.tensors.items()}
    for qtype, name in by_type.items():
        info = f.tensors[name]
        stored = f.raw(name).numpy().reshape(*info.shape[:-1], -1)
        expected = gguf.quants.dequantize(stored, qtype).reshape(info.shape)
        assert torch.equal(loaded[name], torch.from_numpy(expected)), name
    with capsys.disabled():
        print(
            f"\n{real_gguf.name}: open {t_open:.3f} s, dequantize all {len(loaded)} tensors "
            f"{t_load:.3f} s on 1 thread (types: {', '.join(sorted(q.name for q in by_type))})"
        )
