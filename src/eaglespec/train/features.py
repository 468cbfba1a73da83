"""Target features for training, captured once in prefill passes and kept on disk, so training runs
many epochs without the target.

For each sample (prompt + response) and each position: the token id, the target's pre-norm
residual stream at the head's capture boundaries (concatenated low -> high), the target's post-norm
final state (training turns it into the target's distribution over the draft vocabulary through the
target's lm_head rows, so the draft vocabulary can change without recapturing), the target's top-1
token over the full vocabulary, and whether the token belongs to the response (the loss mask).

Shards `shard-NNNNN.safetensors` hold whole samples back to back (`offsets` marks them) and are
written one batch group at a time, so an interrupted capture resumes at the next shard.

Two ways to the same bits: `capture_features` runs batched prefills over finished samples;
`recorded_sample` turns what recorder.FeatureRecorder took while the target answered into the
same tensors, so greedy answering at the commands' precision leaves nothing for a prefill to
compute (recorder.py says which positions differ: none that is ever trained on).

Dims: N positions in a shard, S samples in it, A captured states, Ct target hidden.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eaglespec.model.llama import Transformer
from eaglespec.train.batching import length_batches
from eaglespec.train.data import Sample
from eaglespec.train.recorder import RowFeatures, split_states


@dataclass(slots=True)
class FeatureShard:
    ids: torch.Tensor  # (N,) int64
    aux: torch.Tensor  # (N, A*Ct) capture dtype
    final: torch.Tensor  # (N, Ct) post-norm final state
    top: torch.Tensor  # (N,) int64 target top-1 over the full vocabulary
    loss_mask: torch.Tensor  # (N,) bool: a response token
    offsets: torch.Tensor  # (S+1,) int64 sample boundaries
    keys: list[str]  # S sample keys

    def sample(self, i: int) -> FeatureShard:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return FeatureShard(
            self.ids[a:b],
            self.aux[a:b],
            self.final[a:b],
            self.top[a:b],
            self.loss_mask[a:b],
            torch.tensor([0, b - a]),
            [self.keys[i]],
        )

    def __len__(self) -> int:
        return len(self.keys)


def save_shard(shard: FeatureShard, path: Path, capture: Sequence[int]) -> None:
    tensors = {
        "ids": shard.ids.to(torch.int32),
        "aux": shard.aux.contiguous(),
        "final": shard.final.contiguous(),
        "top": shard.top.to(torch.int32),
        "loss_mask": shard.loss_mask.to(torch.uint8),
        "offsets": shard.offsets,
    }
    meta = {"keys": json.dumps(shard.keys), "capture": json.dumps(list(capture))}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.rename(path)  # a shard is there whole or not at all


def load_shard(path: Path) -> FeatureShard:
    t = load_file(str(path))
    return FeatureShard(
        ids=t["ids"].long(),
        aux=t["aux"],
        final=t["final"],
        top=t["top"].long(),
        loss_mask=t["loss_mask"].bool(),
        offsets=t["offsets"],
        keys=load_shard_keys(path),
    )


def shard_paths(folder: Path) -> list[Path]:
    return sorted(folder.glob("shard-*.safetensors"))


def save_group(
    folder: Path, parts: Sequence[tuple[torch.Tensor, ...]], keys: list[str], capture: Sequence[int]
) -> Path:
    """Samples' (ids, aux, final, top, loss_mask) as the next shard of `folder`."""
    path = folder / f"shard-{len(shard_paths(folder)):05d}.safetensors"
    save_shard(_concat(list(parts), keys), path, capture)
    return path


@torch.no_grad()
def capture_features(
    model: Transformer,
    samples: Sequence[Sample],
    capture: Sequence[int],
    folder: Path,
    *,
    batch_tokens: int = 16384,
    shard_samples: int = 256,
    on_batch: Callable[[int, int], None] | None = None,  # (samples, tokens) per batch
) -> list[Path]:
    """Capture every sample not yet in a shard of `folder`; returns all shard paths."""
    folder.mkdir(parents=True, exist_ok=True)
    have = captured_keys(folder)
    todo = sorted(
        (s for s in samples if s.key not in have), key=lambda s: len(s.prompt) + len(s.response)
    )
    for start in range(0, len(todo), shard_samples):
        group = todo[start : start + shard_samples]
        parts = []
        for idx in length_batches([len(s.prompt) + len(s.response) for s in group], batch_tokens):
            batch = [group[i] for i in idx]
            parts.extend(_capture_batch(model, batch, capture))
            if on_batch is not None:
                on_batch(len(batch), sum(len(s.prompt) + len(s.response) for s in batch))
        save_group(folder, parts, [s.key for s in group], capture)
    return shard_paths(folder)


