"""Training-time test (spec section 4): the EAGLE-3 head unrolled over J draft steps on whole
sequences, the way it runs at inference, and its loss.

Dims: B batch, T positions, C draft hidden, Ct target hidden, A captured states, H / Hkv query and
KV heads, D head dim, V target vocab, Vd draft vocab, J unrolled steps.

Alignment (draft/eagle3.py): sequence x_0 .. x_{T-1}, target states aux_p and target logits l_p at
each position (l_p predicts x_{p+1}). At step j, draft position p takes token x_{p+1+j} at RoPE
position p + j, with hidden fc(aux_p) at step 0 or the step j-1 pre-norm output at p after that,
and is trained towards softmax(l_{p+1+j}) restricted to the draft vocabulary.
Worked example: at inference, prompt x_0 x_1 x_2, the target samples x_3; the draft's committed
positions 0..2 read x_1..x_3, position 2 proposes d_4, then chain step 1 reads d_4 at RoPE
position 3 with position 2's pre-norm output and proposes d_5. In training, step 0 at p = 2 reads
x_3 and learns l_3 (for x_4); step 1 at p = 2 reads x_4 at RoPE position 3 with step 0's output at
p = 2 and learns l_4 (for x_5): the same computation, with the true x_4 in place of d_4.

Attention at step j, position p (the "simulated tree"): the step-0 keys at positions <= p (at
inference: the committed prefix, written from target states) plus the keys of steps 1..j at
position p only (at inference: the chain's earlier draft tokens). As one SDPA call the keys are
[K_0 | K_1 | .. | K_j], (J+1)T columns, under the mask [causal | I | .. | I].

Loss mask at step j, position p: x_{p+2+j} is a response token and the target's own top-1 at
p+1+j is in the draft vocabulary (a draft cannot propose it otherwise). The per-step loss sums
are returned with their counts; the trainer normalises and weights them (decay^j), so that the
normaliser can be global across DistributedDataParallel ranks.

Losses at one position, p the target's distribution over the draft vocabulary, q the draft's:
- "ce": the soft cross-entropy -sum_x p(x) log q(x) (KL(p || q) up to p's entropy), EAGLE's.
- "lk": LK's negative log acceptance (Samarin et al. 2026, arXiv 2602.23881), -log alpha with
  alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q), the probability that sampled verification accepts
  a draft drawn from q: the loss aims at acceptance itself, where a small head's KL optimum need
  not; its gradient is TV's scaled by 1 / alpha, so it does not vanish while alpha is small.
- "topk": HASS's harmonized objective distillation (Zhang et al. 2024, arXiv 2408.15766), ce plus
  the same sum again over the target's TOPK most likely tokens only, -sum_{x in top-K(p)} p(x)
  log q(x) (K 10, weight 1, HASS's defaults): the head's capacity goes first to ranking the
  tokens a draft tree or chain would actually propose.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eaglespec.draft.eagle3 import Eagle3Head
from eaglespec.model.layers import apply_rope, rope_cos_sin


@dataclass(slots=True)
class TTTBatch:
    ids: torch.Tensor  # (B, T) int64 target-vocab ids, right-padded with 0
    aux: torch.Tensor  # (B, T, A*Ct) captured target states, concatenated low -> high
    target_logp: torch.Tensor  # (B, T, Vd) fp32 target log-probs over the draft vocabulary
    target_valid: torch.Tensor  # (B, T) bool: target top-1 (full vocab) is in the draft vocab
    loss_mask: torch.Tensor  # (B, T) bool: x_t is a response token (padding False)


@dataclass(slots=True)
class TTTOutput:
    loss_sums: list[torch.Tensor]  # J scalars: sum over valid positions of the loss
    counts: torch.Tensor  # (J,) int64 valid positions per step
    correct: torch.Tensor  # (J,) int64 positions whose draft top-1 equals the target's
    # (J,) int64 positions whose chain from step 0 through step j was all correct: the
    # greedy acceptance proxy (mean accepted drafts per anchor = chain.sum() / counts[0])
    chain: torch.Tensor
    logp: list[torch.Tensor] | None = None  # J x (B, T, Vd) draft log-probs, when asked for


def check_trainable(head: Eagle3Head) -> None:
    cfg = head.cfg
    if cfg.num_layers != 1 or cfg.feed_normed or not cfg.final_norm:
        raise ValueError(
            "training supports the standard EAGLE-3 head: one layer, final norm, pre-norm feedback"
        )


LOSSES = ("ce", "lk", "topk")
TOPK = 10  # "topk": the target's most likely tokens whose cross-entropy counts twice (HASS's K)


def ttt_forward(
    head: Eagle3Head, batch: TTTBatch, steps: int, *, keep_logp: bool = False, loss: str = "ce"
) -> TTTOutput:
    """Run the head for `steps` unrolled steps over `batch`; gradients flow through all of them
    (step j's hidden is step j-1's output, as at inference). `keep_logp` also returns each
    step's draft log-probs (position p of step j predicts x_{p+2+j})."""
    check_trainable(head)
    cfg = head.cfg
    B, T = batch.ids.shape
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    device = batch.ids.device
    Ct = cfg.target_hidden_size
    g = head.combine(list(torch.split(batch.aux, Ct, dim=-1)))  # (B, T, C)
    base = torch.arange(T, device=device).expand(B, T)  # (B, T)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    loss_sums: list[torch.Tensor] = []
    counts, correct, chain = [], [], []
    alive = torch.ones(B, T, dtype=torch.bool, device=device)  # chain still all correct
    kept: list[torch.Tensor] = []
    mid = head.midlayer
    for j in range(steps):
        tokens = _shift(batch.ids, 1 + j)  # (B, T): x_{p+1+j}
        x, residual = mid.attn_input(head.embed(tokens), g)
        qkv = mid.attn.wqkv(x).view(B, T, H + 2 * Hkv, D)
        cos, sin = rope_cos_sin(base + j, head.inv_freq, qkv.dtype)
        qk = apply_rope(qkv[:, :, : H + Hkv], cos, sin)
        q = qk[:, :, :H].transpose(1, 2)  # (B, H, T, D)
        keys.append(qk[:, :, H:].transpose(1, 2))  # (B, Hkv, T, D)
        values.append(qkv[:, :, H + Hkv :].transpose(1, 2))
        mask = _ttt_mask(T, j, device)  # (T, (j+1)T)
        a = F.scaled_dot_product_attention(
            q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask, enable_gqa=Hkv != H
        )
        out = mid.after_attn(residual, mid.attn.wo(a.transpose(1, 2).reshape(B, T, H * D)))
        assert head.norm is not None
        valid = _shift(batch.loss_mask, 2 + j) & _shift(batch.target_valid, 1 + j)  # (B, T)
        if keep_logp:
            kept.append(F.log_softmax(head.lm_head(head.norm(out)).float(), dim=-1))
        # The lm_head (the widest matmul) only where the loss reads it: Nv valid positions.
        rows, cols = valid.nonzero(as_tuple=True)  # sync: training only
        logp = F.log_softmax(head.lm_head(head.norm(out[rows, cols])).float(), dim=-1)  # (Nv, Vd)
        target_logp = batch.target_logp[rows, cols + 1 + j]  # (Nv, Vd): l_{p+1+j}
        loss_sums.append(position_loss(logp, target_logp, loss).sum())
        hit = torch.zeros_like(valid)
        hit[rows, cols] = logp.argmax(-1) == target_logp.argmax(-1)
        alive = alive & hit
        counts.append(valid.sum())
        correct.append(hit.sum())
        chain.append(alive.sum())
        g = out  # the pre-norm output feeds the next step
    return TTTOutput(
        loss_sums=loss_sums,
        counts=torch.stack(counts),
        correct=torch.stack(correct),
        chain=torch.stack(chain),
        logp=kept if keep_logp else None,
    )


