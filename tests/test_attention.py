"""layers.attend where eaglespec's CPU kernel does not take the shape (head dim 16 here; the
kernel's own tests are test_cpu_attention.py): SDPA for fp32, the spelled-out attend_math for
16-bit inputs on a CPU (SDPA's CPU kernel is 10x slower there for few queries;
benchmarks/attention_cpu.py), attend_fused in compiled forwards (inductor fuses it into loops
instead of two bmm calls). All compute the same attention: checked against an fp32 reference
with masks, GQA and ragged rows."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from eaglespec.model import cpu_attention
from eaglespec.model.layers import attend, attend_fused, attend_math


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    B, H, Hkv, T, K, D = 3, 6, 2, 4, 11, 16
    q = torch.randn(B, H, T, D, generator=gen)
    k = torch.randn(B, Hkv, K, D, generator=gen)
    v = torch.randn(B, Hkv, K, D, generator=gen)
    mask = torch.rand(B, 1, T, K, generator=gen) > 0.3
    mask[..., 0] = True  # every query attends to something
    return q.to(dtype), k.to(dtype), v.to(dtype), mask


def _reference(q, k, v, mask):  # type: ignore[no-untyped-def]
    rep = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    scores = q.float() @ k.transpose(2, 3) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_matches_the_reference(dtype: torch.dtype) -> None:
    q, k, v, mask = _inputs(dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    out = attend(q, k, v, mask, causal=False)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), _reference(q, k, v, mask), atol=tol, rtol=tol)


def test_16_bit_cpu_attention_is_attend_math() -> None:
    q, k, v, mask = _inputs(torch.bfloat16)
    assert not cpu_attention.fits(q, k)
    assert torch.equal(attend(q, k, v, mask, causal=False), attend_math(q, k, v, mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", [attend_math, attend_fused])
def test_spelled_out_forms_match_the_reference(
    form: Callable[..., torch.Tensor], dtype: torch.dtype
) -> None:
    q, k, v, mask = _inputs(dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    out = form(q, k, v, mask)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), _reference(q, k, v, mask), atol=tol, rtol=tol)


def test_compiled_attention_is_attend_fused() -> None:
    """Under torch.compile, attention onto a cache takes the fused form: bitwise attend_fused's
    result (the eager backend runs the traced ops as they are), not attend_math's."""
    q, k, v, mask = _inputs(torch.float32)
    compiled = torch.compile(lambda *a: attend(*a, causal=False), backend="eager", fullgraph=True)
    fused, spelled = attend_fused(q, k, v, mask), attend_math(q, k, v, mask)
    assert not torch.equal(fused, spelled)  # they round apart, so the check below tells them apart
    assert torch.equal(compiled(q, k, v, mask), fused)
