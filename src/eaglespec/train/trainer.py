"""Training loop for an EAGLE-3 head on captured features: batches, AdamW with warmup and decay,
gradient clipping, autocast (bf16 where the device has bf16 kernels), checkpoints with resume,
DistributedDataParallel under torchrun.

Batches are global: samples sorted by length are cut into batches of at most `batch_tokens` padded
positions, shuffled per epoch by a seeded generator, and each batch's rows are split across ranks
(rank r takes rows r, r + W, ...). Each step's loss is normalised by the GLOBAL count of valid
positions per unrolled step (an all-reduce), and multiplied by the world size because DDP averages
gradients: so W processes take exactly the gradient one process takes on the whole batch.

Loss: sum_j decay^j * L_j, with L_j the loss of step j averaged over its valid positions
(train/ttt.py: the soft cross-entropy, or LK's negative log acceptance).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from eaglespec.draft.eagle3 import Eagle3Head
from eaglespec.train.batching import length_batches
from eaglespec.train.features import FeatureShard
from eaglespec.train.meter import NEVER, Deadline
from eaglespec.train.ttt import LOSSES, TTTBatch, ttt_forward
from eaglespec.train.vocab import DraftVocab

AMP_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
AUTO = "auto"


def has_bf16_matmul(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 matrices with kernels made for them: a CUDA GPU that
    supports bf16, or a CPU where oneDNN has bf16 kernels (AVX-512 or AMX; its own check). On an
    AVX2 CPU torch takes a slow generic path instead: one TTT step of the SmolLM2 head under bf16
    autocast took 33x fp32's time (2026-11-28, AMD EPYC Zen 3, 2 threads; benchmarks/train_step.py,
    BENCHMARKS.md)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):  # a torch built without oneDNN
            return False
    return False


def autocast_dtype(dtype: str, device: torch.device) -> str:
    """`dtype` (a TrainConfig.dtype) with auto resolved for `device`: bfloat16 where it has bf16
    matmul kernels, else float32 (no autocast)."""
    if dtype != AUTO:
        return dtype
    return "bfloat16" if has_bf16_matmul(device) else "float32"


@dataclass(frozen=True, slots=True)
class TrainConfig:
    epochs: int = 10
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the decay ends at lr * min_lr_ratio
    warmup_steps: int = 50
    schedule: str = "cosine"  # or "linear"
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    ttt_steps: int = 7  # unrolled draft steps
    loss: str = "ce"  # per position: soft cross-entropy or LK's negative log acceptance (ttt.py)
    decay: float = 0.8  # step j's loss weight decay^j
    batch_tokens: int = 8192  # padded positions per global batch
    # autocast dtype for the head's matmuls: bfloat16, float16, float32 = none, or auto
    # (bfloat16 where the device has bf16 matmul kernels, else float32: autocast_dtype)
    dtype: str = AUTO
    seed: int = 0
    checkpoint_every: int = 200  # steps; an epoch end always checkpoints
    max_seconds: float | None = None  # stop training after this long (pipeline.py's Deadline)

    def autocast(self, device: torch.device) -> torch.autocast:
        """The head's forward under `dtype` (no autocast for float32); train and evaluate alike."""
        dtype = autocast_dtype(self.dtype, device)
        return torch.autocast(device.type, dtype=AMP_DTYPES[dtype], enabled=dtype != "float32")

    def __post_init__(self) -> None:
        if self.schedule not in ("cosine", "linear"):
            raise ValueError(f"schedule must be cosine or linear, not {self.schedule!r}")
        if self.dtype != AUTO and self.dtype not in AMP_DTYPES:
            raise ValueError(
                f"dtype must be {AUTO} or one of {', '.join(AMP_DTYPES)}, not {self.dtype!r}"
            )
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, not {self.loss!r}")
        if self.ttt_steps < 1 or self.epochs < 1 or self.batch_tokens < 1:
            raise ValueError("ttt_steps, epochs and batch_tokens must be positive")


@dataclass(slots=True)
class StepStats:
    step: int
    epoch: int
    loss: float
    lr: float
    acc: list[float]  # per unrolled step: draft top-1 == target top-1 among valid positions
    accept_proxy: float  # 1 + mean all-correct chain length per anchor (greedy tokens per round)
    positions: int = 0  # real (unpadded) positions in the step's global batch


