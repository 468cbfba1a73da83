"""A whole decoder layer of an eager CPU step in one call (csrc/layer.cpp), for layers whose four
matrices are w4a8: the commands' default on a CPU with the w4a8 kernel.

Why: with the matmuls, norms, rotation and attention in eaglespec's own kernels, what remained of
an eager SmolLM2 decode step beyond its operators was Python: module calls, the quantized
layers' reshapes, the kernels' checks, views, about 1.5 ms of a 7.6 ms step (torch profiler, 2
threads, 2026-11-25). The C++ op runs the same ops in the same order (eaglespec's kernels through
the dispatcher, ATen for the residual adds, SiLU and product), so a layer's output is bitwise the
Python forward's (tests/test_cpu_layer.py); only the Python goes. Measured (SmolLM2 bf16 w4a8,
100-token prefix, six interleaved runs of 30 forwards in one process, medians): one token 7.20 ->
5.66 ms, two tokens 8.43 -> 6.58 ms.

Taken where every piece would be taken anyway: eager (compiled forwards are one graph already), no
gradients, fp32 or bf16, any number of new tokens onto a cache (a CPU prefill carries its causal
mask: cache.KVCache.plan), q/k norms (Qwen3's) or none (since session 60; before, Qwen3 kept
the Python forward: a Qwen3-0.6B-shaped model with random weights, w4a8, its one-token forward
26.9 -> 17.8 ms in one process on the AVX2 VM), the four matrices
`W4A8Linear` or `W8A8Linear` (w4a8-mixed keeps a GGUF's 6- and 8-bit matrices at 8 bits; the op
tells them by their packed size: since session 59, before which a layer with one of them ran the
Python forward, as Qwen2.5-Coder-0.5B's Q4_K_M, mostly 8-bit, did in every layer: its one-token
forward 29.8 -> 20.3 ms, in one process on the AVX2 VM). Gemma 3's
SandwichBlock has an op of its own (`sandwich`: its four norms, q/k norms and query scale,
GELU-tanh, each matrix `W4A8Linear` or `W8A8Linear` as w4a8-mixed stored it, no biases); measured
on gemma3-270m, a decode step 16.8 -> 14.3 ms and plain decoding 60 -> 75-78 tok/s
(docs/benchmark-history.md, session 21). Since session 60 its kernels are called directly
(layer.cpp's sandwich_rows) and a decoder of such layers runs whole in one call
(`sandwich_decoder`: both RoPE tables, the sliding layers' masks, the final norm and the output
matrix; StackArgs with `sandwich`): on gemma3-270m, in one process on the AVX2 VM, a one-token
forward 0.85x the time of the op layer by layer, four tokens 0.84x, plain generation 1.12x.

A decoder of llama Blocks that all take the op (not Gemma's sliding layers) runs whole in one call
(`stack`: the same op per layer, in C++, so the same bits), its arguments kept on the model
(StackArgs). What that saved is each layer's Python call of the op: measured on SmolLM2 (bf16 w4a8,
128-token prefix, interleaved in one process, medians) the 30 layers 3.75 -> 3.32 ms at one
token, 3.92 -> 3.56 ms at two; plain decoding 1.13x and a chain of one with lookup 1.11x as fast
(session 27).

The same reasoning, carried to the ends of a forward (session 31): `decoder` takes the stack with
the RoPE tables, the final norm and a w4a8 output matrix (4- or 8-bit) to the fp32 logits, and
`head` a one-layer EAGLE-3 head's whole step (RoPE, embedding, norms, the layer, lm_head). On
SmolLM2 (bf16 w4a8, 128-token prefix, interleaved in one process, medians): a target forward of
one token 5.21 -> 5.06 ms, of two 5.90 -> 5.47 ms, plain decoding 177 -> 187 tok/s; the head's
one-token step 0.72 -> 0.55 ms, a two-token catch-up with fc 0.95 -> 0.70 ms. Since session 60
the ATen glue at those ends is gone too (csrc/layer.cpp: the RoPE tables filled around ATen's
own sin and cos, the head's embedding row, norms and concatenation, the logits' row pick, final
norm and widening, each through the kernels directly; the same bits): on the AVX2 VM, in one
process with the glue switched run by run, the head's step 0.85x the time, its catch-up after a
target forward 0.88x, a two-token target forward 0.99x.

Then the glue inside the op (session 57, an AVX2 VM): a one-row SmolLM2 step spent about 1.5 ms of
7.6 in the dispatcher, output tensors, views and checks around its 150 kernel calls, each also a
fork and join of the second thread. A layer without biases (or with Qwen2's q/k/v bias alone) now
calls the kernels directly into its own buffers (csrc/kernels.h), a forward of at most 64 rows runs
in one team of threads (csrc/team.h), and the stack's weights are one `Stack` object the op holds
(StackArgs.layers) rather than lists passed each call: the forward 0.87-0.97x the time at T = 1-8,
plain decoding 0.93x, the default speculation 0.96x (BENCHMARKS.md, session 57). The same bits:
`torch.ops.eaglespec_layer.use_team` / `use_native` switch them off for the tests that say so.
"""

from __future__ import annotations

import copy
import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from eaglespec.cache import CachePlan
from eaglespec.model import cpu_attention, cpu_rowops, w4a8
from eaglespec.model.extension import build
from eaglespec.model.layers import RMSNorm, kernel_takes

