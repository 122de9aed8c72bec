#!/usr/bin/env bash
# Sets up what the tests need, then runs the whole suite (pytest arguments pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# one formatter and linter (pyproject.toml [tool.ruff]): the tree must be formatted and clean
.venv/bin/ruff format --check --quiet .
.venv/bin/ruff check --quiet .
# two test workers, one per core (three were slower: 14 min 16 s against 13 min 27 s); a
# module's tests stay together (its fixtures start once) and the longest modules start first
# (tests/conftest.py); the ten slowest tests are printed at the end
# No current directory on sys.path, here or in any Python the tests start (Python 3.11+): the
# checkout's top-level folders (kernels/, engine/, ...) must never shadow a package of the same
# name (transformers imports Hugging Face's `kernels`); Conveyor is imported as installed.
export PYTHONSAFEPATH=1
exec .venv/bin/python -m pytest -q -n "${CONVEYOR_TEST_WORKERS:-2}" --dist loadfile --durations=10 "$@"