class TTTModule(nn.Module):
    """The head under the training-time-test forward, as one module for DDP to wrap."""

    def __init__(self, head: Eagle3Head, steps: int, loss: str) -> None:
        super().__init__()
        self.head = head
        self.steps = steps
        self.loss = loss

    def forward(self, batch: TTTBatch) -> Any:
        return ttt_forward(self.head, batch, self.steps, loss=self.loss)


def _target_rows(
    target_rows: torch.Tensor, vocab: DraftVocab, device: torch.device
) -> torch.Tensor:
    """(Vd, Ct) fp32 on `device`: the target's lm_head rows of the draft vocabulary, checked."""
    if target_rows.shape[0] != len(vocab.ids):
        raise ValueError(
            f"target_rows has {target_rows.shape[0]} rows, the draft vocabulary {len(vocab.ids)}"
        )
    return target_rows.detach().float().to(device)


def collate(
    samples: Sequence[FeatureShard],
    target_rows: torch.Tensor,  # (Vd, Ct) fp32
    t2d: torch.Tensor,  # (V,) bool
    aux_dtype: torch.dtype,
    device: torch.device,
) -> TTTBatch:
    """Right-padded batch; the target's log-probs over the draft vocabulary from its final state."""
    B = len(samples)
    T = max(len(s.ids) for s in samples)
    A = samples[0].aux.shape[-1]
    ids = torch.zeros(B, T, dtype=torch.long)
    aux = torch.zeros(B, T, A, dtype=aux_dtype)
    final = torch.zeros(B, T, target_rows.shape[1])
    top = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    for b, s in enumerate(samples):
        n = len(s.ids)
        ids[b, :n], aux[b, :n], final[b, :n] = s.ids, s.aux, s.final.float()
        top[b, :n], loss_mask[b, :n] = s.top, s.loss_mask
    target_logp = F.log_softmax(final.to(device) @ target_rows.to(device).T, dim=-1)  # (B, T, Vd)
    return TTTBatch(
        ids=ids.to(device),
        aux=aux.to(device),
        target_logp=target_logp,
        target_valid=t2d.to(device)[top.to(device)],
        loss_mask=loss_mask.to(device),
    )


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    frac = min(1.0, frac)
    shape = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1 - frac
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape)


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def train(
    head: Eagle3Head,
    samples: Sequence[FeatureShard],
    vocab: DraftVocab,
    target_rows: torch.Tensor,  # (Vd, Ct) the target's lm_head rows of the draft vocabulary
    cfg: TrainConfig,
    *,
    checkpoint: Path | None = None,
    on_step: Callable[[StepStats], None] | None = None,
    on_epoch: Callable[[int], None] | None = None,  # after each epoch's last step
    deadline: Deadline = NEVER,
) -> list[StepStats]:
    """Train `head` in place (its trainable parameters); resumes from `checkpoint` when it exists
    and writes it every `checkpoint_every` steps and at each epoch end. Once `deadline` has
    passed (on any rank) no step starts: the head is left as it is, its epoch evaluated and
    checkpointed, and the steps taken returned."""
    rank, size = world()
    device = head.device
    module: nn.Module = TTTModule(head, cfg.ttt_steps, cfg.loss)
    if size > 1:
        module = nn.parallel.DistributedDataParallel(module)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    batches = length_batches([len(s.ids) for s in samples], cfg.batch_tokens)
    total = cfg.epochs * len(batches)
    step = 0
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, map_location=device, weights_only=False)
        head.load_state_dict(state["head"], strict=False)
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    rows = _target_rows(target_rows, vocab, device)
    t2d = vocab.t2d.to(device)
    weights = torch.tensor([cfg.decay**j for j in range(cfg.ttt_steps)], device=device)
    history: list[StepStats] = []
    module.train()
    while step < total:
        if _passed(deadline, device, size):
            if step % len(batches):  # a part epoch: evaluated and kept as a whole one is
                if on_epoch is not None:
                    on_epoch(step // len(batches))
                if checkpoint is not None and rank == 0:
                    save_checkpoint(checkpoint, head, opt, step, cfg)
            break
        epoch, index = divmod(step, len(batches))
        order = list(range(len(batches)))
        random.Random(cfg.seed * 1000 + epoch).shuffle(order)
        mine = batches[order[index]][rank::size]
        if not mine:  # fewer rows than ranks: this rank still joins the collectives
            mine = batches[order[index]][:1]
        batch = collate([samples[i] for i in mine], rows, t2d, head.dtype, device)
        if len(batches[order[index]]) < size:
            batch.loss_mask.zero_()  # the borrowed row must not count twice
        lr = lr_at(step, total, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        with cfg.autocast(device):
            out = module(batch)
        stats = torch.stack([out.counts, out.correct, out.chain]).float()  # (3, J)
        if size > 1:
            dist.all_reduce(stats)
        counts = stats[0].clamp(min=1)
        per_step = torch.stack(out.loss_sums) / counts  # (J,) this rank's share of the mean
        loss = (weights * per_step).sum() * size  # DDP averages: * size makes it the sum
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        global_loss = loss.detach() / size
        if size > 1:
            dist.all_reduce(global_loss)
        s = StepStats(
            step=step,
            epoch=epoch,
            loss=float(global_loss),  # sync: one scalar per step, for the log
            lr=lr,
            acc=(stats[1] / counts).tolist(),
            accept_proxy=1 + float(stats[2].sum() / counts[0]),
            positions=sum(len(samples[i].ids) for i in batches[order[index]]),
        )
        history.append(s)
        if on_step is not None:
            on_step(s)
        if on_epoch is not None and step % len(batches) == 0:
            on_epoch(epoch)
        if (
            checkpoint is not None
            and rank == 0
            and (step % cfg.checkpoint_every == 0 or step % len(batches) == 0 or step == total)
        ):
            save_checkpoint(checkpoint, head, opt, step, cfg)
    return history


def _passed(deadline: Deadline, device: torch.device, size: int) -> bool:
    """Whether training stops now, the same answer on every rank (a rank stopping alone would
    leave the others waiting in a collective)."""
    if deadline.at is None:
        return False
    stop = torch.tensor([float(deadline.passed())], device=device)
    if size > 1:
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    return bool(stop.item())  # sync: one scalar a step, only with a deadline


def save_checkpoint(
    path: Path, head: Eagle3Head, opt: torch.optim.Optimizer, step: int, cfg: TrainConfig
) -> None:
    trainable = {n for n, p in head.named_parameters() if p.requires_grad}
    state = {
        "head": {k: v for k, v in head.state_dict().items() if k in trainable or k == "d2t"},
        "optimizer": opt.state_dict(),
        "step": step,
        "config": asdict(cfg),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.rename(path)


@torch.no_grad()
def evaluate(
    head: Eagle3Head,
    samples: Sequence[FeatureShard],
    vocab: DraftVocab,
    target_rows: torch.Tensor,  # (Vd, Ct) as in `train`
    cfg: TrainConfig,
) -> dict[str, Any]:
    """Training-time-test metrics on `samples` (held out): per-step top-1 agreement with the
    target and the greedy acceptance proxy (1 + mean all-correct chain length per anchor)."""
    if not samples:
        return {}
    device = head.device
    rows = _target_rows(target_rows, vocab, device)
    t2d = vocab.t2d.to(device)
    totals = torch.zeros(3, cfg.ttt_steps)
    for idx in length_batches([len(s.ids) for s in samples], cfg.batch_tokens):
        batch = collate([samples[i] for i in idx], rows, t2d, head.dtype, device)
        with cfg.autocast(device):
            out = ttt_forward(head, batch, cfg.ttt_steps, loss=cfg.loss)
        totals += torch.stack([out.counts, out.correct, out.chain]).float().cpu()
    counts = totals[0].clamp(min=1)
    return {
        "acc": [round(a, 4) for a in (totals[1] / counts).tolist()],
        "accept_proxy": round(1 + float(totals[2].sum() / counts[0]), 4),
        "positions": int(totals[0, 0]),
    }