if TYPE_CHECKING:
    from eaglespec.model.llama import Block, SandwichBlock


@functools.cache
def _load() -> str | None:
    """Build and load the op once per process (after the kernels it calls); None if it runs."""
    missing: list[str | None] = [
        cpu_attention.available(),
        cpu_rowops.available(),
        w4a8.available(),
    ]
    for reason in missing:
        if reason is not None:
            return reason
    return build("layer", needs="the kernels it calls")


def available() -> str | None:
    """None when the fused layer runs on this machine, else the reason it does not."""
    return _load()


_MISSING = object()
Sources = list[tuple[dict[str, object], str, object]]


@dataclass(frozen=True, slots=True)
class LayerArgs:
    """What the fused op takes from one layer's modules, read once and kept with where each value
    was read from (`sources`: the module's own dict, the name, the value; `Checks`), so that a
    module, weight or size replaced since is noticed (`current`) and the values are read anew.

    Why kept: read per forward through nn.Module's attribute lookup (`Module.__getattr__`, about
    35 lookups a layer), the 30 layers' arguments and checks cost about 1 ms of a 5.4 ms SmolLM2
    decode step; checking that the values are still current is one dict lookup and one identity
    test each, and for parameters, packed weights and submodules only after some module
    registered one (`Checks`)."""

    norms: tuple[object, ...]  # target: attn_norm and mlp_norm weights, eps; head: norm weight, eps
    matrices: tuple[object, ...]  # wqkv weight, bias, N; wo weight, bias; w13 weight, bias, N; w2
    num_heads: int
    fused: bool  # the modules are of the kinds the op takes (module doc)
    sources: Checks
    # Gemma's SandwichBlock (the `sandwich` op): norms are the list of its six weights and eps,
    # matrices (weight, bits, N) with bits 4 or 8; q_ratio its query scale over D ** -0.5
    sandwich: bool = False
    q_ratio: float = 1.0
    # a llama Block's q_norm and k_norm weights (Qwen3), (None, None) without
    qk_norms: tuple[object, object] = (None, None)

    def current(self) -> bool:
        return self.sources.current()


# Bumped whenever a parameter, buffer or submodule is assigned or registered on any module
# (nn.Module's global registration hooks, installed below): what Checks.current trusts between
# forwards for the values those hooks cover.
_EPOCH = [0]


def _bump(*_: object) -> None:
    _EPOCH[0] += 1


for _register in (
    nn.modules.module.register_module_parameter_registration_hook,
    nn.modules.module.register_module_buffer_registration_hook,
    nn.modules.module.register_module_module_registration_hook,
):
    _register(_bump)


def _every_forward(where: dict[str, object], value: object) -> bool:
    """Whether a kept value must be looked up again every forward: a plain attribute (found in
    a module's own __dict__, which holds the key "_parameters"; assigning one calls no hook), or
    a floating-point buffer (Module.to and friends write converted buffers straight into
    `_buffers`). Parameters (converted in place), other buffers and submodules change only
    through the registration hooks."""
    if "_parameters" in where:
        return True
    return (
        isinstance(value, torch.Tensor)
        and not isinstance(value, nn.Parameter)
        and value.is_floating_point()
    )


@dataclass(frozen=True, slots=True)
class Checks:
    """Where each kept value was read from (a module's own dict and the name) and the value read,
    as three columns, so that `current` runs its lookups and identity tests in C.

    Two sets of columns: those looked up every forward (`_every_forward`: plain attributes and
    floating buffers, a few a layer) and the rest (parameters, packed weights, submodules: about
    600 for SmolLM2's stack), looked up only when the registration epoch moved since they were
    last found current. Why: each forward streams the weights through the caches, so the next
    forward's lookups all miss; all of them cost about 150 us of a 2.4 ms SmolLM2 decode step
    (6.8%, session 46), the every-forward ones about a fifth of that."""

    wheres: tuple[dict[str, object], ...]
    names: tuple[str, ...]
    values: tuple[object, ...]
    hooked: tuple[tuple[dict[str, object], ...], tuple[str, ...], tuple[object, ...]]
    epoch: list[int]  # [the epoch at which `hooked` was last found current]

    @staticmethod
    def of(sources: Sources) -> Checks:
        every: Sources = []
        rest: Sources = []
        for source in sources:  # each entry classified once
            (every if _every_forward(source[0], source[2]) else rest).append(source)
        wheres, names, values = _columns(every)
        return Checks(wheres, names, values, _columns(rest), [_EPOCH[0]])

    def current(self) -> bool:
        """Whether every value is still where it was read from."""
        if self.epoch[0] != _EPOCH[0]:
            if not _found(*self.hooked):
                return False
            self.epoch[0] = _EPOCH[0]
        return _found(self.wheres, self.names, self.values)

    def entries(self) -> Sources:
        """The checks as (where, name, value) triples, to be checked again among others."""
        every = zip(self.wheres, self.names, self.values, strict=True)
        return [*every, *zip(*self.hooked, strict=True)]


def _columns(
    sources: Sources,
) -> tuple[tuple[dict[str, object], ...], tuple[str, ...], tuple[object, ...]]:
    wheres, names, values = zip(*sources, strict=True) if sources else ((), (), ())
    return wheres, names, values


