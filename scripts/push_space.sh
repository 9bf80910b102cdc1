#!/usr/bin/env bash
# Upload the demo as a Hugging Face Space (docs/space.md), or list what would be uploaded.
#
#   bash scripts/push_space.sh ORG/NAME     # hf upload, logged in with `hf auth login`
#   bash scripts/push_space.sh --list       # the files the upload selects, one a line
#
# `hf upload` sends binary files (the heads' .safetensors) through the Hub's large-file
# storage itself, so no git push, git-lfs or .gitattributes is involved. Only what app.py
# needs is selected; run it from a clean checkout (untracked files under the selected
# folders would be uploaded too). tests/test_space.py builds a Space from this selection.
set -euo pipefail
cd "$(dirname "$0")/.."
INCLUDE=(app.py requirements.txt README.md "hf_selfspec/*" "kernels/*")
EXCLUDE=("*__pycache__*" "*.pyc")
if [ "${1:-}" = "--list" ]; then
    # the same matching as huggingface_hub's upload (fnmatch: * also matches /)
    git ls-files | "${PYTHON:-.venv/bin/python}" -c '
import sys
from huggingface_hub.utils import filter_repo_objects
include, exclude = sys.argv[1].split(), sys.argv[2].split()
paths = [p for p in sys.stdin.read().splitlines() if p]
print("\n".join(filter_repo_objects(paths, allow_patterns=include, ignore_patterns=exclude)))
' "${INCLUDE[*]}" "${EXCLUDE[*]}"
    exit 0
fi
[ $# -eq 1 ] || { echo "usage: bash scripts/push_space.sh ORG/NAME | --list" >&2; exit 2; }
args=()
for p in "${INCLUDE[@]}"; do args+=(--include "$p"); done
for p in "${EXCLUDE[@]}"; do args+=(--exclude "$p"); done
hf upload "$1" . . --repo-type space "${args[@]}" --commit-message "Upload the hf_selfspec demo"
