"""Attention of query tokens onto a KV cache on CPU: eaglespec's own kernel (csrc/attention.cpp),
used by decode steps, verification forwards and (with their causal mask) eager prefills, eager
and compiled.

Dims: B batch, H / Hkv query and KV heads, G = H / Hkv, T query tokens, K keys, D head dim.

Why a kernel: inductor's fused form of this attention (`layers.attend_fused`) computed every
score as a horizontal sum and swept the keys three times (max, exp-sum, values); in SmolLM2's
bf16 w4a8 decode on 2 cores it took about 70 us a layer at T = 1 and 130 us at T = 2 over 150
keys, a third of a decode step and most of what a second verified token cost beyond the matmuls
(block-compiled profile, docs/benchmark-history.md session 14). This kernel walks each query row's
keys once for the scores (AVX-512, fp32 sums) and once for the values. Prefills came later (session
17): SDPA's bits differed from the kernel's, so a prompt answered after one whole prefill and
after the server's chunked prefill could differ at bf16 w4a8; the kernel costs 1.15-1.4x SDPA
there (256-1024 tokens). An unmasked row scores 16 keys at a time (reduce_add_ps's tree on 16
accumulators: the same bits as key by key). Up to 8 unmasked rows of one KV head (its query
heads, a verification's tokens, a prefill's) are scored together: each block of 16 keys is
widened from bf16 to fp32 once for all of them (exact, so each row's products are its own), and
their value sums share the loads of v. The threads split the rows to a row, not to a KV head
(SmolLM2's one-token step: 5 rows against 4, where it was 6 against 3); on AVX2 a KV head of 4 or
more rows is split into groups of at most 8 of near-equal size, and the threads take whole groups
(a forward's team, csrc/team.h, takes a split in pieces, which had cut a verification's groups to
rows scored alone: session 58).

Row independence: each query row (b, h, t) is computed alone through the same instructions
whatever T, B and the thread split are, so a verification over T tokens gives each row the
bits a one-token step over the same keys gives it (tests/test_cpu_attention.py). Masked keys do
not move the sums either (a row's exp-sum runs over its attended keys packed in order): a
draft-tree node, whose ancestors sit among masked siblings, gets the bits the next one-token
step gets once the accepted path is moved to the front of the cache. Other paths
(SDPA, inductor's fusion) sum in orders that depend on T.

Numerics: scores, softmax and the weighted sum in fp32 (exp by a Cephes polynomial, within 2 ulp
of expf); the output is rounded once to q's dtype. `reference` is the same math in torch.

AVX2 (x86-64-v3, csrc/simd16_avx2.h): 16 lanes held in two 8-lane registers, the same
operations lane for lane and the reductions in the AVX-512 order, so the same bits; 4-8 rows of a
KV head share each block's widening, fewer rows and a tree's rows go alone
(`torch.ops.eaglespec_attention.use_avx2(True)` asks for it where AVX-512 runs; tests compare).
There keys are scored 8 at a time (reduce_add's tree on 8 keys' registers at once), a lone bf16
row's values widened by shift and AND (even and odd dimensions, put back in order at the end),
each mask row's prefix found once for the heads that share it, and a causal prefill's groups
split zigzag between the threads (session 61: attention 0.83-0.98x the time of key by key, a
1,024-token prefill's 0.69-0.86x; BENCHMARKS.md).
Needs AVX-512 (F, BW, VL) or AVX2 with FMA and F16C; `available()` says why not where it cannot
run, and `attend` then falls back to PyTorch's attention.
"""

from __future__ import annotations

import functools

import torch

from eaglespec.model.extension import build, constant_to_dynamo

HEAD_DIMS = (32, 64, 80, 96, 128, 256)  # the kernel's instantiations (csrc/attention.cpp)


@functools.cache
def _load() -> str | None:
    """Build and load the kernel once per process; None if it runs here, else why not."""
    reason = build("attention", needs="an x86 CPU with AVX2 (FMA, F16C) or AVX-512")
    if reason is not None:
        return reason

    @torch.library.register_fake("eaglespec_attention::attend")  # type: ignore[untyped-decorator]
    def _(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        B, H, T, D = q.shape
        return q.new_empty(B, T, H, D).permute(0, 2, 1, 3)  # as the kernel returns it

    return None


# Traced forwards ask too: a constant to dynamo, not a function to trace into.
@constant_to_dynamo
def available() -> str | None:
    """None when the kernel runs on this machine, else the reason it does not."""
    return _load()


def fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel takes this attention: CPU, fp32 or bf16, a head dim it was built for,
    any number of query tokens (each row is computed alone)."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and k.dtype == q.dtype
        and q.shape[-1] in HEAD_DIMS
        and available() is None
    )


def attend(
    q: torch.Tensor,  # (B, H, T, D)
    k: torch.Tensor,  # (B, Hkv, K, D)
    v: torch.Tensor,  # (B, Hkv, K, D)
    mask: torch.Tensor | None,  # (B, 1, T, K) bool, True = attend; None = every key
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D), masked) v -> (B, H, T, D) in q's dtype (a view of a (B, T, H, D)
    contiguous tensor). Call only where `fits`."""
    out: torch.Tensor = torch.ops.eaglespec_attention.attend(q, k, v, mask, q.shape[-1] ** -0.5)
    return out


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """The kernel's math in plain torch, fp32 throughout, output in q's dtype (for tests)."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    kf = k.float().repeat_interleave(H // Hkv, dim=1)  # (B, H, K, D)
    vf = v.float().repeat_interleave(H // Hkv, dim=1)
    scores = (q.float() @ kf.transpose(2, 3)) * D**-0.5  # (B, H, T, K)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vf).to(q.dtype)