def _found(
    wheres: tuple[dict[str, object], ...], names: tuple[str, ...], values: tuple[object, ...]
) -> bool:
    """Whether each value is still wheres[i][names[i]] (identity), in C."""
    found = map(dict.get, wheres, names, repeat(_MISSING))
    return all(map(operator.is_, found, values))


def _read(module: nn.Module, name: str, sources: Sources) -> Any:
    """module.name, found where nn.Module keeps it, and recorded in `sources`."""
    for where in (module._parameters, module._buffers, module._modules, module.__dict__):
        if name in where:
            value = where[name]
            sources.append((where, name, value))  # type: ignore[arg-type]
            return value
    raise AttributeError(f"{type(module).__name__} has no '{name}'")


def _absent(where: dict[str, object], name: str, sources: Sources) -> bool:
    """Whether `where` has no `name`, recorded in `sources` (so that one added is noticed)."""
    value = where.get(name, _MISSING)
    sources.append((where, name, value))
    return value is _MISSING


_BITS = {"W4A8Linear": 4, "W8A8Linear": 8}


def _w4a8_matrix(linear: nn.Module | None, sources: Sources) -> tuple[object, int, object] | None:
    """(packed weight, bits, output size) of a w4a8 matrix without a bias (W4A8Linear: 4 bits,
    W8A8Linear: 8), read and recorded in `sources`; None for any other module (or None)."""
    bits = _BITS.get(type(linear).__name__, 0)
    if linear is None or not bits or _read(linear, "bias", sources) is not None:
        return None
    return _read(linear, "weight", sources), bits, _read(linear, "out_features", sources)


def _kept(module: nn.Module, key: str, build: Callable[[], Any]) -> Any:
    """The arguments kept on `module` under `key` (anything with `current()`), built anew where
    anything they were read from changed."""
    kept = module.__dict__.get(key)
    if kept is None or not kept.current():
        kept = build()
        module.__dict__[key] = kept  # a plain attribute: read back without __getattr__
    return kept


def _cached(module: nn.Module, build: Callable[[Sources], LayerArgs]) -> LayerArgs:
    """The module's LayerArgs, read anew where anything they were read from changed."""
    args: LayerArgs = _kept(module, "fused_args", lambda: build([]))
    return args


def _matrices(
    attn: nn.Module, mlp: nn.Module, sources: Sources
) -> tuple[tuple[object, ...], int, bool]:
    """The four matrices with biases and output sizes, the head count, and whether all four are
    the op's kinds: 4-bit (W4A8Linear) or 8-bit (W8A8Linear, as w4a8-mixed stores a GGUF's 6-
    and 8-bit matrices; the op tells them by their packed size)."""
    linears = [_read(attn, "wqkv", sources), _read(attn, "wo", sources)]
    linears += [_read(mlp, "w13", sources), _read(mlp, "w2", sources)]
    if not all(isinstance(m, (w4a8.W4A8Linear, w4a8.W8A8Linear)) for m in linears):
        return (), 0, False
    wqkv, wo, w13, w2 = linears
    matrices = (
        _read(wqkv, "weight", sources),
        _read(wqkv, "bias", sources),
        _read(wqkv, "out_features", sources),
        _read(wo, "weight", sources),
        _read(wo, "bias", sources),
        _read(w13, "weight", sources),
        _read(w13, "bias", sources),
        _read(w13, "out_features", sources),
        _read(w2, "weight", sources),
        _read(w2, "bias", sources),
    )
    return matrices, _read(attn, "cfg", sources).num_heads, True


def block_args(block: Block | SandwichBlock) -> LayerArgs | None:
    """The fused op's arguments for a decoder layer whose forward `step_fits`, or None where its
    modules are of kinds the op does not take. The one place that decides a decoder layer's
    path: Transformer.body, Block.forward and SandwichBlock.forward ask it."""
    args = _layer_args(block)
    return args if args.fused else None


def _layer_args(block: Block | SandwichBlock) -> LayerArgs:
    """A decoder layer's LayerArgs, kept whether or not the op takes the layer (`fused`)."""
    sandwich = "post_attn_norm" in block._modules
    return _sandwich_args(block) if sandwich else _target_args(block)


def _sandwich_args(block: nn.Module) -> LayerArgs:
    def build(sources: Sources) -> LayerArgs:
        attn, mlp = _read(block, "attn", sources), _read(block, "mlp", sources)
        # the op's order: attn, q, k, post-attention, mlp, post-mlp
        norms = [
            _read(block, "attn_norm", sources),
            _read(attn, "q_norm", sources),
            _read(attn, "k_norm", sources),
            *(_read(block, n, sources) for n in ("post_attn_norm", "mlp_norm", "post_mlp_norm")),
        ]
        weights = [_read(norm, "weight", sources) for norm in norms]
        eps = {_read(norm, "eps", sources) for norm in norms}
        linears = [_read(attn, "wqkv", sources), _read(attn, "wo", sources)]
        linears += [_read(mlp, "w13", sources), _read(mlp, "w2", sources)]
        mats = [_w4a8_matrix(m, sources) for m in linears]  # (weight, bits, outputs) each
        fused = len(eps) == 1 and _read(mlp, "act", sources) == "gelu_tanh" and None not in mats
        if not fused:
            return LayerArgs((), (), 0, False, Checks.of(sources))
        qkv, wo, w13, w2 = (m for m in mats if m is not None)
        # the op's order: weight, bits and outputs of wqkv and w13; weight and bits of wo and w2
        matrices = (*qkv, *wo[:2], *w13, *w2[:2])
        ratio = _read(attn, "q_ratio", sources)
        heads = _read(attn, "cfg", sources).num_heads
        return LayerArgs(
            (weights, eps.pop()),  # the op takes the weights as one list
            matrices,
            heads,
            True,
            Checks.of(sources),
            sandwich=True,
            q_ratio=1.0 if ratio is None else ratio,
        )

    return _cached(block, build)


