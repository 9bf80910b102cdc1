#!/usr/bin/env bash
# Installs torch 2.13.0, the CPU build, into the active venv (scripts/setup.sh and the CI's
# newest-releases leg, scripts/ci_latest.sh).
# On Linux, PyPI's torch is the CUDA build (gigabytes), so the CPU wheel comes from PyTorch's
# CPU wheel index; the +cpu label refuses any other build. The machine's own pip configuration
# is tried first: PyPI never holds a +cpu build (that try fails in a second on a stock
# machine), but an offline mirror or find-links folder may, and then no access to PyTorch's
# index is needed. macOS and Windows: PyPI's wheel is the CPU build.
set -euo pipefail
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
if [ "$(uname -s)" = Linux ]; then
  if ! pip install -q "torch==2.13.0+cpu" 2>/dev/null; then
    echo "torch 2.13.0+cpu from PyTorch's CPU wheel index ($TORCH_CPU_INDEX)"
    pip install -q --index-url "$TORCH_CPU_INDEX" "torch==2.13.0+cpu"
  fi
else
  pip install -q "torch==2.13.0"
fi
