#!/usr/bin/env bash
# Install eaglespec (editable) with its dependencies; `--test` adds the test dependencies, and
# Chromium with its driver from the distribution's packages (Debian/Ubuntu, as root) for the chat
# page's browser test, which skips and says why where they cannot be installed.
#
# torch comes first: where this machine offers the exact local CPU build (torch==2.13.0) it is
# installed before anything else, so that eaglespec's loose `torch` requirement is already met and
# never pulls several GB of CUDA wheels. Where that build is not available, torch is left to the
# platform (CUDA, ROCm or CPU, whatever `pip install torch` means there).
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
if [ "${1:-}" = "--test" ]; then
    extras="[test]"
fi

if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q torch==2.13.0 \
        || echo "setup: torch==2.13.0 is not available here; pip will pick torch for this platform"
fi
python -m pip install -q -e ".${extras}"

# eaglespec's CPU kernels compile for this CPU on first use (about 85 s on 2 cores): build them
# now, once, so that the first command answers at once. Where one cannot build or run here,
# eaglespec runs without it; the line says why.
python - <<'PY'
from eaglespec.model import cpu_attention, cpu_layer, cpu_rowops, w4a8

for name, module in (("w4a8", w4a8), ("attention", cpu_attention), ("rowops", cpu_rowops),
                     ("layer", cpu_layer)):
    reason = module.available()
    print(f"setup: the {name} kernel: {'built for this CPU' if reason is None else reason}")
PY

if [ -n "$extras" ] && ! command -v chromedriver >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing Chromium for the chat page's browser test (apt-get)"
        export DEBIAN_FRONTEND=noninteractive
        apt_install() { apt-get install -y -q --no-install-recommends chromium chromium-driver; }
        { apt_install || { apt-get update -q && apt_install; }; } >/dev/null 2>&1 \
            || echo "setup: Chromium could not be installed; the browser test will skip"
    else
        echo "setup: no chromedriver here (apt-get as root installs it); the browser test will skip"
    fi
fi