def _target_args(block: Block) -> LayerArgs:
    def build(sources: Sources) -> LayerArgs:
        attn, mlp = _read(block, "attn", sources), _read(block, "mlp", sources)
        attn_norm, mlp_norm = _read(block, "attn_norm", sources), _read(block, "mlp_norm", sources)
        eps = _read(attn_norm, "eps", sources)
        norms = (_read(attn_norm, "weight", sources), _read(mlp_norm, "weight", sources), eps)
        matrices, heads, fused = _matrices(attn, mlp, sources)
        # the op takes one eps for every norm, and q/k norms (Qwen3's) without a query scale
        fused = fused and _read(mlp_norm, "eps", sources) == eps
        # Attention.forward norms q and k (then scales q) only where both norms are there
        q_norm = _read(attn, "q_norm", sources)
        k_norm = None if q_norm is None else _read(attn, "k_norm", sources)
        qk: tuple[object, object] = (None, None)
        if q_norm is not None and k_norm is not None:
            norms_ok = all(
                type(n) is RMSNorm and _read(n, "eps", sources) == eps for n in (q_norm, k_norm)
            )
            fused = fused and norms_ok and _read(attn, "q_ratio", sources) is None
            if fused:
                qk = (_read(q_norm, "weight", sources), _read(k_norm, "weight", sources))
        return LayerArgs(norms, matrices, heads, fused, Checks.of(sources), qk_norms=qk)

    return _cached(block, build)


def _draft_args(layer: nn.Module) -> LayerArgs:
    def build(sources: Sources) -> LayerArgs:
        attn, mlp = _read(layer, "attn", sources), _read(layer, "mlp", sources)
        norm = _read(layer, "post_attention_layernorm", sources)
        norms = (_read(norm, "weight", sources), _read(norm, "eps", sources))
        matrices, heads, fused = _matrices(attn, mlp, sources)
        return LayerArgs(norms, matrices, heads, fused, Checks.of(sources))

    return _cached(layer, build)


@dataclass(frozen=True, slots=True)
class StackArgs:
    """The `stack` op's arguments for a whole decoder (every layer a fused llama Block): each
    argument of the `forward` op as a list over the layers, those that must agree (eps, output
    sizes, head count) once. Kept on the model and checked like LayerArgs, over every layer's
    sources and the layer list's own entries at once (about 40 us for SmolLM2's 30 layers, where
    asking each layer for its arguments costs about 240 us)."""

    norms: tuple[object, ...]  # attn_norm weights, mlp_norm weights, eps
    matrices: tuple[object, ...]  # wqkv weights, biases, N; wo weights, biases; w13 ...; w2 ...
    num_heads: int
    fused: bool  # every layer a fused Block, their eps, sizes and head counts alike
    sources: Checks
    # the ops' Stack (csrc/layer.cpp) holding norms, matrices and num_heads, built once: passed
    # as lists at every call, their 360-odd tensors cost about 0.2 ms of a SmolLM2 decode step
    layers: object = None
    # Gemma 3's SandwichBlocks (the `sandwich_decoder` op, its SandwichStack): norms are every
    # layer's six weights in one list, then eps; matrices wqkv weights, bits, N; wo weights,
    # bits; w13 ..., N; w2 ...; extra the query scale and which layers slide. For llama Blocks
    # extra is the layers' q_norm weights and k_norm weights (None without: Qwen3's)
    sandwich: bool = False
    extra: tuple[object, ...] = ()

    @property
    def eps(self) -> object:
        return self.norms[-1]

    def current(self) -> bool:
        return self.sources.current()

    def __deepcopy__(self, memo: dict[int, object]) -> StackArgs:
        """A copy over the copied model's tensors (`memo`), its Stack bound to them anew (the
        Stack's own copy would copy the tensors apart from the model's)."""
        norms, matrices = copy.deepcopy(self.norms, memo), copy.deepcopy(self.matrices, memo)
        extra = copy.deepcopy(self.extra, memo)  # Qwen3's q/k norm weights among them
        return StackArgs(
            norms,
            matrices,
            self.num_heads,
            self.fused,
            copy.deepcopy(self.sources, memo),
            None
            if self.layers is None
            else _bind(norms, matrices, self.num_heads, self.sandwich, extra),
            self.sandwich,
            extra,
        )


def _bind(
    norms: tuple[object, ...],
    matrices: tuple[object, ...],
    num_heads: int,
    sandwich: bool = False,
    extra: tuple[object, ...] = (),
) -> object:
    """The ops' Stack (or SandwichStack) over a decoder's norms and matrices as StackArgs holds
    them."""
    if sandwich:
        return torch.classes.eaglespec_layer.SandwichStack(*norms, *matrices, num_heads, *extra)
    return torch.classes.eaglespec_layer.Stack(*norms, *matrices, num_heads, *extra)


