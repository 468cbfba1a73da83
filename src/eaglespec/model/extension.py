"""Build and load eaglespec's own C++ CPU kernels (csrc/) on first use.

Each kernel is compiled for the machine at hand with torch.utils.cpp_extension (ninja and a C++
compiler; seconds, cached under torch's extension directory, keyed by the source's digest) and
registers its ops with torch.library. A kernel that cannot build or run here is reported, not
raised: callers fall back to PyTorch's own ops or refuse with the reason.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

CSRC = Path(__file__).parent / "csrc"
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


def build_name(source: Path, module: str) -> str:
    """`module` and a digest of the source, the headers beside it, the flags and the source's
    path: torch rebuilds a module whose build file names other sources, so two checkouts sharing
    one build folder (a clone and its CI copy) would otherwise rebuild it in turn."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = source.read_bytes() + headers + repr(CFLAGS).encode() + str(source.resolve()).encode()
    return f"{module}_{hashlib.sha256(key).hexdigest()[:12]}"


def compile_and_load(source: Path, module: str) -> None:
    """Compile a C++ source with CFLAGS and load it (its ops register themselves), cached under
    its `build_name`; raises if it does not build."""
    from torch.utils import cpp_extension

    name = build_name(source, module)
    folder = Path(cpp_extension._get_build_directory(name, verbose=False))
    wait_for_lock(folder / "lock", STALE_LOCK_SECONDS)
    if not (folder / f"{name}.so").exists():
        print(
            f"[building the {source.stem} kernel for this CPU, once: seconds to a minute]",
            file=sys.stderr,
        )
    cpp_extension.load(
        name=name,
        sources=[str(source)],
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


def build(name: str, needs: str) -> str | None:
    """Compile and load csrc/{name}.cpp, whose torch.library namespace is eaglespec_{name} with
    a `supported()` op; None when it runs here, else why not (a failed build, or a CPU without
    `needs`, say "a CPU with AVX-512")."""
    try:
        import torch

        compile_and_load(CSRC / f"{name}.cpp", f"eaglespec_{name}")
    except Exception as e:  # no compiler, no ninja, a failed build: say which
        return f"the {name} kernel did not build ({type(e).__name__}: {str(e)[:300]})"
    if not getattr(torch.ops, f"eaglespec_{name}").supported():
        return f"the {name} kernel needs {needs}"
    return None
