"""The target model: one decoder configured by `ModelConfig`: the Llama family (Llama 2/3,
SmolLM2, Mistral, Qwen2/2.5, Qwen3) and Gemma 3's text models (`SandwichBlock` layers, scaled
embeddings, sliding-window layers with a RoPE base of their own).

Dims: B batch, T new tokens, K attended keys, H / Hkv heads, D head dim, C hidden, V vocab,
L layers.

`forward` takes everything it needs as arguments: token ids, explicit RoPE positions (tree nodes
share depths, so positions are not slots), the KV cache, an optional mask among the new tokens (a
tree mask) and the boundaries whose hidden states to capture for an EAGLE-3 draft. Capture boundary
b is the pre-norm residual stream after b decoder layers: b = 0 is the embedding output, b = L the
final pre-norm state (not transformers' `hidden_states[-1]`, which is post-norm).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

from eaglespec.cache import CachePlan, KVCache, sliding_plan
from eaglespec.config import ModelConfig
from eaglespec.errors import InvalidRequestError
from eaglespec.model import cpu_layer
from eaglespec.model.layers import (
    GatedMLP,
    RMSNorm,
    cached_attention,
    embedding,
    rope_cos_sin,
    rope_inv_freq,
)
from eaglespec.sampling import greedy_tokens

# Forwards of at most this many new tokens take the compiled body when compiling is on: decode
# steps, chain and tree verification (a 4,4,16 tree verifies 17 tokens), draft-model steps.
COMPILE_MAX_TOKENS = 64

# Inductor options of every compiled step. emulate_precision_casts: a fused kernel rounds each
# intermediate to the model dtype where eager would, instead of keeping it in fp32. Without it the
# one-token graph and the multi-token graph fuse differently, so in bf16 a verification forward
# rounded differently from the decode steps it stands for (measured on SmolLM2 bf16 w4a8-all with
# the whole body compiled: hidden states apart from the second layer on, greedy speculative output
# off plain greedy within 5-70 tokens); with it they are bitwise equal, at no measurable cost.
COMPILE_OPTIONS = {"emulate_precision_casts": True}


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor  # (B, T', V) fp32; T' = T, or the number of `logit_index` columns
    hidden: list[torch.Tensor]  # one (B, T, C) tensor per requested capture boundary, in order


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # q, k, v rows fused into one matmul: [q (H*D); k (Hkv*D); v (Hkv*D)]
        self.wqkv = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # The attention kernels scale scores by D ** -0.5; a model with a scale of its own
        # (Gemma 3's query_pre_attn_scalar) has its queries multiplied by the ratio first.
        ratio = 1.0 if cfg.query_scale is None else cfg.query_scale * cfg.head_dim**0.5
        self.q_ratio = None if ratio == 1.0 else ratio

    def forward(
        self,
        x: torch.Tensor,  # (B, T, C)
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin (B, T, 1, D)
        k_cache: torch.Tensor,  # (B, Hkv, S, D) this layer's cache
        v_cache: torch.Tensor,
        plan: CachePlan,
    ) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.wqkv(x).view(B, T, H + 2 * Hkv, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = qkv.split([H, Hkv, Hkv], dim=2)
            q = self.q_norm(q)
            if self.q_ratio is not None:
                q = q * self.q_ratio
            qkv = torch.cat((q, self.k_norm(k), v), 2)
        out = cached_attention(qkv, rope, k_cache, v_cache, plan, H)  # (B, T, H * D)
        y: torch.Tensor = self.wo(out)
        return y


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: CachePlan,
    ) -> torch.Tensor:
        fused = cpu_layer.fused_forward(self, x, rope, k_cache, v_cache, plan)
        if fused is not None:  # eager w4a8 on CPU: the same ops in C++
            return fused
        x = x + self.attn(self.attn_norm(x), rope, k_cache, v_cache, plan)
        y: torch.Tensor = x + self.mlp(self.mlp_norm(x))
        return y


class SandwichBlock(nn.Module):
    """Gemma 3's layer: Block's, with each sublayer's output normed again before its residual add
    (transformers' post_attention_layernorm and post_feedforward_layernorm) and the MLP's own
    input norm (pre_feedforward_layernorm, here mlp_norm). Eager on CPU with 4- and 8-bit
    matrices (w4a8-mixed) the same ops run in one C++ call (cpu_layer.py, the `sandwich` op)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.mlp_act)
        self.post_mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, C)
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: CachePlan,
    ) -> torch.Tensor:
        fused = cpu_layer.fused_forward(self, x, rope, k_cache, v_cache, plan)
        if fused is not None:  # eager w4a8(-mixed) on CPU: the same ops in C++
            return fused
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), rope, k_cache, v_cache, plan))
        y: torch.Tensor = x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))
        return y