def stack_args(model: nn.Module) -> StackArgs | None:
    """The stack op's arguments for `model.layers` (the sandwich_decoder op's where every layer
    is a fused SandwichBlock), or None where a layer is not fused, the layers are of both kinds
    or differ in eps, sizes, head count or query scale (the per-layer loop then runs)."""
    kept: StackArgs = _kept(model, "stack_args", lambda: _stack_build(model))
    return kept if kept.fused else None


def _stack_build(model: nn.Module) -> StackArgs:
    sources: Sources = []
    layers = _read(model, "layers", sources)
    blocks = [_read(layers, str(i), sources) for i in range(len(layers))]
    # every layer's sources, those the op does not take too: one that becomes fusable restacks
    args = [_layer_args(b) for b in blocks]
    for a in args:
        sources += a.sources.entries()
    if args and all(a.fused and a.sandwich for a in args):
        cfg = _read(model, "cfg", sources)
        return _sandwich_stack(args, cfg.sliding_layers or (False,) * len(args), sources)
    if not args or any(not a.fused or a.sandwich for a in args):
        return StackArgs((), (), 0, False, Checks.of(sources))
    first = args[0]
    shared = (first.norms[2], first.matrices[2], first.matrices[7], first.num_heads)
    alike = all((a.norms[2], a.matrices[2], a.matrices[7], a.num_heads) == shared for a in args)
    norms = ([a.norms[0] for a in args], [a.norms[1] for a in args], first.norms[2])
    matrices = _stacked_matrices(args)
    extra = ([a.qk_norms[0] for a in args], [a.qk_norms[1] for a in args])  # q, k norms or None
    return StackArgs(
        norms=norms,
        matrices=matrices,
        num_heads=first.num_heads,
        fused=alike,
        sources=Checks.of(sources),
        layers=_bind(norms, matrices, first.num_heads, False, extra) if alike else None,
        extra=extra,
    )


def _stacked_matrices(args: list[LayerArgs]) -> tuple[object, ...]:
    """The layers' matrices as the stack ops take them: each of the ten (a llama Block's wqkv,
    bqkv, N, wo, bo, w13, b13, N, w2, b2; a SandwichBlock's biases are bits) a list over the
    layers but the output sizes N (at 2 and 7), alike over the layers (the callers check)."""
    cols = [list(c) for c in zip(*(a.matrices for a in args), strict=True)]
    return tuple(args[0].matrices[i] if i in (2, 7) else cols[i] for i in range(10))


def _sandwich_stack(args: list[LayerArgs], sliding: Sequence[bool], sources: Sources) -> StackArgs:
    """StackArgs over SandwichBlocks' LayerArgs (their norms ([six weights], eps); matrices
    (wqkv, bits, N, wo, bits, w13, bits, N, w2, bits))."""
    first = args[0]
    shared = (first.norms[1], first.matrices[2], first.matrices[7], first.num_heads)
    fused = len(sliding) == len(args) and all(
        (a.norms[1], a.matrices[2], a.matrices[7], a.num_heads) == shared
        and a.q_ratio == first.q_ratio
        for a in args
    )
    norms = ([w for a in args for w in a.norms[0]], first.norms[1])  # type: ignore[attr-defined]
    matrices = _stacked_matrices(args)
    extra = (first.q_ratio, [bool(s) for s in sliding])
    return StackArgs(
        norms=norms,
        matrices=matrices,
        num_heads=first.num_heads,
        fused=fused,
        sources=Checks.of(sources),
        layers=_bind(norms, matrices, first.num_heads, True, extra) if fused else None,
        sandwich=True,
        extra=extra,
    )