def position_loss(logq: torch.Tensor, logp: torch.Tensor, loss: str) -> torch.Tensor:
    """(N, Vd) draft and target log-probs -> (N,) the loss at each position (module doc)."""
    if loss == "lk":
        alpha = torch.minimum(logq, logp).exp().sum(-1)  # (N,) sum_x min(p, q)
        return -alpha.clamp(min=1e-12).log()
    if loss not in ("ce", "topk"):
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}, not {loss!r}")
    p = logp.exp()  # (N, Vd)
    ce = -(p * logq).sum(-1)  # (N,)
    if loss == "ce":
        return ce
    top = logp.topk(min(TOPK, logp.shape[-1]), dim=-1).indices  # (N, K) the target's top-K
    return ce - (p.gather(-1, top) * logq.gather(-1, top)).sum(-1)


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (B, T, ...) shifted left by n along T, the tail filled with zeros (False)."""
    out = torch.zeros_like(x)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def _ttt_mask(T: int, j: int, device: torch.device) -> torch.Tensor:
    """(T, (j+1)T) bool: causal over the step-0 keys, then one diagonal per later step.
    T = 3, j = 1:  [1 0 0 | 1 0 0]
                   [1 1 0 | 0 1 0]
                   [1 1 1 | 0 0 1]"""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * j, dim=1)
