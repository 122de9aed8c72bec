#!/usr/bin/env bash
# Sets up what the tests need, then runs the whole suite (pytest arguments pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# one formatter and linter (pyproject.toml [tool.ruff]): the tree must be formatted and clean
.venv/bin/ruff format --check --quiet .
.venv/bin/ruff check --quiet .
# three test workers on the 2-core box: much of the suite waits on leases, grace periods and
# child processes (a module's tests stay together: its fixtures start once); the ten
# slowest tests are printed at the end
exec .venv/bin/python -m pytest -q -n "${CONVEYOR_TEST_WORKERS:-3}" --dist loadfile --durations=10 "$@"