def forward_stack(
    args: StackArgs,
    x: torch.Tensor,  # (B, T, C)
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin (B, T, 1, D)
    k_layers: list[torch.Tensor],  # L x (B, Hkv, S, D), written
    v_layers: list[torch.Tensor],
    plan: CachePlan,
    capture: tuple[int, ...],  # boundaries b in [0, L]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every layer's Block.forward in one call -> the output (B, T, C) and the state at each
    captured boundary, in capture's order (the same tensors the per-layer loop gives)."""
    out: list[torch.Tensor] = torch.ops.eaglespec_layer.stack(
        x,
        args.layers,
        *rope,
        k_layers,
        v_layers,
        plan.slots,
        plan.num_keys,
        plan.mask,
        list(capture),
    )
    return out[0], out[1:]


@dataclass(frozen=True, slots=True)
class LogitsArgs:
    """What the `decoder` op takes besides `stack`'s: the model's RoPE frequencies, final norm
    and output matrix, read and checked as LayerArgs are."""

    inv_freq: object
    tail: tuple[object, ...]  # final norm weight; lm_head weight, bits, output size
    fused: bool  # a 4- or 8-bit lm_head without bias, the final norm of the layers' eps
    sources: Checks

    def current(self) -> bool:
        return self.sources.current()


def logits_args(model: nn.Module, stack: StackArgs) -> LogitsArgs | None:
    """The `decoder` op's arguments beyond `stack` for a model whose decoder `stack` takes, or
    None where its output matrix is not w4a8's (4- or 8-bit, no bias) or its final norm's eps
    differs from the layers'."""
    kept: LogitsArgs = _kept(model, "logits_args", lambda: _logits_build(model, stack))
    return kept if kept.fused else None


def _logits_build(model: nn.Module, stack: StackArgs) -> LogitsArgs:
    # the stack's arguments as kept on the model: rebuilt (say, an eps changed), these are too
    sources: Sources = [(model.__dict__, "stack_args", stack)]
    norm = _read(model, "norm", sources)
    out = _w4a8_matrix(_read(model, "lm_head", sources), sources)
    fused = out is not None and _read(norm, "eps", sources) == stack.eps
    tail = (_read(norm, "weight", sources), *out) if fused and out is not None else ()
    return LogitsArgs(_read(model, "inv_freq", sources), tail, fused, Checks.of(sources))


@functools.cache
def _decoder_op(sandwich: bool) -> Callable[..., list[torch.Tensor]]:
    """The decoder op's (Gemma 3's sandwich_decoder op's) C++ entry, past its Python wrapper. The
    op takes a TorchBind object (the layer stack), so the wrapper scans every argument for a
    tracing placeholder of one before each call (torch._ops._must_dispatch_in_python): 28 us a
    forward over SmolLM2's 30 layers' cache lists; a one-token step took 6.32 ms without it
    against 6.37 ms (medians of 80 runs of 25, alternated in one process, AVX2 VM). This path runs
    eagerly only (step_fits), where no such placeholder exists."""
    ops = torch.ops.eaglespec_layer
    overload = (ops.sandwich_decoder if sandwich else ops.decoder).default
    return getattr(overload, "_op", overload)  # a torch without `_op`: the wrapper


def forward_decoder(
    stack: StackArgs,
    tail: LogitsArgs,
    x: torch.Tensor,  # (B, T, C) the embedded input (Gemma's scaled)
    positions: torch.Tensor,  # (B, T) int64
    k_layers: list[torch.Tensor],  # L x (B, Hkv, S, D), written
    v_layers: list[torch.Tensor],
    plan: CachePlan,
    capture: tuple[int, ...],
    logit_index: torch.Tensor | None,  # (B, T') or None
    local: tuple[torch.Tensor | None, CachePlan] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Transformer.body from the embedding on in one call: (B, T', V) fp32 logits and the state
    at each captured boundary. A Gemma 3 decoder (`stack.sandwich`) takes `local`: its sliding
    layers' RoPE frequencies (None: the others') and plan (cache.sliding_plan: plan's keys, a
    mask of its own)."""
    norm, lm_head, bits, vocab = tail.tail
    lead = (x, positions, tail.inv_freq)
    rest = (plan.slots, plan.num_keys, plan.mask)
    if stack.sandwich:
        inv_freq_local, local_plan = local if local is not None else (None, plan)
        lead, rest = (*lead, inv_freq_local), (*rest, local_plan.mask)
    out: list[torch.Tensor] = _decoder_op(stack.sandwich)(
        *lead,
        stack.layers,
        k_layers,
        v_layers,
        *rest,
        list(capture),
        norm,
        logit_index,
        lm_head,
        bits,
        vocab,
    )
    return out[0], out[1:]


def greedy_args(
    model: nn.Module, embed: torch.Tensor, cache_k: torch.Tensor
) -> tuple[StackArgs, LogitsArgs] | None:
    """The `greedy_chain` op's arguments for `model` (a llama Transformer without Gemma's
    scaled embedding or sliding layers; `embed` its embedding matrix, `cache_k` (L, B, Hkv, S,
    D) its cache's keys), or None where `forward` would not run the decoder op: step_fits'
    conditions (an embedded input has the embedding's dtype and device), a decoder of llama
    blocks and a w4a8 output matrix."""
    if not _step_fits(embed, cache_k):
        return None
    stack = stack_args(model)
    if stack is None or stack.sandwich:
        return None
    tail = logits_args(model, stack)
    return None if tail is None else (stack, tail)


@functools.cache
def _greedy_op() -> Callable[..., list[torch.Tensor]]:
    """The greedy_chain op's C++ entry, past its Python wrapper (_decoder_op says why)."""
    overload = torch.ops.eaglespec_layer.greedy_chain.default
    return getattr(overload, "_op", overload)


def greedy_chain(
    args: tuple[StackArgs, LogitsArgs],  # greedy_args
    embed: torch.Tensor,  # (V, C) the embedding matrix
    ids: torch.Tensor,  # (B, T) int64 the new tokens, a chain per row
    lengths: list[int],  # each row's committed length
    cache_k: torch.Tensor,  # (L, B, Hkv, S, D), written
    cache_v: torch.Tensor,
    capture: tuple[int, ...],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Transformer.greedy in one call: the target's argmax after each new token (B, T) int64
    and the state at each captured boundary (csrc/layer.cpp's greedy_chain_forward)."""
    stack, tail = args
    norm, lm_head, bits, vocab = tail.tail
    out: list[torch.Tensor] = _greedy_op()(
        ids.contiguous(), lengths, embed, tail.inv_freq, stack.layers, cache_k, cache_v,
        list(capture), norm, lm_head, bits, vocab,
    )  # fmt: skip
    return out[0], out[1:]


def step_fits(x: torch.Tensor, k_cache: torch.Tensor, plan: CachePlan) -> bool:
    """The forward's side of the conditions (module doc): eager, CPU, dtypes, shapes. The same
    for every layer of a forward (their caches share dtype and shape): Transformer.body asks
    once."""
    return kernel_takes(plan, x.shape[1]) and _step_fits(x, k_cache)


def _step_fits(x: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """step_fits without the plan: what a chain's forward (greedy_chain, head_chain), whose
    plan the op makes and the kernel always takes, asks."""
    return (
        cpu_rowops.eager_cpu(x, k_cache)
        and k_cache.dtype == x.dtype
        and k_cache.shape[-1] % 32 == 0
        and k_cache.shape[-1] in cpu_attention.HEAD_DIMS
        and _load() is None
    )


def draft_args(
    layer: nn.Module, h: torch.Tensor, k_cache: torch.Tensor, plan: CachePlan
) -> LayerArgs | None:
    """The same for an EAGLE-3 head layer (draft/eagle3.py's MidLayer or DecoderLayer) taken from
    its attention input h (B, T, Cin) on."""
    if not step_fits(h, k_cache, plan):
        return None
    args = _draft_args(layer)
    return args if args.fused else None


@dataclass(frozen=True, slots=True)
class HeadArgs:
    """What the `head` op takes from a one-layer EAGLE-3 head (draft/eagle3.py's Eagle3Head)
    besides its inputs, cache and plan, read and checked as LayerArgs are."""

    lead: tuple[object, ...]  # inv_freq, embedding, input/hidden/MLP norm weights, final norm
    flags: tuple[object, ...]  # eps, norm_before_residual, feed_normed
    layer: LayerArgs  # the MidLayer's (draft_args)
    lm_head: tuple[object, ...]  # weight, bits, output size
    # combine in the op: (fc weight, bits) for an fc without norms or bias, (None, 0) for a head
    # without fc; () where combine runs in Python first
    fc: tuple[object, ...]
    fused: bool
    sources: Checks

    def current(self) -> bool:
        return self.sources.current()


def head_args(
    head: nn.Module, hidden: torch.Tensor, k_cache: torch.Tensor, plan: CachePlan
) -> HeadArgs | None:
    """The `head` op's arguments for a step of this EAGLE-3 head, or None where the op does not
    take it: the forward's side as `step_fits`; the head of one layer, its MidLayer fused, its
    norms of one eps, its lm_head w4a8's (4- or 8-bit, no bias) and its embedding dense."""
    if not kernel_takes(plan, hidden.shape[1]):
        return None
    return head_chain_args(head, hidden, k_cache)


def head_chain_args(
    head: nn.Module, hidden: torch.Tensor, k_cache: torch.Tensor
) -> HeadArgs | None:
    """head_args without the plan: for the `head_chain` op (a chain after each row's committed
    length, whose plan the op makes), and head_args' own but for the plan."""
    if not _step_fits(hidden, k_cache):
        return None
    kept: HeadArgs = _kept(head, "fused_head_args", lambda: _head_build(head))
    return kept if kept.fused else None


@functools.cache
def _head_chain_op() -> Callable[..., list[torch.Tensor]]:
    """The head_chain op's C++ entry, past its Python wrapper (_decoder_op says why)."""
    overload = torch.ops.eaglespec_layer.head_chain.default
    return getattr(overload, "_op", overload)


def head_chain(
    args: HeadArgs,  # head_chain_args
    ids: torch.Tensor,  # (B, T) int64 target-vocabulary ids, a chain per row
    states: list[torch.Tensor],  # A x (B, T, Ct) target states with `combine`, else [(B, T, C)]
    combine: bool,  # states are target states for fc (only where args.fc)
    lengths: list[int],  # each row's committed length in the head's cache
    last: list[int],  # each row's token whose logits and state are returned
    k_cache: torch.Tensor,  # (B, Hkv, S, D) the head cache's layer, written
    v_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eagle3Head.feed_last / step_last in one call (csrc/layer.cpp's head_chain_forward):
    each row's (B, Vd) fp32 logits and (B, C) next state at its token last[b]."""
    fc, fc_bits = args.fc if combine else (None, 0)
    out: list[torch.Tensor] = _head_chain_op()(
        ids.contiguous(), states, fc, fc_bits, lengths, last, *args.lead, *args.flags,
        *args.layer.matrices, k_cache, v_cache, args.layer.num_heads, *args.lm_head,
    )  # fmt: skip
    return out[0], out[1]


def _head_build(head: nn.Module) -> HeadArgs:
    sources: Sources = []
    mid = _read(head, "midlayer", sources)
    layer = _draft_args(mid)
    sources += layer.sources.entries()
    norms = [_read(mid, n, sources) for n in ("input_layernorm", "hidden_norm")]
    final = _read(head, "norm", sources)
    embed = _read(head, "embed", sources)
    out = _w4a8_matrix(_read(head, "lm_head", sources), sources)
    eps = {_read(n, "eps", sources) for n in [*norms, *([final] if final is not None else [])]}
    fused = (
        layer.fused
        and _absent(_read(head, "extra_layers", sources)._modules, "0", sources)
        and type(embed) is nn.Embedding
        and _read(embed, "max_norm", sources) is None
        and out is not None
        and eps == {layer.norms[1]}
    )
    if not fused or out is None:
        return HeadArgs((), (), layer, (), (), False, Checks.of(sources))
    cfg = _read(head, "cfg", sources)
    fc = _read(head, "fc", sources)
    fc_matrix = _w4a8_matrix(fc, sources)
    # combine in the op: fc without norms or bias, or no fc (the one state as is); else ()
    takes_fc: tuple[object, ...] = ()
    if fc is None:
        takes_fc = (None, 0)
    elif (
        fc_matrix is not None
        and _read(head, "input_norm", sources) is None
        and _read(head, "fc_norm", sources) is None
    ):
        takes_fc = fc_matrix[:2]  # its output size is the head's width
    return HeadArgs(
        lead=(
            _read(head, "inv_freq", sources),
            _read(embed, "weight", sources),
            *(_read(n, "weight", sources) for n in norms),
            layer.norms[0],
            None if final is None else _read(final, "weight", sources),
        ),
        flags=(layer.norms[1], _read(mid, "norm_before_residual", sources), cfg.feed_normed),
        layer=layer,
        lm_head=out,
        fc=takes_fc,
        fused=True,
        sources=Checks.of(sources),
    )


def forward_head(
    args: HeadArgs,
    ids: torch.Tensor,  # (B, T) int64 target-vocabulary ids
    states: list[torch.Tensor],  # A x (B, T, Ct) target states with `combine`, else [(B, T, C)]
    combine: bool,  # states are target states for fc (only where args.fc)
    positions: torch.Tensor,  # (B, T) int64
    k_cache: torch.Tensor,  # (B, Hkv, S, D) the head cache's layer, written
    v_cache: torch.Tensor,
    plan: CachePlan,
    logit_index: torch.Tensor | None,  # (B, T') or None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eagle3Head.body (after Eagle3Head.combine with `combine`) in one call -> (B, T', Vd) fp32
    logits and the (B, T, C) next state."""
    fc, fc_bits = args.fc if combine else (None, 0)
    out: list[torch.Tensor] = torch.ops.eaglespec_layer.head(
        ids,
        states,
        fc,
        fc_bits,
        positions,
        *args.lead,
        *args.flags,
        *args.layer.matrices,
        k_cache,
        v_cache,
        plan.slots,
        plan.num_keys,
        plan.mask,
        args.layer.num_heads,
        logit_index,
        *args.lm_head,
    )
    return out[0], out[1]


def fits(block: Block, x: torch.Tensor, k_cache: torch.Tensor, plan: CachePlan) -> bool:
    """Whether the fused op takes this layer's forward."""
    return step_fits(x, k_cache, plan) and block_args(block) is not None


def forward(
    args: LayerArgs,  # layer_args of the block
    x: torch.Tensor,  # (B, T, C)
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin (B, T, 1, D)
    k_cache: torch.Tensor,  # (B, Hkv, S, D) this layer's cache, written
    v_cache: torch.Tensor,
    plan: CachePlan,
) -> torch.Tensor:
    """Block.forward (or SandwichBlock.forward) in one call -> (B, T, C)."""
    rest = _op_args(args, rope, k_cache, v_cache, plan)
    if args.sandwich:
        out: torch.Tensor = torch.ops.eaglespec_layer.sandwich(x, *rest, args.q_ratio)
        return out
    out = torch.ops.eaglespec_layer.forward(x, *rest, *args.qk_norms)
    return out


def fused_forward(
    block: Block | SandwichBlock,
    x: torch.Tensor,  # (B, T, C)
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin (B, T, 1, D)
    k_cache: torch.Tensor,  # (B, Hkv, S, D) this layer's cache, written
    v_cache: torch.Tensor,
    plan: CachePlan,
) -> torch.Tensor | None:
    """The block's forward through the fused op where it takes it, else None (the caller runs
    the Python forward): what Block.forward and SandwichBlock.forward both try first."""
    args = block_args(block) if step_fits(x, k_cache, plan) else None
    return None if args is None else forward(args, x, rope, k_cache, v_cache, plan)


def forward_draft(
    args: LayerArgs,  # draft_args of the head layer
    h: torch.Tensor,  # (B, T, Cin) the normed attention input
    residual: torch.Tensor,  # (B, T, C) what attention's output is added to
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin (B, T, 1, D)
    k_cache: torch.Tensor,  # (B, Hkv, S, D) the head cache's layer, written
    v_cache: torch.Tensor,
    plan: CachePlan,
) -> torch.Tensor:
    """The head layer from its attention input on, in one call -> (B, T, C): the ops of
    DraftAttention, the residual add and the MLP block, in their order."""
    out: torch.Tensor = torch.ops.eaglespec_layer.forward_from(
        residual, h, *_op_args(args, rope, k_cache, v_cache, plan)
    )
    return out


def _op_args(
    args: LayerArgs,
    rope: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: CachePlan,
) -> tuple[object, ...]:
    """What the ops take after their inputs, in their order: the norms, the packed matrices
    with biases and output sizes, RoPE, the caches, the plan's slots, key count and mask, the
    head count (`sandwich` then its query scale)."""
    return (
        *args.norms,
        *args.matrices,
        *rope,
        k_cache,
        v_cache,
        plan.slots,
        plan.num_keys,
        plan.mask,
        args.num_heads,
    )
