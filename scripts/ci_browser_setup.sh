#!/usr/bin/env bash
# Browser test set-up (tests/test_demo.py): headless Chromium and its driver from Debian,
# then the Python driver (selenium) and gradio into the project venv. Playwright's own
# browser download is not used: CI machines reach only PyPI and the Debian mirrors.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver
[ -d .venv ] || { echo "no .venv: run scripts/setup.sh first" >&2; exit 1; }
. .venv/bin/activate
# gradio and selenium leave torch alone (checked with pip install --dry-run)
# the gradio the Space runs (requirements.txt pins it to README's sdk_version)
pip install -q "$(grep -E '^gradio==' requirements.txt)" "selenium>=4.20"
chromium --version
chromedriver --version
