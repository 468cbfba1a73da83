#!/usr/bin/env bash
# Install eaglespec (editable) with its dependencies; `--test` adds the test dependencies.
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
