"""Build and load eaglespec's own C++ CPU kernels (csrc/) on first use.

The engine's kernels (KERNELS: w4a8, attention, rowops and the fused layer that calls them) are
compiled together into one library for the machine at hand with torch.utils.cpp_extension (ninja
and a C++ compiler; a minute on 2 cores, cached under torch's extension directory, keyed by the
sources' digest); each registers its ops with torch.library under its own namespace. One library,
so that the fused layer's forward and the kernels it calls share one team of threads
(csrc/team.h) instead of starting one for every matrix. Other sources (the roofline benchmark's)
build alone. A kernel that cannot build or run here is reported, not raised: callers fall back
to PyTorch's own ops or refuse with the reason.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

CSRC = Path(__file__).parent / "csrc"
# The engine's kernels, built into one library (the module doc): csrc/{name}.cpp each, whose
# torch.library namespace is eaglespec_{name}.
KERNELS = ("w4a8", "attention", "rowops", "layer")
# -fopenmp: at::parallel_for is a header template whose `omp parallel` compiles into the
# library; without the flag it runs on one thread. The OpenMP runtime it links is the one torch
# has already loaded (same soname), so there is one thread pool.
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
# torch builds under a lock file that a process removes when its build ends; one killed while it
# built (Ctrl-C through a first run's build) leaves it behind, and every later process would wait
# for it for good. A build takes 1-2 minutes on 2 cores: a lock this old is stale.
STALE_LOCK_SECONDS = 900.0


def constant_to_dynamo(fn: F) -> F:
    """`torch.compiler.assume_constant_result`: traced forwards take `fn`'s result as a constant
    instead of tracing into it. Without its import of dynamo (1.5 s of every start of a process
    that never compiles): the mark it sets, set here; tests/test_extension.py checks that torch's
    decorator still sets that same mark."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def build_name(sources: Path | Sequence[Path], module: str) -> str:
    """`module` and a digest of the sources, the headers beside them, the flags and the sources'
    paths: torch rebuilds a module whose build file names other sources, so two checkouts
    sharing one build folder (a clone and its CI copy) would otherwise rebuild it in turn."""
    files = [sources] if isinstance(sources, Path) else list(sources)
    key = b"".join(f.read_bytes() + str(f.resolve()).encode() for f in files)
    headers = b"".join(h.read_bytes() for h in sorted(files[0].parent.glob("*.h")))
    key += headers + repr(CFLAGS).encode()
    return f"{module}_{hashlib.sha256(key).hexdigest()[:12]}"


def compile_and_load(sources: Path | Sequence[Path], module: str) -> None:
    """Compile C++ sources with CFLAGS into one library and load it (their ops register
    themselves), cached under its `build_name`; raises if it does not build."""
    from torch.utils import cpp_extension

    files = [sources] if isinstance(sources, Path) else list(sources)
    name = build_name(files, module)
    folder = Path(cpp_extension._get_build_directory(name, verbose=False))
    wait_for_lock(folder / "lock", STALE_LOCK_SECONDS)
    if not (folder / f"{name}.so").exists():
        what = " and ".join(f.stem for f in files)
        print(
            f"[building the {what} kernels for this CPU, once: seconds to a minute]",
            file=sys.stderr,
        )
    cpp_extension.load(
        name=name,
        sources=[str(f) for f in files],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def wait_for_lock(lock: Path, stale_after: float, poll: float = 1.0) -> None:
    """Return once `lock` is gone, or remove it once it is `stale_after` seconds old (its build
    was killed), saying so on stderr: while another process builds the kernel this one waits for
    it, and a stale lock must not hang every later start without a word."""
    said = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age >= stale_after:
            lock.unlink(missing_ok=True)
            print(f"[removed {lock}: a kernel build left it {age:.0f} s ago]", file=sys.stderr)
            return
        if not said:
            print(
                f"[waiting for another process to finish building a kernel ({lock}); if none "
                f"is running, delete that file]",
                file=sys.stderr,
            )
            said = True
        time.sleep(poll)


@functools.cache
def _library(names: tuple[str, ...]) -> str | None:
    """Compile and load csrc/{name}.cpp for each of `names` as one library, once per process;
    None if it loaded, else why not (no compiler, no ninja, a failed build)."""
    module = "eaglespec_cpu" if names == KERNELS else f"eaglespec_{names[0]}"
    try:
        compile_and_load([CSRC / f"{n}.cpp" for n in names], module)
    except Exception as e:  # say which
        what = " and ".join(names)
        return f"the {what} kernels did not build ({type(e).__name__}: {str(e)[:300]})"
    return None


def build(name: str, needs: str) -> str | None:
    """Compile and load csrc/{name}.cpp (for one of KERNELS: their library), whose
    torch.library namespace is eaglespec_{name} with a `supported()` op; None when it runs
    here, else why not (a failed build, or a CPU without `needs`, say "a CPU with AVX-512")."""
    import torch

    reason = _library(KERNELS if name in KERNELS else (name,))
    if reason is not None:
        return reason
    if not getattr(torch.ops, f"eaglespec_{name}").supported():
        return f"the {name} kernel needs {needs}"
    return None
