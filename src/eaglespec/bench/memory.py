"""Peak memory of one generation.

On CUDA: the caching allocator's peak (`max_memory_allocated`), reset before each generation.
On Linux CPUs: the process's peak resident set (VmHWM), which writing "5" to
/proc/self/clear_refs resets (Linux 4.0+), so each generation gets its own peak.
Elsewhere: `getrusage`'s max RSS, which only grows over the process's life, so a method's figure
includes every method that ran before it; `scope` says which of the three was measured.

All methods' models stay loaded together (one target, every draft), so on any device the peak
includes all of their weights; differences between methods are caches, activations and buffers.
"""

from __future__ import annotations

import re
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
SCOPES = {
    "cuda": "torch.cuda.max_memory_allocated, reset before each generation",
    "rss": "process peak RSS (VmHWM), reset before each generation via /proc/self/clear_refs",
    "rss-lifetime": "process peak RSS since start (getrusage): only grows, not per method",
}


@dataclass(frozen=True, slots=True)
class MemoryMeter:
    kind: str  # a key of SCOPES
    device: torch.device

    @property
    def scope(self) -> str:
        return SCOPES[self.kind]

    def reset(self) -> None:
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind == "rss":
            _CLEAR_REFS.write_text("5")

    def peak_bytes(self) -> int:
        if self.kind == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.kind == "rss":
            return _vm_hwm_bytes()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS: bytes; Linux: KiB


def memory_meter(device: torch.device) -> MemoryMeter:
    """The most precise meter this device and OS allow."""
    if device.type == "cuda":
        return MemoryMeter("cuda", device)
    try:
        _CLEAR_REFS.write_text("5")
        _vm_hwm_bytes()
    except (OSError, ValueError):
        return MemoryMeter("rss-lifetime", device)
    return MemoryMeter("rss", device)


def _vm_hwm_bytes() -> int:
    match = re.search(r"^VmHWM:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise ValueError("no VmHWM in /proc/self/status")
    return int(match.group(1)) * 1024