def captured_keys(folder: Path) -> set[str]:
    """The keys of the samples the shards of `folder` hold (none where it does not exist)."""
    return {k for p in shard_paths(folder) for k in load_shard_keys(p)}


def load_shard_keys(path: Path) -> list[str]:
    with safe_open(str(path), "pt") as f:
        keys: list[str] = json.loads((f.metadata() or {})["keys"])
    return keys


def _capture_batch(
    model: Transformer, batch: Sequence[Sample], capture: Sequence[int]
) -> list[tuple[torch.Tensor, ...]]:
    """One right-padded prefill -> per sample (ids, aux, final, top, loss_mask)."""
    seqs = [s.prompt + s.response for s in batch]
    lengths = [len(x) for x in seqs]
    B, T = len(seqs), max(lengths)
    device = model.device
    ids = torch.zeros(B, T, dtype=torch.long)
    for b, x in enumerate(seqs):
        ids[b, : len(x)] = torch.tensor(x)
    ids = ids.to(device)
    L = model.cfg.num_layers
    cache = model.new_cache(B, T)
    positions = torch.arange(T, device=device).expand(B, T)
    last = torch.zeros(B, 1, dtype=torch.long, device=device)  # logits not needed here
    out = model(ids, positions, cache, capture=(*capture, L), logit_index=last)
    aux, final = split_states(model, out.hidden)  # (B, T, A*Ct), (B, T, Ct) post-norm
    top = model.lm_head(final).argmax(-1)  # (B, T)
    result: list[tuple[torch.Tensor, ...]] = []
    for b, (s, n) in enumerate(zip(batch, lengths, strict=True)):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[len(s.prompt) :] = True
        result.append(
            (ids[b, :n].cpu(), aux[b, :n].cpu(), final[b, :n].cpu(), top[b, :n].cpu(), mask)
        )
    return result


def _concat(parts: list[tuple[torch.Tensor, ...]], keys: list[str]) -> FeatureShard:
    lengths = torch.tensor([p[0].shape[0] for p in parts])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    cols = list(zip(*parts, strict=True))
    return FeatureShard(
        ids=torch.cat(cols[0]),
        aux=torch.cat(cols[1]),
        final=torch.cat(cols[2]),
        top=torch.cat(cols[3]),
        loss_mask=torch.cat(cols[4]),
        offsets=offsets,
        keys=keys,
    )


def recorded_sample(row: RowFeatures, sample: Sample) -> tuple[torch.Tensor, ...] | None:
    """(ids, aux, final, top, loss_mask) of `sample` from its answering record, as
    `_capture_batch` gives them (module docstring: the positions never trained on aside); None
    when the record does not cover the sample's positions but its last (an answer cut by a stop
    string, whose end-of-turn token was never the target's)."""
    ids = torch.tensor(sample.prompt + sample.response)
    n = len(ids)
    aux, final, chosen = torch.cat(row.aux), torch.cat(row.final), torch.cat(row.chosen)
    if aux.shape[0] != n - 1:
        return None
    pad = aux.new_zeros(1, aux.shape[1])
    top = torch.cat([chosen.cpu(), torch.zeros(1, dtype=torch.long)])
    mask = torch.zeros(n, dtype=torch.bool)
    mask[len(sample.prompt) :] = True
    return (
        ids,
        torch.cat([aux, pad]).cpu(),
        torch.cat([final, final.new_zeros(1, final.shape[1])]).cpu(),
        top,
        mask,
    )


class FeatureSink:
    """Shards of the samples answered with a recorder (recorder.py), `shard_samples` at a time,
    into the folder `capture_features` fills, which then skips them."""

    def __init__(self, folder: Path, capture: Sequence[int], shard_samples: int = 256) -> None:
        self.folder, self.capture, self.shard_samples = folder, tuple(capture), shard_samples
        self.parts: list[tuple[torch.Tensor, ...]] = []
        self.keys: list[str] = []
        self.samples = 0  # written to shards so far

    def add(self, sample: Sample, row: RowFeatures) -> None:
        part = recorded_sample(row, sample)
        if part is None:  # its features come from a prefill later
            return
        self.parts.append(part)
        self.keys.append(sample.key)
        if len(self.keys) >= self.shard_samples:
            self.flush()

    def flush(self) -> None:
        if self.keys:
            self.folder.mkdir(parents=True, exist_ok=True)
            save_group(self.folder, self.parts, self.keys, self.capture)
            self.samples += len(self.keys)
            self.parts, self.keys = [], []
