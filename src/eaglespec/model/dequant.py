"""Vectorised torch dequantization of ggml tensor data (the block formats GGUF files store).

Dims legend: n blocks in a chunk; each block of `type_size` bytes decodes to `block_size` floats.

Exactness: every function below repeats the float32 operations of the `gguf` package's numpy
reference (`gguf/quants.py`, `dequantize_blocks`) in the same order (scale products first, then
one multiply and at most one add or subtract; every integer is exact in float32), so the output
is bitwise equal to `gguf.quants.dequantize` in float32. tests/test_gguf_file.py checks this with
`torch.equal` for every type. Block layouts are quoted from ggml's `block_*` structs.

The work is done in chunks of about a million output values, so peak memory stays near the size of
the output however big the tensor is; there is no Python loop over blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

__all__ = ["FIELD_BITS", "SUPPORTED_QTYPES", "BlockFields", "block_fields", "dequantize"]

# Output values per chunk: 4 MiB of float32 keeps the uint8/float intermediates cache-friendly.
_CHUNK_VALUES = 1 << 20


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of each block, as float32 (n, 1)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., k) bytes → (..., 2, k): the k low nibbles, then the k high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _bits(qh: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """(n, b) bytes → (n, count, b): field i holds bits [i·width, (i+1)·width) of every byte."""
    shifts = torch.arange(0, count * width, width, dtype=torch.uint8).view(count, 1)
    return (qh.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # 18 bytes → 32 values: d f16 | qs[16] (value j: low nibble of qs[j], value 16+j: high nibble)
    # x = d · (q − 8)
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 2:]).view(n, 32).float() - 8
    return _f16(blocks, 0) * q


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # 20 bytes → 32 values: d f16 | m f16 | qs[16] (nibbles as Q4_0); x = d · q + m
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 4:]).view(n, 32).float()
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # 22 bytes → 32 values: d f16 | qh u32 (bit j = 5th bit of value j) | qs[16] (low 4 bits as
    # Q4_0); x = d · (q − 16)
    n = blocks.shape[0]
    qh = _bits(blocks[:, 2:6], 8, 1).transpose(1, 2).reshape(n, 32)  # bit j of the LE u32
    ql = _nibbles(blocks[:, 6:]).view(n, 32)
    q = (ql | (qh << 4)).float() - 16
    return _f16(blocks, 0) * q


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # 24 bytes → 32 values: d f16 | m f16 | qh u32 | qs[16] (as Q5_0); x = d · q + m
    n = blocks.shape[0]
    qh = _bits(blocks[:, 4:8], 8, 1).transpose(1, 2).reshape(n, 32)
    ql = _nibbles(blocks[:, 8:]).view(n, 32)
    q = (ql | (qh << 4)).float()
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # 34 bytes → 32 values: d f16 | qs int8[32]; x = d · q
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return _f16(blocks, 0) * q


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # 84 bytes → 256 values in 16 sub-blocks of 16: scales[16] (low nibble scale, high nibble min)
    # | qs[64] (2-bit, per 32 bytes: shifts 0,2,4,6 give 4 × 32 values) | d f16 | dmin f16
    # x = d · scale · q − dmin · min
    n = blocks.shape[0]
    scales = blocks[:, :16]
    dl = (_f16(blocks, 80) * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (_f16(blocks, 82) * (scales >> 4).float()).view(n, 16, 1)
    q = _bits(blocks[:, 16:80].reshape(n, 2, 32), 4, 2).reshape(n, 16, 16).float()
    return (dl * q - ml).view(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # 110 bytes → 256 values in 16 sub-blocks of 16: hmask[32] (high bit, inverted: 0 means −4)
    # | qs[64] (low 2 bits, as Q2_K) | scales[12] (16 × 6-bit, below) | d f16
    # x = d · (scale − 32) · (q_low − 4 · (1 − hbit))
    n = blocks.shape[0]
    # scales: value i < 8 takes byte i's low nibble, i ≥ 8 byte i−8's high nibble, plus
    # 2 high bits from byte 8 + i % 4 at shift 2 · (i // 4).
    low = _bits(blocks[:, 96:104], 2, 4).reshape(n, 16)
    high = _bits(blocks[:, 104:108], 4, 2).reshape(n, 16)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (_f16(blocks, 108) * scales).view(n, 16, 1)
    ql = _bits(blocks[:, 32:96].reshape(n, 2, 32), 4, 2).reshape(n, 16, 16)
    qh = _bits(blocks[:, :32], 8, 1).reshape(n, 16, 16) ^ 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).view(n, QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K packed 12 bytes → 8 scales and 8 mins of 6 bits each, as float32 (n, 8, 1).

    bytes 0-3: scale 0-3 (low 6 bits) | high 2 bits of scale 4-7
    bytes 4-7: min 0-3 (low 6 bits)   | high 2 bits of min 4-7
    bytes 8-11: low nibble: scale 4-7's low 4 bits, high nibble: min 4-7's low 4 bits
    """
    n = scales.shape[0]
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float().view(n, 8, 1), mn.float().view(n, 8, 1)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # 144 bytes → 256 values in 8 sub-blocks of 32: d f16 | dmin f16 | scales[12] | qs[128]
    # (per 32 bytes: low nibbles = one sub-block, high nibbles = the next)
    # x = d · scale · q − dmin · min
    n = blocks.shape[0]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    d = _f16(blocks, 0).view(n, 1, 1) * sc
    dm = _f16(blocks, 2).view(n, 1, 1) * mn
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).view(n, 8, 32).float()
    return (d * q - dm).view(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # 176 bytes → 256 values in 8 sub-blocks of 32: d f16 | dmin f16 | scales[12] | qh[32]
    # (bit i of qh[j] = 5th bit of value 32·i + j) | qs[128] (low 4 bits, as Q4_K)
    n = blocks.shape[0]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    d = _f16(blocks, 0).view(n, 1, 1) * sc
    dm = _f16(blocks, 2).view(n, 1, 1) * mn
    ql = _nibbles(blocks[:, 48:].reshape(n, 4, 32)).view(n, 8, 32)
    qh = _bits(blocks[:, 16:48], 8, 1)  # (n, 8, 32)
    q = (ql | (qh << 4)).float()
    return (d * q - dm).view(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # 210 bytes → 256 values in 16 sub-blocks of 16: ql[128] (low 4 bits; per 64 bytes, low then
    # high nibbles) | qh[64] (high 2 bits; per 32 bytes, shifts 0,2,4,6) | scales int8[16] | d f16
    # x = d · scale · (q − 32)
    n = blocks.shape[0]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(blocks, 208) * scales).view(n, 16, 1)
    ql = _nibbles(blocks[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
    qh = _bits(blocks[:, 128:192].reshape(n, 2, 32), 4, 2).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).float().view(n, 16, 16)
    return (d * q).view(n, QK_K)


_BLOCK_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q2_K: _q2_k,
    GGMLQuantizationType.Q3_K: _q3_k,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}

# Types stored as plain floats, as blocks of one value: (n, type_size) bytes -> (n, 1) float32,
# never aliasing the bytes (often a file mapping). bf16 is the top half of an fp32: shifted into
# place, as the reference does (keeps NaNs).
_PLAIN_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.F32: lambda b: b.view(torch.float32).clone(),
    GGMLQuantizationType.F16: lambda b: b.view(torch.float16).float(),
    GGMLQuantizationType.BF16: lambda b: (b.view(torch.int16).to(torch.int32) << 16).view(
        torch.float32
    ),
}

