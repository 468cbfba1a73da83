"""Build and load eaglespec's own C++ CPU kernels (csrc/) on first use.

Each kernel is compiled for the machine at hand with torch.utils.cpp_extension (ninja and a C++
compiler; seconds, cached under torch's extension directory, keyed by the source's digest) and
registers its ops with torch.library. A kernel that cannot build or run here is reported, not
raised: callers fall back to PyTorch's own ops or refuse with the reason.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
# -fopenmp: at::parallel_for is a header template whose `omp parallel` compiles into the
# library; without the flag it runs on one thread. The OpenMP runtime it links is the one torch
# has already loaded (same soname), so there is one thread pool.
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]


def compile_and_load(source: Path, module: str) -> None:
    """Compile a C++ source with CFLAGS and load it (its ops register themselves), cached under
    `module` and the digest of the source, the headers beside it and the flags; raises if it
    does not build."""
    from torch.utils import cpp_extension

    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + repr(CFLAGS).encode()).hexdigest()[:12]
    cpp_extension.load(
        name=f"{module}_{digest}",
        sources=[str(source)],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


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
