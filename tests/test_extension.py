"""Building the C++ kernels: a build lock left by a killed build does not hang later starts, and a
lock held by a build in progress is waited for, with a word on stderr either way."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from eaglespec.model.extension import build_name, wait_for_lock


def test_no_lock_no_wait(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wait_for_lock(tmp_path / "lock", stale_after=60)
    assert capsys.readouterr().err == ""


def test_a_stale_lock_is_removed_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 120
    os.utime(lock, (old, old))  # a build killed two minutes ago
    start = time.monotonic()
    wait_for_lock(lock, stale_after=60)
    assert time.monotonic() - start < 1 and not lock.exists()
    assert f"removed {lock}" in capsys.readouterr().err


def test_a_build_in_progress_is_waited_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    builder = threading.Timer(0.4, lock.unlink)  # the other process's build ends
    builder.start()
    start = time.monotonic()
    wait_for_lock(lock, stale_after=60, poll=0.05)
    waited = time.monotonic() - start
    builder.join()
    assert 0.3 < waited < 5
    err = capsys.readouterr().err
    assert err.count("waiting for another process") == 1 and str(lock) in err


def test_the_constant_mark_is_torchs_own() -> None:
    """`constant_to_dynamo` sets the mark `torch.compiler.assume_constant_result` sets, without
    importing dynamo; a torch whose decorator marks functions otherwise fails here, not in a
    compiled forward."""
    import torch

    from eaglespec.model.extension import constant_to_dynamo

    def ours() -> int:
        return 1

    def theirs() -> int:
        return 1

    torch.compiler.assume_constant_result(theirs)
    marks = dict(vars(theirs))
    assert marks and vars(constant_to_dynamo(ours)) == marks


def test_each_checkout_builds_under_its_own_name(tmp_path: Path) -> None:
    """The same source in two folders (two clones) gets two build names, so neither rebuilds
    the other's; a changed source or header gets a new one; the same file keeps its name."""
    a, b = tmp_path / "a" / "k.cpp", tmp_path / "b" / "k.cpp"
    for f in (a, b):
        f.parent.mkdir()
        f.write_text("int k;")
    assert build_name(a, "m") == build_name(a, "m") != build_name(b, "m")
    assert build_name(a, "m").startswith("m_")
    before = build_name(a, "m")
    (a.parent / "k.h").write_text("#define X 1")
    assert build_name(a, "m") != before
