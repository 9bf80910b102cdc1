#!/usr/bin/env bash
# The GPU check (docs/gpu.md): the CUDA tests, then the timing and parity script.
# Random weights only, no network; well under 8 minutes on an H200 (each phase has a
# timeout so that the whole run fits). Extra arguments go to scripts/gpu_check.py.
# Usage: bash scripts/gpu_check.sh [--bandwidth 4.8e12 ...]
set -uo pipefail  # no -e: one run should report every phase, even after a failure
cd "$(dirname "$0")/.."
status=0

# Import the package from the source tree: on the H200 machine (2026-12-04) `pip install
# --no-deps --no-build-isolation -e .` succeeded but left `hf_selfspec` unimportable outside
# pytest's rootdir (scripts/gpu_check.py failed with ModuleNotFoundError), and no network
# is needed for a path
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available())"

# Timeouts: 190 + 180 + 100 + 60 s = 530 s, so that the whole run stays under 9 minutes even
# when a phase hangs; the replay also stops itself (--replay-budget) before its timeout.
echo "== tests (CUDA graphs, Triton kernels, trees and batches on the Triton path, fused small kernels) =="
timeout 190 python -m pytest tests/test_gpu.py tests/test_kernels.py tests/test_triton_trees.py tests/test_triton_fused.py -q -p no:cacheprovider || status=1

echo "== gpu_check.py =="
timeout 180 python scripts/gpu_check.py "$@" || status=1

echo "== gpu_check.py --replay-only (recorded traces of the default model, replayed) =="
timeout 100 python scripts/gpu_check.py --replay-only --replay-budget 80 "$@" || status=1

echo "== gpu_offload_check.py (a model dispatched over GPU 0, the CPU and the disk) =="
timeout 60 python scripts/gpu_offload_check.py || status=1

echo "== gpu_check.sh: $([ $status -eq 0 ] && echo OK || echo FAILED) =="
exit $status