class Transformer(nn.Module):
    inv_freq: torch.Tensor  # buffer, registered in __init__
    inv_freq_local: torch.Tensor | None  # the sliding layers' (Gemma 3), else None

    def __init__(self, cfg: ModelConfig, inv_freq: torch.Tensor | None = None) -> None:
        """`inv_freq` (D/2,) overrides the RoPE frequencies derived from `cfg` (GGUF files store
        llama3 scaling as per-frequency factors); pass it when building on the meta device."""
        super().__init__()
        self.cfg = cfg
        self.embed = embedding(cfg.vocab_size, cfg.hidden_size)
        block = SandwichBlock if cfg.sandwich_norms else Block
        self.layers = nn.ModuleList(block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        if inv_freq is None:
            inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (D/2,) fp32
        local = None
        if cfg.rope_local_theta is not None:
            local = rope_inv_freq(cfg.head_dim, cfg.rope_local_theta, None)
        self.register_buffer("inv_freq_local", local, persistent=False)  # (D/2,) fp32 or None
        # Set by `compile_steps`: the compiled `body`, used for forwards of few tokens.
        self.compiled_body: Callable[..., tuple[torch.Tensor, list[torch.Tensor]]] | None = None
        self.compile_max_tokens = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        cfg = self.cfg
        return KVCache.allocate(
            num_layers=cfg.num_layers,
            batch=batch,
            num_kv_heads=cfg.num_kv_heads,
            capacity=capacity,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T) int64
        positions: torch.Tensor,  # (B, T) int64 RoPE positions
        cache: KVCache,
        attn_mask: torch.Tensor | None = None,  # (B, T, T) bool among new tokens; None = causal
        capture: Sequence[int] = (),  # boundary indices b in [0, L]
        logit_index: torch.Tensor | None = None,  # (B, T') columns of T to project; None = all
    ) -> ForwardOutput:
        """Writes the T new K/V entries after each row's committed length; the caller commits them
        (`cache.advance` / `cache.keep`). Returns fp32 logits and the captured hidden states.

        Host-side work (the cache plan, checks) happens here; the tensor work is `body`, which
        `compile_steps` may replace by its compiled version for forwards of few tokens."""
        B, T = input_ids.shape
        assert positions.shape == (B, T), f"positions {tuple(positions.shape)} != {(B, T)}"
        assert cache.batch == B, f"cache has {cache.batch} rows, input has {B}"
        self._check_capture(capture)
        plan = cache.plan(T, attn_mask)
        body = self.body
        if self.compiled_body is not None and self.compile_max_tokens >= T and not plan.prefix_free:
            body = self.compiled_body
        logits, hidden = body(
            input_ids, positions, cache.k_layers, cache.v_layers, plan, tuple(capture), logit_index
        )
        return ForwardOutput(logits=logits, hidden=hidden)

    def greedy(
        self,
        input_ids: torch.Tensor,  # (B, T) int64, a chain of new tokens per row
        cache: KVCache,
        capture: Sequence[int] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The target's greedy choice after each new token, (B, T) int64, and the captured
        states: `forward` over a chain after each row's committed length (positions length + t,
        causal; the caller commits the entries), then sampling.greedy_tokens. Where `forward`
        would run the decoder op (eager w4a8 on CPU, llama layers) it is one C++ call, the plan,
        the embedding and the argmax in it, the logits never leaving it: the same bits,
        without the host work that runs cold after each step's weight stream."""
        B, T = input_ids.shape
        fused = None
        if self.compiled_body is None and not self.cfg.embed_scale and not self.cfg.sliding_layers:
            fused = cpu_layer.greedy_args(self, self.embed.weight, cache.k)
        if fused is None:  # a chain's positions are its cache slots
            out = self(input_ids, cache.write_slots(T), cache, capture=capture)
            return greedy_tokens(out.logits), out.hidden
        assert cache.batch == B, f"cache has {cache.batch} rows, input has {B}"
        self._check_capture(capture)
        cache.check_room(T)
        return cpu_layer.greedy_chain(
            fused, self.embed.weight, input_ids, cache.lengths, cache.k, cache.v, tuple(capture)
        )

    def _check_capture(self, capture: Sequence[int]) -> None:
        L = self.cfg.num_layers
        if any(not 0 <= b <= L for b in capture):
            raise ValueError(f"capture boundaries must be in [0, {L}], got {list(capture)}")

    def body(
        self,
        input_ids: torch.Tensor,  # (B, T) int64
        positions: torch.Tensor,  # (B, T) int64
        k_layers: Sequence[torch.Tensor],  # L x (B, Hkv, S, D)
        v_layers: Sequence[torch.Tensor],
        plan: CachePlan,
        capture: tuple[int, ...],
        logit_index: torch.Tensor | None,  # (B, T') or None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The forward's tensor work: (B, T', V) fp32 logits and one (B, T, C) state per capture."""
        cfg = self.cfg
        x = self.embed(input_ids)  # (B, T, C)
        if cfg.embed_scale:  # Gemma: the scale rounded to the dtype first, as transformers does
            x = x * torch.tensor(cfg.hidden_size**0.5, dtype=x.dtype)
        fusable = cpu_layer.step_fits(x, k_layers[0], plan)  # asked once, not per layer
        stack = cpu_layer.stack_args(self) if fusable else None
        tail = cpu_layer.logits_args(self, stack) if stack is not None else None
        # Sliding-window layers (Gemma 3): their own RoPE and the keys within their window.
        local_plan = plan
        if cfg.sliding_layers:
            assert cfg.sliding_window is not None
            local_plan = sliding_plan(plan, positions, cfg.sliding_window)
        if stack is not None and tail is not None:  # the rest of the forward in one call
            return cpu_layer.forward_decoder(
                stack, tail, x, positions, list(k_layers), list(v_layers), plan, capture,
                logit_index, (self.inv_freq_local, local_plan),
            )  # fmt: skip
        rope = rope_cos_sin(positions, self.inv_freq, self.dtype)
        local_rope = rope
        if cfg.sliding_layers and self.inv_freq_local is not None:
            local_rope = rope_cos_sin(positions, self.inv_freq_local, self.dtype)
        if stack is not None and not stack.sandwich:  # every layer's fused op in one call
            x, captured = cpu_layer.forward_stack(
                stack, x, rope, list(k_layers), list(v_layers), plan, capture
            )
            return self._logits(x, logit_index), captured
        # The state at every boundary (references, no copies), picked by `capture` at the end.
        # A dict keyed by the boundary ids breaks torch.compile's whole-body graph (dynamo
        # treats the ints of `capture` as symbolic and the dict lookup then misses).
        boundary = [x]
        for i, block in enumerate(self.layers):
            sliding = bool(cfg.sliding_layers) and cfg.sliding_layers[i]
            r, p = (local_rope, local_plan) if sliding else (rope, plan)
            fused = cpu_layer.block_args(block) if fusable else None
            if fused is not None:  # the block's fused path without the module call
                x = cpu_layer.forward(fused, x, r, k_layers[i], v_layers[i], p)
            else:
                x = block(x, r, k_layers[i], v_layers[i], p)
            boundary.append(x)
        return self._logits(x, logit_index), [boundary[b] for b in capture]

    def _logits(
        self,
        x: torch.Tensor,  # (B, T, C) the last layer's output
        logit_index: torch.Tensor | None,  # (B, T') or None
    ) -> torch.Tensor:
        """(B, T', V) fp32 logits of the columns `logit_index` picks (all when None)."""
        if logit_index is not None:
            rows = torch.arange(x.shape[0], device=x.device)[:, None]
            x = x[rows, logit_index]  # (B, T', C)
        logits: torch.Tensor = self.lm_head(self.norm(x)).float()
        return logits

    def compile_steps(self, mode: str, max_tokens: int = COMPILE_MAX_TOKENS) -> None:
        """Run forwards of at most `max_tokens` new tokens onto a cached prefix (decode steps,
        verification, draft-model steps) through torch.compile; prefills stay eager.

        mode "block": each decoder block is compiled (one graph that all blocks share, as
        their code is the same): fast to compile (measured for SmolLM2 on 2 cores: 27 s cold,
        5 s with inductor's on-disk cache warm); the Python loop over blocks remains.
        mode "full": `body` is compiled whole, one graph for all layers: the fastest step, but
        tracing 30 layers takes 50 s even with the disk cache warm (120 s cold).
        Shapes are dynamic from the start (keys, rows, tokens), so a generation compiles once
        for one-token steps and once for multi-token verification."""
        check_compile_mode(mode)
        if mode == "none":
            self.compiled_body = None
            return
        self.compile_max_tokens = max_tokens
        if mode == "block":
            for block in self.layers:
                compile_module(block)
            self.compiled_body = self.body
        else:
            self.compiled_body = compile_whole(self.body)


COMPILE_MODES = ("none", "block", "full")


def _dynamo_settings() -> None:
    """Process-wide dynamo settings every compiled step needs (vLLM sets the same ones).

    recompile_limit: dynamo keeps at most 8 graphs per code object by default. In block mode
    every layer class's `forward` is one code object shared by every model that compiles it (a
    target and a draft model, the test suite), which runs past 8 and then falls back to eager
    steps; full mode gives each step a code object of its own (`compile_whole`), but one step
    still takes several graphs (one-token steps, multi-token forwards, captures on or off).
    use_duck_shape off: by default two dynamic sizes equal when a graph is traced are assumed
    equal for good, so a 3-token verification of SmolLM2 (3 KV heads) compiled a graph for
    T == Hkv, and the next 2-token one compiled again, mid-generation (seconds, for the
    whole body). Without it, one graph serves every T > 1."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    fx_config.use_duck_shape = False


def compile_module(module: nn.Module) -> None:
    """Compile one layer in place ("block" mode): dynamic shapes, COMPILE_OPTIONS."""
    _dynamo_settings()
    module.compile(dynamic=True, options=COMPILE_OPTIONS)


def compile_whole(step: Callable[..., Any]) -> Callable[..., Any]:
    """A module's whole step (`step`, a bound method such as `Transformer.body`) as one graph
    ("full" mode). fullgraph: a graph break would silently fall back to eager frames (for the
    target: each block compiled alone, plus every frame's guard checks), so make it an error.

    Guards: before each call dynamo checks that the compiled graph still fits its inputs. On the
    module's own parameters and submodules that is thousands of checks (SmolLM2: 1.67 ms of a
    10 ms decode step), so they are skipped, and the step gets a code object of its own:
    dynamo keeps its graphs per code object, so no other instance of the class (a draft model, a
    quantized copy) can pick up this one's graph once module guards are gone. The contract that
    buys: the module's structure, parameter shapes and dtypes do not change after compiling
    (weights may change in place). Guards on the step's arguments (shapes, None or not, the
    capture ids) stay."""
    _dynamo_settings()
    bound_to = step.__self__  # type: ignore[attr-defined]
    fn = step.__func__  # type: ignore[attr-defined]
    own = types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    options = {
        **COMPILE_OPTIONS,
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
    }
    compiled = torch.compile(own, dynamic=True, fullgraph=True, options=options)
    return types.MethodType(compiled, bound_to)


def check_compile_mode(mode: str) -> str:
    if mode not in COMPILE_MODES:
        raise InvalidRequestError(
            f"unknown compile mode '{mode}' (supported: {', '.join(COMPILE_MODES)})"
        )
    return mode
