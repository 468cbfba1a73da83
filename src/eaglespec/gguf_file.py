"""A small, exact GGUF v2/v3 reader: header parsed with `struct` over an mmap, tensors dequantized
with torch (model/dequant.py).

`gguf.GGUFReader` builds a numpy view per metadata string (seconds for a 49k-token vocabulary);
this reader decodes the header straight to Python values and validates every tensor's byte range
at open, so a truncated download fails at once with a one-line ModelLoadError.

File layout (little-endian; the `gguf` package's constants name the type ids):

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv      × key string | value_type u32 | value
    n_tensors × name string | n_dims u32 | ne u64[n_dims] | ggml_type u32 | offset u64
    padding to `general.alignment` (default 32), then the tensor data; offsets are relative to it

    string = length u64 + utf-8 bytes;  array = item_type u32 + count u64 + items (arrays nest)
"""

import mmap
import struct
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

import torch
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

from eaglespec.errors import ModelLoadError
from eaglespec.model.dequant import FLOAT_DTYPES, SUPPORTED_QTYPES, dequantize

__all__ = ["GGUFFile", "GGUFTensorInfo"]

SUPPORTED_VERSIONS = (2, 3)

# struct format character of each fixed-size value type (all little-endian)
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_SCALAR_STRUCTS = {t: struct.Struct("<" + c) for t, c in _SCALAR_FORMATS.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order: ggml's ne reversed, so a [out, in] weight is (out, in)
    qtype: GGMLQuantizationType  # storage type of the data
    offset: int  # absolute byte offset of the tensor data in the file
    nbytes: int  # size of the data in bytes


class _Cursor:
    """Sequential little-endian reads from the header; any read past the end is a truncation."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf = buf
        self.path = path
        self.pos = 0
        self.size = len(buf)

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise self.truncated(what, self.pos + n)

    def truncated(self, what: str, end: int) -> ModelLoadError:
        return ModelLoadError(
            f"{self.path}: file is truncated: {what} needs bytes up to {end} but the file has "
            f"{self.size} bytes (incomplete download?)"
        )

    def scalar(self, st: struct.Struct, what: str) -> Any:
        self.need(st.size, what)
        (value,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return value

    def string(self, what: str) -> str:
        n = self.scalar(_U64, what)
        self.need(n, what)
        start, self.pos = self.pos, self.pos + n
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.scalar(_U32, what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ModelLoadError(f"{self.path}: {what} has unknown value type {raw}") from None

    def value(self, vtype: GGUFValueType, what: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            return self.array(what)
        return self.scalar(_SCALAR_STRUCTS[vtype], what)

    def array(self, what: str) -> list[Any]:
        itype = self.value_type(what)
        count = self.scalar(_U64, what)
        if itype in _SCALAR_FORMATS:
            # one unpack for the whole array: 49k token types take microseconds
            self.need(count * _SCALAR_STRUCTS[itype].size, what)
            st = struct.Struct(f"<{count}{_SCALAR_FORMATS[itype]}")
            items = list(st.unpack_from(self.buf, self.pos))
            self.pos += st.size
            return items
        self.need(8 * count, what)  # every string or array item takes at least 8 bytes
        if itype == GGUFValueType.STRING:
            return self._strings(count, what)
        return [self.array(what) for _ in range(count)]

    def _strings(self, count: int, what: str) -> list[str]:
        # The hot loop for a tokenizer vocabulary (~100k strings): locals only, two bounds checks.
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out: list[str] = []
        for _ in range(count):
            if pos + 8 > size:
                raise self.truncated(what, pos + 8)
            (n,) = unpack(buf, pos)
            end = pos + 8 + n
            if end > size:
                raise self.truncated(what, end)
            out.append(buf[pos + 8 : end].decode("utf-8", errors="replace"))
            pos = end
        self.pos = pos
        return out


@dataclass(frozen=True, eq=False)
class GGUFFile:
    """An open GGUF file: metadata as plain Python values, tensors read on demand from an mmap.

    The mapping is private copy-on-write (tensors from `raw` are writable and never write back);
    it stays open while this object or any tensor from `raw` is alive.
    """

    path: Path
    version: int  # GGUF format version (2 or 3)
    # str, int, float, bool or (nested) lists of them, in file order
    metadata: dict[str, Any] = field(repr=False)
    tensors: dict[str, GGUFTensorInfo] = field(repr=False)  # in file order
    alignment: int  # `general.alignment`, or 32
    data_offset: int  # absolute offset where the tensor data section starts
    _buf: mmap.mmap = field(repr=False)

    @classmethod
    def open(cls, path: str | Path) -> "GGUFFile":
        path = Path(path)
        try:
            with path.open("rb") as f:
                magic = f.read(4)
                if magic != _U32.pack(GGUF_MAGIC):
                    raise ModelLoadError(
                        f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')"
                    )
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise ModelLoadError(f"{path}: cannot read file: {e.strerror or e}") from e
        return cls._parse(path, buf)

    @classmethod
    def _parse(cls, path: Path, buf: mmap.mmap) -> "GGUFFile":
        cur = _Cursor(buf, path)
        cur.pos = 4  # after the magic
        version = cur.scalar(_U32, "version")
        if version & 0xFFFF == 0 and version != 0:
            raise ModelLoadError(f"{path}: big-endian GGUF files are not supported")
        if version not in SUPPORTED_VERSIONS:
            raise ModelLoadError(
                f"{path}: GGUF version {version} is not supported (supported: "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))})"
            )
        n_tensors = cur.scalar(_U64, "tensor count")
        n_kv = cur.scalar(_U64, "metadata count")

        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            if key in metadata:
                raise ModelLoadError(f"{path}: duplicate metadata key {key!r}")
            what = f"metadata {key!r}"
            metadata[key] = cur.value(cur.value_type(what), what)

        infos = [_read_tensor_info(cur, i) for i in range(n_tensors)]
        alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelLoadError(f"{path}: general.alignment {alignment!r} is not a power of two")
        data_offset = -(-cur.pos // alignment) * alignment  # round up

        tensors: dict[str, GGUFTensorInfo] = {}
        for name, ne, qtype, rel in infos:
            if name in tensors:
                raise ModelLoadError(f"{path}: duplicate tensor {name!r}")
            tensors[name] = _tensor_info(path, name, ne, qtype, data_offset + rel, len(buf))
        return cls(path, version, metadata, tensors, alignment, data_offset, buf)

    def info(self, name: str) -> GGUFTensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelLoadError(f"{self.path}: no tensor named {name!r}") from None

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's stored bytes as a uint8 tensor (nbytes,), zero-copy over the mapping."""
        info = self.info(name)
        if info.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._buf, dtype=torch.uint8, count=info.nbytes, offset=info.offset)

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor dequantized to `info(name).shape` and cast to `dtype` (new memory)."""
        info = self.info(name)
        if info.qtype not in SUPPORTED_QTYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_QTYPES))
            raise ModelLoadError(
                f"{self.path}: tensor {name} has quantization type {info.qtype.name}, which "
                f"eaglespec does not support (supported: {supported})"
            )
        raw = self.raw(name)
        if FLOAT_DTYPES.get(info.qtype) == dtype:
            # stored as the requested dtype already: one copy, no float32 round-trip
            return raw.view(dtype).clone().view(info.shape)
        return dequantize(raw, info.qtype, info.shape, dtype)  # chunked: no whole float32 copy


def _read_tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
    """One tensor-info record: (name, ggml ne, raw ggml type id, offset relative to the data)."""
    name = cur.string(f"tensor info #{i}")
    what = f"tensor info of {name!r}"
    n_dims = cur.scalar(_U32, what)
    cur.need(8 * n_dims, what)
    ne = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos)
    cur.pos += 8 * n_dims
    qtype = cur.scalar(_U32, what)
    rel = cur.scalar(_U64, what)
    return name, ne, qtype, rel


def _tensor_info(
    path: Path, name: str, ne: tuple[int, ...], raw_type: int, offset: int, file_size: int
) -> GGUFTensorInfo:
    """Validate a tensor-info record: known type, whole blocks per row, data inside the file."""
    try:
        qtype = GGMLQuantizationType(raw_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ModelLoadError(f"{path}: tensor {name} has unknown ggml type id {raw_type}") from None
    if ne and ne[0] % block_size != 0:
        raise ModelLoadError(
            f"{path}: tensor {name} has rows of {ne[0]} values, not a multiple of the "
            f"{qtype.name} block size {block_size}"
        )
    nbytes = prod(ne) // block_size * type_size
    if offset + nbytes > file_size:
        raise ModelLoadError(
            f"{path}: file is truncated: tensor {name} needs bytes up to {offset + nbytes} but the "
            f"file has {file_size} bytes (incomplete download?)"
        )
    return GGUFTensorInfo(name, tuple(reversed(ne)), qtype, offset, nbytes)
