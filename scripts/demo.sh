#!/usr/bin/env bash
# Sets up what the demo needs, then runs it on the default model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/conveyor demo "$@"
