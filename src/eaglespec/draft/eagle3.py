"""The EAGLE-3 draft head (spec section 1.2): fc over captured target states, one decoder layer
whose attention reads the concatenation (token embedding, hidden), optional plain layers, a final
norm and an lm_head over the draft vocabulary, mapped back to target ids through d2t.

Dims: B batch, T new tokens, K attended keys, H / Hkv query and KV heads, D head dim, C draft
hidden, Ct target hidden, A captured target states, V target vocab, Vd draft vocab, I MLP width.

Two entry points, and the caller decides which hidden goes in (never inferred from its width):
  combine(aux)   target states at the capture boundaries, A x (B, T, Ct) -> g (B, T, C): fc
  forward(...)   token ids + hidden (B, T, C): g from `combine`, or the head's own previous
                 `prenorm` output (no fc) -> DraftOutput(logits over Vd, prenorm)
  feed(...)      token ids + target states: forward over combine(aux), fc in the same fused
                 C++ call where the eager CPU step takes the head (prefills and catch-ups)

Token/feature alignment (spec section 1.7) is the caller's job: draft position p takes the pair
(token x_{p+1}, feature g_p) at RoPE position p, and its logits there predict x_{p+2}.
Worked example: prompt x0 x1 x2 x3; the target's prefill gives g0..g3 and samples x4.
    draft prefill   input_ids [x1 x2 x3 x4], hidden combine([g0 g1 g2 g3]), positions [0 1 2 3]
                    -> logits at position 3 propose d5 (for x5); prenorm[3] is its state
    draft step      input_ids [to_target(d5)], hidden prenorm[3], position [4] -> d6, ...
The last prompt position cannot be drafted until the target has sampled the token after it.

Cache protocol (as the target's `Transformer.forward`): one cache layer per draft layer; forward
writes T new entries after each row's committed length and attends over the committed prefix plus
the new tokens (causal, or the (B, T, T) tree mask among them); the caller commits with
`cache.advance` / `cache.keep` or forgets scratch with `cache.truncate`. Positions are explicit.

Embedding and lm_head may be the target's own modules (shared objects, no copies): moving or
casting the head moves them too, so cast the target, never the head alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from eaglespec.cache import CachePlan, KVCache
from eaglespec.draft.config import DraftConfig
from eaglespec.model import cpu_layer
from eaglespec.model.layers import (
    GatedMLP,
    RMSNorm,
    cached_attention,
    embedding,
    rope_cos_sin,
    rope_inv_freq,
)
from eaglespec.model.llama import (
    COMPILE_MAX_TOKENS,
    check_compile_mode,
    compile_module,
    compile_whole,
)


@dataclass(slots=True)
class DraftOutput:
    logits: torch.Tensor  # (B, T', Vd) fp32 over the DRAFT vocab; T' = T or logit_index columns
    # (B, T, C) the state that feeds the next draft step: pre-norm, or post-norm for speculators
    # drafts with `norm_output: true` (DraftConfig.feed_normed)
    prenorm: torch.Tensor


class DraftAttention(nn.Module):
    """Llama attention with a configurable input width (2C in the midlayer, C after)."""

    def __init__(self, cfg: DraftConfig, in_dim: int) -> None:
        super().__init__()
        self.cfg = cfg
        # q, k, v rows fused into one matmul: [q (H*D); k (Hkv*D); v (Hkv*D)]
        self.wqkv = nn.Linear(in_dim, cfg.q_size + 2 * cfg.kv_size, bias=False)
        self.wo = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, in_dim)
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin (B, T, 1, D)
        k_cache: torch.Tensor,  # (B, Hkv, S, D) this layer's cache
        v_cache: torch.Tensor,
        plan: CachePlan,
    ) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.wqkv(x).view(B, T, H + 2 * Hkv, D)
        y: torch.Tensor = self.wo(cached_attention(qkv, rope, k_cache, v_cache, plan, H))
        return y


class MidLayer(nn.Module):
    """Draft layer 0: attention over cat(input_layernorm(embedding), hidden_norm(g)), with the
    raw g (or hidden_norm(g) under norm_before_residual) as the residual."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        C, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(C, eps)  # on the token embedding
        self.hidden_norm = RMSNorm(C, eps)  # on g
        self.attn = DraftAttention(cfg, 2 * C)
        self.post_attention_layernorm = RMSNorm(C, eps)
        self.mlp = GatedMLP(C, cfg.intermediate_size, bias=False)

    def forward(
        self,
        emb: torch.Tensor,  # (B, T, C) token embeddings
        g: torch.Tensor,  # (B, T, C) fused target features or the previous draft state
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,  # (B, Hkv, S, D) the head cache's layer 0
        v_cache: torch.Tensor,
        plan: CachePlan,
    ) -> torch.Tensor:
        x, residual = self.attn_input(emb, g)
        fused = cpu_layer.draft_args(self, x, k_cache, plan)
        if fused is not None:  # eager w4a8 on CPU: the ops in C++
            return cpu_layer.forward_draft(fused, x, residual, rope, k_cache, v_cache, plan)
        attn = self.attn(x, rope, k_cache, v_cache, plan)
        return self.after_attn(residual, attn)

    # The two halves around attention, shared with training (train/ttt.py), whose attention
    # differs (the training-time-test mask over unrolled steps) but whose layer must not.
    def attn_input(self, emb: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, C) embedding and hidden -> attention input (B, T, 2C), residual (B, T, C)."""
        h = self.hidden_norm(g)
        residual = h if self.norm_before_residual else g
        return torch.cat((self.input_layernorm(emb), h), dim=-1), residual  # embedding first

    def after_attn(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = residual + attn_out  # (B, T, C)
        y: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return y


class DecoderLayer(nn.Module):
    """Draft layers 1.. (num_hidden_layers > 1): a plain pre-norm Llama layer of width C, as
    vLLM runs them (`layer_idx > 0`)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        C, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(C, eps)
        self.attn = DraftAttention(cfg, C)
        self.post_attention_layernorm = RMSNorm(C, eps)
        self.mlp = GatedMLP(C, cfg.intermediate_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, C)
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,  # (B, Hkv, S, D) its layer of the head's cache
        v_cache: torch.Tensor,
        plan: CachePlan,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        fused = cpu_layer.draft_args(self, h, k_cache, plan)
        if fused is not None:
            return cpu_layer.forward_draft(fused, h, x, rope, k_cache, v_cache, plan)
        x = x + self.attn(h, rope, k_cache, v_cache, plan)
        y: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return y


