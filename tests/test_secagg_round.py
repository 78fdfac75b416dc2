"""benchmarks/secagg_round.py's pieces: the figures it reads from a run's rounds.jsonl, by hand,
and the settings it deploys, accepted by the one validation path with and without secure
aggregation."""

from __future__ import annotations

import json

import pytest

from fedapp.cli.run import resolve_settings
from tests.conftest import benchmark_script


@pytest.fixture(scope="module")
def bench():
    return benchmark_script("secagg_round")


def test_later_rounds_median_and_bytes_per_client_by_hand(bench, tmp_path):
    rounds = [  # round 1 is slow (the nodes' first ClientApps), and round 3 lost a client
        {"seconds": 20.0, "clients_fit": 2, "clients_sampled": 2, "bytes_up": 200,
         "bytes_down": 400},
        {"seconds": 3.0, "clients_fit": 2, "clients_sampled": 2, "bytes_up": 200,
         "bytes_down": 400},
        {"seconds": 6.0, "clients_fit": 1, "rejected": 1, "clients_sampled": 3,
         "bytes_up": 500, "bytes_down": 900},
        {"seconds": 4.0, "clients_fit": 0, "clients_sampled": 2, "bytes_up": 0,
         "bytes_down": 400}]  # nothing uploaded: not a round of the per-client figures
    (tmp_path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    got = bench.round_figures(tmp_path)
    assert got["round_seconds"] == [20.0, 3.0, 6.0, 4.0]
    assert got["median_later_round_seconds"] == 4.0  # of 3, 6, 4: round 1 left out
    # Up: 200/2, 200/2, 500/(1 + 1 rejected) -> mean 150; down: 400/2, 400/2, 900/3 -> 700/3.
    assert got["bytes_up_per_client_per_round"] == pytest.approx(150.0)
    assert got["bytes_down_per_client_per_round"] == pytest.approx(700 / 3)
    (tmp_path / "rounds.jsonl").write_text(json.dumps(rounds[0]) + "\n")
    assert bench.round_figures(tmp_path)["median_later_round_seconds"] is None
    assert "| lg-fedavg | yes | - | 100 | 200 | 0.50 |" in bench.table([
        {"method": "lg-fedavg", "secure": True, "load_average_before": [0.5, 0.4, 0.3],
         **bench.round_figures(tmp_path)}])


@pytest.mark.parametrize("method", ["lg-fedavg", "fedproto"])
@pytest.mark.parametrize("secure", [False, True])
def test_the_deployed_settings_are_valid(bench, method, secure):
    from strategies import load_config
    preset, *sets = bench.run_settings(method, secure, 4, 3)
    flat, _ = resolve_settings(preset, sets[1::2])
    cfg = load_config(flat)
    assert (cfg.method, cfg.num_clients, cfg.num_server_rounds, cfg.secure_aggregation) == (
        method, 4, 3, secure)
