# The README's commands. Each target sets itself up first (scripts/setup.sh is idempotent).
.PHONY: setup demo test test-all bench
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION = 1
export FLWR_DISABLE_UPDATE_CHECK = 1
export FLWR_TELEMETRY_ENABLED = 0

setup:
	@bash scripts/setup.sh

# The default experiment (pyproject.toml's defaults: Fashion-MNIST, 10 clients, CNN-1..5).
demo: setup
	.venv/bin/fedapp run

# The fast suite (unit tests + one real `flwr run` smoke run).
test: setup
	.venv/bin/python -m pytest -q --durations=15

bench: setup
	.venv/bin/python benchmarks/runtime_overhead.py