class Eagle3Head(nn.Module):
    d2t: torch.Tensor  # (Vd,) int64 offsets: target_id = draft_id + d2t[draft_id]
    inv_freq: torch.Tensor  # (D/2,) fp32, from the DRAFT config's rope_theta / rope_scaling

    def __init__(
        self,
        cfg: DraftConfig,
        num_aux: int,
        *,
        embed: nn.Embedding | None = None,
        lm_head: nn.Module | None = None,
    ) -> None:
        """`num_aux` captured states feed fc (1 and no fc when not `use_aux_hidden_state`).
        `embed` / `lm_head` given: the head uses these modules (the target's) instead of its own;
        `lm_head` may be any (..., C) -> (..., Vd) module with a `weight`, e.g. a quantized one."""
        super().__init__()
        C, Ct, eps = cfg.hidden_size, cfg.target_hidden_size, cfg.rms_norm_eps
        if not cfg.use_aux_hidden_state and (num_aux != 1 or Ct != C):
            raise ValueError(
                f"without fc the head takes one state of width {C}, not {num_aux}x{Ct}"
            )
        self.cfg = cfg
        self.num_aux = num_aux
        self.shares_embed = embed is not None
        self.shares_lm_head = lm_head is not None
        # The lm_head holds the target's output rows of the draft vocabulary, frozen: not saved
        # with the head, gathered from the target at load (draft/loader.py).
        self.lm_head_is_target_rows = False
        self.embed = embed if embed is not None else embedding(cfg.vocab_size, C)
        if tuple(self.embed.weight.shape) != (cfg.vocab_size, C):
            raise ValueError(f"embedding {tuple(self.embed.weight.shape)} != {(cfg.vocab_size, C)}")
        use_fc = cfg.use_aux_hidden_state
        self.input_norm = RMSNorm(num_aux * Ct, eps) if use_fc and cfg.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(Ct, eps) for _ in range(num_aux))
            if use_fc and cfg.fc_norm
            else None
        )
        self.fc = nn.Linear(num_aux * Ct, C, bias=cfg.fc_bias) if use_fc else None
        self.midlayer = MidLayer(cfg)
        self.extra_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(1, cfg.num_layers))
        self.norm = RMSNorm(C, eps) if cfg.final_norm or cfg.feed_normed else None
        self.lm_head: nn.Module
        if lm_head is not None:
            self.lm_head = lm_head
        else:
            own = nn.Linear(C, cfg.draft_vocab_size, bias=False)
            if cfg.tie_word_embeddings:  # then draft_vocab_size == vocab_size (DraftConfig)
                own.weight = self.embed.weight
            self.lm_head = own
        if weight_shape(self.lm_head) != (cfg.draft_vocab_size, C):
            raise ValueError(f"lm_head {weight_shape(self.lm_head)} != {(cfg.draft_vocab_size, C)}")
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # Set by `compile_steps("full")`: the compiled `body`, used for steps of few tokens.
        self.compiled_body: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    # From a norm weight: norms stay in the activation dtype when linear layers get quantized.
    @property
    def dtype(self) -> torch.dtype:
        return self.midlayer.hidden_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.midlayer.hidden_norm.weight.device

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

    def combine(self, aux: Sequence[torch.Tensor]) -> torch.Tensor:
        """A target states (each (B, T, Ct), in capture order) -> g (B, T, C): the optional norms
        (input_norm over the concatenation, then fc_norm per state, as vLLM orders them), then fc.
        Only target states go through here; the head's own outputs never meet fc."""
        Ct = self.cfg.target_hidden_size
        self.check_states(aux)
        if self.fc is None:
            return aux[0]  # use_aux_hidden_state false: the last layer's state, as is
        x = torch.cat(list(aux), dim=-1)  # (B, T, A*Ct): low -> high
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            chunks = torch.split(x, Ct, dim=-1)
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        g: torch.Tensor = self.fc(x)
        return g

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T) int64 TARGET-vocab ids (map draft picks with to_target)
        hidden: torch.Tensor,  # (B, T, C) combine() output or the previous step's prenorm
        positions: torch.Tensor,  # (B, T) int64 RoPE positions
        cache: KVCache,
        attn_mask: torch.Tensor | None = None,  # (B, T, T) bool among new tokens; None = causal
        logit_index: torch.Tensor | None = None,  # (B, T') columns of T to project; None = all
    ) -> DraftOutput:
        """Writes T new K/V entries per draft layer after each row's committed length; the caller
        commits them. Returns fp32 draft-vocab logits and the state for the next step."""
        return self._step(input_ids, [hidden], False, positions, cache, attn_mask, logit_index)

    def feed(
        self,
        input_ids: torch.Tensor,  # (B, T) int64 TARGET-vocab ids
        aux: Sequence[torch.Tensor],  # A x (B, T, Ct) target states, as `combine` takes them
        positions: torch.Tensor,  # (B, T) int64 RoPE positions
        cache: KVCache,
        logit_index: torch.Tensor | None = None,  # (B, T') columns of T to project; None = all
    ) -> DraftOutput:
        """`forward(input_ids, combine(aux), ...)`: the prefill and catch-up form. Where the
        fused step takes the head (eager w4a8 on CPU), fc runs in the same C++ call."""
        return self._step(input_ids, list(aux), True, positions, cache, None, logit_index)

    def feed_last(
        self,
        input_ids: torch.Tensor,  # (B, T) int64 TARGET-vocab ids, a chain per row
        aux: Sequence[torch.Tensor],  # A x (B, T, Ct) target states, as `combine` takes them
        cache: KVCache,
        last: list[int],  # row b's token whose logits and state are returned
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`feed` after each row's committed length (positions length + t), then row b's fp32
        logits (B, Vd) and next state (B, C) at its token last[b]: a catch-up, as the proposer
        reads it. Where the fused step takes the head it is one C++ call with the plan and the
        picks in it (cpu_layer.head_chain): the same bits, without the host work that runs cold
        after the target's weight stream."""
        return self._last(input_ids, list(aux), True, cache, last)

    def step_last(
        self,
        input_ids: torch.Tensor,  # (B, 1) int64 TARGET-vocab ids
        hidden: torch.Tensor,  # (B, 1, C) the previous step's state
        cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` of one token per row after its committed length: its fp32 logits (B, Vd)
        and next state (B, C), as feed_last gives them."""
        return self._last(input_ids, [hidden], False, cache, [0] * input_ids.shape[0])

    def _last(
        self,
        input_ids: torch.Tensor,  # (B, T) int64
        states: list[torch.Tensor],  # target states with `combine`, else [hidden (B, T, C)]
        combine: bool,
        cache: KVCache,
        last: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = input_ids.shape
        fused = None
        if self.compiled_body is None:
            fused = cpu_layer.head_chain_args(self, states[0], cache.k_layers[0])
        if fused is not None and (fused.fc or not combine):
            if combine:
                self.check_states(states)
            else:
                self.check_hidden(states[0], B, T)
            assert cache.batch == B, f"cache has {cache.batch} rows, input has {B}"
            cache.check_room(T)
            return cpu_layer.head_chain(
                fused, input_ids, states, combine, cache.lengths, last, cache.k_layers[0],
                cache.v_layers[0],
            )  # fmt: skip
        dev = input_ids.device
        positions = cache.write_slots(T)  # (B, T): a chain's positions are its slots
        if combine:  # a catch-up: the logits at each row's last (as the proposer always asked)
            index = torch.tensor(last, device=dev)[:, None]  # (B, 1)
            out = self._step(input_ids, states, combine, positions, cache, None, index)
            return out.logits[:, 0], out.prenorm[torch.arange(B, device=dev), index[:, 0]]
        # a draft step, one token a row: all logits (a compiled head's graph for draft steps)
        out = self._step(input_ids, states, combine, positions, cache, None, None)
        return out.logits[:, -1], out.prenorm[:, -1]

    def _step(
        self,
        input_ids: torch.Tensor,  # (B, T) int64
        states: list[torch.Tensor],  # target states with `combine`, else [hidden (B, T, C)]
        combine: bool,
        positions: torch.Tensor,  # (B, T) int64
        cache: KVCache,
        attn_mask: torch.Tensor | None,
        logit_index: torch.Tensor | None,
    ) -> DraftOutput:
        B, T = input_ids.shape
        assert positions.shape == (B, T), f"positions {tuple(positions.shape)} != {(B, T)}"
        assert cache.batch == B, f"cache has {cache.batch} rows, input has {B}"
        plan = cache.plan(T, attn_mask)
        compiled = (
            self.compiled_body is not None and T <= COMPILE_MAX_TOKENS and not plan.prefix_free
        )
        if not compiled:
            fused = cpu_layer.head_args(self, states[0], cache.k_layers[0], plan)
            if fused is not None and (fused.fc or not combine):  # the whole step in one C++ call
                if combine:
                    self.check_states(states)
                else:
                    self.check_hidden(states[0], B, T)
                logits, prenorm = cpu_layer.forward_head(
                    fused, input_ids, states, combine, positions, cache.k_layers[0],
                    cache.v_layers[0], plan, logit_index,
                )  # fmt: skip
                return DraftOutput(logits=logits, prenorm=prenorm)
        hidden = self.combine(states) if combine else states[0]
        self.check_hidden(hidden, B, T)
        body = self.compiled_body if compiled else self.body
        logits, prenorm = body(
            input_ids, hidden, positions, cache.k_layers, cache.v_layers, plan, logit_index
        )
        return DraftOutput(logits=logits, prenorm=prenorm)

    def check_hidden(self, hidden: torch.Tensor, B: int, T: int) -> None:
        C = self.cfg.hidden_size
        assert hidden.shape == (B, T, C), f"hidden {tuple(hidden.shape)} != {(B, T, C)}"
        assert hidden.dtype == self.dtype, f"hidden is {hidden.dtype}, the head {self.dtype}"

    def check_states(self, aux: Sequence[torch.Tensor]) -> None:
        Ct = self.cfg.target_hidden_size
        assert len(aux) == self.num_aux, (
            f"{len(aux)} captured states, the head takes {self.num_aux}"
        )
        for a in aux:
            assert a.shape[-1] == Ct and a.dtype == self.dtype, (
                f"captured state {tuple(a.shape)} {a.dtype}, expected (..., {Ct}) {self.dtype}"
            )

    def body(
        self,
        input_ids: torch.Tensor,  # (B, T) int64
        hidden: torch.Tensor,  # (B, T, C)
        positions: torch.Tensor,  # (B, T) int64
        k_layers: Sequence[torch.Tensor],  # num_layers x (B, Hkv, S, D)
        v_layers: Sequence[torch.Tensor],
        plan: CachePlan,
        logit_index: torch.Tensor | None,  # (B, T') or None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's tensor work: (B, T', Vd) fp32 logits and the (B, T, C) state for the next
        step. `compile_steps("full")` compiles it whole."""
        B = input_ids.shape[0]
        rope = rope_cos_sin(positions, self.inv_freq, self.dtype)
        emb = self.embed(input_ids)
        x = self.midlayer(emb, hidden, rope, k_layers[0], v_layers[0], plan)  # (B, T, C)
        for i, layer in enumerate(self.extra_layers, start=1):
            x = layer(x, rope, k_layers[i], v_layers[i], plan)
        if self.cfg.feed_normed and self.norm is not None:
            x = self.norm(x)  # the post-norm state feeds both lm_head and the next step
            final = None
        else:
            final = self.norm  # None when a native config says norm_output: false
        y = x
        if logit_index is not None:
            rows = torch.arange(B, device=x.device)[:, None]
            y = x[rows, logit_index]  # (B, T', C)
        if final is not None:
            y = final(y)
        logits: torch.Tensor = self.lm_head(y).float()  # (B, T', Vd)
        return logits, x

    def compile_steps(self, mode: str) -> None:
        """torch.compile the head's steps of few tokens (draft steps, catch-ups; prefills stay
        eager), as the target's modes do: "block" compiles each layer (attention + MLP) and
        leaves the cache plan's tensors, embedding, norm and lm_head eager; "full" compiles
        `body` whole, one graph per step. Shapes are dynamic: one graph for single-token draft
        steps, one for longer forwards."""
        check_compile_mode(mode)
        if mode == "none":
            self.compiled_body = None
            return
        if mode == "block":
            compile_module(self.midlayer)
            for layer in self.extra_layers:
                compile_module(layer)
            self.compiled_body = None
        else:
            self.compiled_body = compile_whole(self.body)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids (any shape) -> target-vocab ids: d + d2t[d]."""
        return draft_ids + self.d2t[draft_ids]


def weight_shape(module: nn.Module) -> tuple[int, ...]:
    """The shape of `module.weight` (a Parameter, or a buffer in quantized layers)."""
    w = module.weight
    assert isinstance(w, torch.Tensor), f"{type(module).__name__} has no weight tensor"
    return tuple(w.shape)
