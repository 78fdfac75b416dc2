# The README's commands. Each target sets itself up first (scripts/setup.sh is idempotent).
.PHONY: setup demo test test-long test-all bench reproduce
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION = 1
export FLWR_DISABLE_UPDATE_CHECK = 1
export FLWR_TELEMETRY_ENABLED = 0

setup:
	@bash scripts/setup.sh

# The default experiment (pyproject.toml's defaults: Fashion-MNIST, 10 clients, CNN-1..5).
demo: setup
	.venv/bin/fedapp run

# The fast suite: unit tests and real `flwr run` simulations (under 10 minutes on 2 cores).
test: setup
	.venv/bin/python -m pytest -q -m "not long" --durations=15

# The loopback deployments (TLS, authenticated SuperNodes, a SuperLink killed and resumed), a Ray
# cluster, and the simulations killed or stalled on purpose: minutes each. CI runs both targets.
test-long: setup
	.venv/bin/python -m pytest -q -m long --durations=5

test-all: test test-long

bench: setup
	.venv/bin/python benchmarks/runtime_overhead.py

# Every table and plot in docs/ from its reproduction script (3 seeds unless the entry says
# otherwise). Finished runs under results/, or recorded in reproduce/records/, are reused, so
# an interrupted `make reproduce` resumes (on another machine too), and with every run present
# it only rewrites the tables.
# From nothing it takes more than a day on 2 cores (README; reproduce/records_time.py sums the
# recorded runs' own time). The cross-checks (reproduce/crosscheck_htfllib.py, crosscheck_fedmd.py,
# crosscheck_heterofl.py) are not among them: they need a peer's results made outside this
# repository (docs/crosscheck.md); nor is reproduce/robustness.py, whose table takes more than
# a day on 2 cores by itself and is run by hand, stage by stage (docs/robustness.md, "The
# robustness table").
# Each entry: a script with the arguments its page's tables were made with (the page's
# "Produced by" line; tests/test_reproduce_all.py keeps the two in step).
REPRODUCE = defaults.py felo_sparse.py scoreboard.py "fedclassavg_defaults.py --variants 2" fedgh_fmnist.py \
            fedgh_regimes.py fedclassavg_fmnist.py fedclassavg_diagnosis.py \
            fedclassavg_longer.py fedhe_async_fmnist.py "fedhe_fmnist.py --splits IID" felo_fmnist.py \
            "compfl_fmnist.py --clients 10" compfl_d2d_fmnist.py privacy_utility.py \
            submodels_fmnist.py fjord_widths.py fedrolex_rolling.py
reproduce: setup
	.venv/bin/pip install -q -e ".[reproduce]"
	set -e; for run in $(REPRODUCE); do .venv/bin/python reproduce/$$run; done

