#!/usr/bin/env bash
# Start the demo Space from scratch, as a CPU-basic Space would, and time it (docs/space.md):
# the files scripts/push_space.sh uploads, copied into a folder of their own; a fresh venv
# with nothing but `pip install -r requirements.txt`; then app.py with SPACE_ID set (so it
# installs the embedded-model package with --no-deps, as on a Space), an empty model cache
# and an empty torch-extension cache (the C++ row kernel is compiled, as on a first start),
# and HF_SELFSPEC_DEMO_CHECK=1: it builds model, heads, engine and UI, then exits.
#
#   bash scripts/check_space.sh [WORKDIR]     # default: a new folder under /tmp
#   (SPACE_PYTHON: the interpreter the venv is made from; PYTHON: the one that lists the files)
#
# Minutes on a 2-core CPU (pip downloads, a kernel compile): not a CI test; tests/test_space.py
# checks the front matter, requirements and upload selection in a second.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-$(mktemp -d /tmp/hf_selfspec_space.XXXXXX)}
PY=${SPACE_PYTHON:-python3}  # the Python the Space venv is made from (3.11, as python_version)
SPACE="$WORK/space"
mkdir -p "$SPACE"
bash scripts/push_space.sh --list | while read -r f; do
    mkdir -p "$SPACE/$(dirname "$f")"; cp "$f" "$SPACE/$f"
done
echo "Space files: $(find "$SPACE" -type f | wc -l) in $SPACE"
t0=$(date +%s)
"$PY" -m venv "$WORK/venv"
# download.pytorch.org (the extra index that gives a Space the CPU torch wheel) may be
# unreachable from a sandbox: fail fast on it, torch then comes from pip's other sources
(cd "$SPACE" && PIP_TIMEOUT=${PIP_TIMEOUT:-5} PIP_RETRIES=${PIP_RETRIES:-0} \
    "$WORK/venv/bin/python" -m pip install -q -r requirements.txt 2> >(grep -v "is ignored" >&2))
t1=$(date +%s)
echo "pip install -r requirements.txt: $((t1 - t0)) s"
(cd "$SPACE" && env -u PYTHONPATH -u VIRTUAL_ENV SPACE_ID=local/check HF_SELFSPEC_DEMO_CHECK=1 \
    HF_SELFSPEC_CACHE="$WORK/model_cache" TORCH_EXTENSIONS_DIR="$WORK/torch_extensions" \
    HF_SELFSPEC_DEMO_THREADS=${HF_SELFSPEC_DEMO_THREADS:-2} "$WORK/venv/bin/python" app.py)
t2=$(date +%s)
echo "app.py first start (embedded model install + conversion, kernel compile, engine, UI): $((t2 - t1)) s"
echo "total from scratch: $((t2 - t0)) s"