# Types stored as plain floats: their torch dtype.
FLOAT_DTYPES: dict[GGMLQuantizationType, torch.dtype] = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}

SUPPORTED_QTYPES: frozenset[GGMLQuantizationType] = frozenset(FLOAT_DTYPES) | frozenset(
    _BLOCK_DEQUANT
)


def dequantize(
    raw: torch.Tensor,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode ggml bytes to a new tensor of `shape` (bitwise equal to gguf's numpy), in float32
    or cast to `dtype`. Every type is decoded a chunk at a time into the result, so a narrower
    `dtype` never holds the whole tensor in float32 beside it (Gemma-3's 262,144 x 640 embedding
    would make 671 MB of float32 for 335 MB of bf16); values are decoded one by one, so the
    result has the bits of the whole float32 tensor's `.to(dtype)`.

    raw: uint8, the tensor's bytes (rows of blocks; ggml's innermost dim is `shape[-1]`).
    Raises ValueError for a type outside SUPPORTED_QTYPES or a byte count that does not match.
    """
    if qtype not in SUPPORTED_QTYPES:
        raise ValueError(f"no dequantizer for ggml type {qtype.name}")
    assert raw.dtype == torch.uint8, raw.dtype
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    numel = prod(shape)
    if numel % block_size != 0 or raw.numel() != numel // block_size * type_size:
        raise ValueError(
            f"{qtype.name} tensor of shape {shape} needs {numel // block_size * type_size} "
            f"bytes (blocks of {block_size} values in {type_size} bytes), got {raw.numel()}"
        )
    raw = raw.contiguous().view(-1)
    if raw.storage_offset() % 4 != 0:
        raw = raw.clone()  # viewing bytes as fp16/fp32 needs an aligned start
    n_blocks = numel // block_size
    blocks = raw.view(n_blocks, type_size)  # (n_blocks, type_size)
    fn = _BLOCK_DEQUANT.get(qtype) or _PLAIN_DEQUANT[qtype]
    chunk = max(1, _CHUNK_VALUES // block_size)
    if n_blocks <= chunk:
        return fn(blocks).view(shape).to(dtype)
    out = torch.empty(n_blocks, block_size, dtype=dtype)
    for start in range(0, n_blocks, chunk):
        out[start : start + chunk] = fn(blocks[start : start + chunk])
    return out.view(shape)


@dataclass(frozen=True)
class BlockFields:
    """A 2-D tensor's blocks of 32 as they store it, where that is already the w4a8 kernels' form
    (model/w4a8.py): w = codes * scale + offset per block, the kernels' own formula, so a layer
    made from the fields multiplies by the file's weights without dequantizing them: exactly for
    Q4_0, Q4_1 and Q8_0, for Q4_K up to one fp16 rounding of each sub-block's scale and offset
    (`_q4_k_fields`). Dims: N rows, K columns, K/32 blocks a row."""

    bits: int  # 4: codes 0..15 with an offset; 8: signed codes, no offset
    codes: torch.Tensor  # (N, K) uint8 (4 bits) or int8 (8 bits)
    scales: torch.Tensor  # (N, K/32) fp16
    offsets: torch.Tensor | None  # (N, K/32) fp16 (4 bits), None (8 bits)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> BlockFields:
        """The same fields with `fn` applied to each along its rows (a row permutation)."""
        offsets = None if self.offsets is None else fn(self.offsets)
        return BlockFields(self.bits, fn(self.codes), fn(self.scales), offsets)

    @staticmethod
    def stack_rows(parts: list[BlockFields]) -> BlockFields:
        """Fields of the same bits and columns, their rows concatenated in order (a fused
        parameter's sources)."""
        if len(parts) == 1:
            return parts[0]
        assert len({(p.bits, p.offsets is None) for p in parts}) == 1, "mixed block kinds"
        offsets = [p.offsets for p in parts if p.offsets is not None]
        return BlockFields(
            parts[0].bits,
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat(offsets) if offsets else None,
        )


# The block types whose fields are the w4a8 kernels' form, and the kernel width that takes them:
# Q4_1 (x = d q + m: scale d, offset m), Q4_0 (x = d (q - 8): scale d, offset -8 d, exact in
# fp16), Q8_0 (x = d q) and Q4_K (x = (d sc) q - dmin m per sub-block of 32: `_q4_k_fields`).
FIELD_BITS: dict[GGMLQuantizationType, int] = {
    GGMLQuantizationType.Q4_0: 4,
    GGMLQuantizationType.Q4_1: 4,
    GGMLQuantizationType.Q8_0: 8,
    GGMLQuantizationType.Q4_K: 4,
}


def block_fields(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> BlockFields | None:
    """The fields of a 2-D tensor of `shape` (N, K) stored as `qtype` (FIELD_BITS's types), else
    None. raw: uint8, the tensor's bytes, as `dequantize` takes them."""
    if qtype not in FIELD_BITS or len(shape) != 2:
        return None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    N, K = shape
    if K % block_size or raw.numel() != N * K // block_size * type_size:
        raise ValueError(f"{qtype.name} tensor of shape {shape}: {raw.numel()} bytes")
    blocks = raw.contiguous().view(N, K // block_size, type_size)  # (N, K/32, bytes)
    scales = blocks[..., 0:2].contiguous().view(torch.float16).view(N, -1)  # (N, K/32)
    if qtype == GGMLQuantizationType.Q8_0:
        codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(N, K)
        return BlockFields(8, codes, scales, None)
    if qtype == GGMLQuantizationType.Q4_K:
        return _q4_k_fields(blocks.reshape(-1, type_size), N, K)
    start = 4 if qtype == GGMLQuantizationType.Q4_1 else 2
    codes = _nibbles(blocks[..., start:]).reshape(N, K)  # (N, K/32, 2, 16) -> value order
    if qtype == GGMLQuantizationType.Q4_1:
        offsets = blocks[..., 2:4].contiguous().view(torch.float16).view(N, -1)
    else:
        offsets = scales * -8  # a power of two: exact in fp16
    return BlockFields(4, codes, scales, offsets)


def _q4_k_fields(blocks: torch.Tensor, N: int, K: int) -> BlockFields:
    """Q4_K's fields (blocks: (N * K/256, 144) bytes, `_q4_k`'s layout): sub-block j of 32 holds
    x = (d sc_j) q - (dmin m_j), so its scale is d sc_j and its offset -(dmin m_j), products of an
    fp16 and a 6-bit integer, exact in fp32 and rounded once to fp16 here (the kernel's scale
    dtype). Every code is the file's."""
    n = blocks.shape[0]
    sc, mn = _k_scale_min(blocks[:, 4:16])  # (n, 8, 1) each
    scales = (_f16(blocks, 0).view(n, 1, 1) * sc).half()  # (n, 8, 1)
    offsets = -(_f16(blocks, 2).view(n, 1, 1) * mn).half()
    codes = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(N, K)  # (n, 8, 32) in value order
    return BlockFields(4, codes, scales.view(N, -1), offsets.view(N, -1))
