#!/usr/bin/env bash
# Sets up what the tests need, then runs the whole suite (pytest arguments pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
