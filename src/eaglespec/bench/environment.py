"""What a benchmark ran on, recorded next to its numbers: software versions, the machine, the
engine settings, and SHA-256 hashes of the model files (so a result names exactly what ran)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import eaglespec
from eaglespec.registry import sha256_file


@dataclass(frozen=True, slots=True)
class EngineSettings:
    device: str
    dtype: str
    quant: str
    compile: str


def describe_model(path: Path) -> dict[str, Any]:
    """The path and the SHA-256 of the file, or of every file in the folder (by relative name)."""
    if path.is_file():
        return {"path": str(path), "sha256": sha256_file(path)}
    files = sorted(p for p in path.rglob("*") if p.is_file())
    return {
        "path": str(path),
        "sha256": {str(p.relative_to(path)): sha256_file(p) for p in files},
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> dict[str, Any] | None:
    """The commit of the eaglespec source tree running, and whether it has uncommitted changes;
    None outside a git checkout (an installed wheel)."""
    where = Path(eaglespec.__file__).parent

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10
        )
        if done.returncode:
            raise OSError(done.stderr.strip())
        return done.stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return None


def environment(
    engine: EngineSettings, model: dict[str, Any], drafts: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The environment block of results.json. `model` and each draft come from describe_model."""
    device = torch.device(engine.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "eaglespec": {"version": eaglespec.__version__, "git": git_commit()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "gpu": gpu,
        **{k: getattr(engine, k) for k in ("device", "dtype", "quant", "compile")},
        "model": model,
        "drafts": drafts,
    }
