"""Results: round records, summary, plots and `fedapp compare`."""

import json

import pytest

from fedapp.cli.main import main
from fedapp.runtime.results import Recorder, round_record


def _run(tmp_path, name, accs):
    rec = Recorder(tmp_path / name, method=name, dataset="synthetic", num_clients=2,
                   num_rounds=len(accs), config={"method": name}, partition={"clients": []})
    for r, (a, b) in enumerate(accs, start=1):
        evals = [{"partition-id": 0, "arch": "cnn1", "accuracy": a},
                 {"partition-id": 1, "arch": "cnn2", "accuracy": b}]
        traffic = {"bytes_up": 800, "bytes_down": 400, "framing_up": 10, "framing_down": 20,
                   "eval_bytes_down": 0}
        line = rec.record_round(round_record(r, evals, traffic, {"clients_fit": 2, "failures": 0,
                                                                 "rejected": 0}, 1.5))
        assert f"round {r}/{len(accs)}" in line and "ETA" in line
    return rec.finish()


def test_summary_holds_the_documented_keys_and_values(tmp_path):
    summary = _run(tmp_path, "lg-fedavg", [(0.5, 0.7), (0.6, 0.8)])
    assert summary["accuracy"]["mean"] == pytest.approx(0.7)
    assert summary["accuracy"]["std"] == pytest.approx(0.1)
    assert summary["accuracy"]["per_client"] == {"0": 0.6, "1": 0.8}
    assert summary["accuracy"]["per_architecture"] == {"cnn1": 0.6, "cnn2": 0.8}
    com = summary["communication"]
    assert com["bytes_up"] == 1600 and com["bytes_down"] == 800
    assert com["per_client_per_round_up"] == 400 and com["per_client_per_round_down"] == 200
    on_disk = json.loads((tmp_path / "lg-fedavg" / "summary.json").read_text())
    assert on_disk["history"] == summary["history"]
    assert (tmp_path / "lg-fedavg" / "accuracy.png").stat().st_size > 10_000


def test_compare_plots_and_tabulates(tmp_path, capsys):
    _run(tmp_path, "standalone", [(0.4, 0.5)])
    _run(tmp_path, "fedavg", [(0.6, 0.7)])
    out = tmp_path / "cmp.png"
    assert main(["compare", str(tmp_path / "standalone"), str(tmp_path / "fedavg"),
                 "--output", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| standalone | standalone |" in table and "0.6500 ± 0.0500" in table
    assert out.stat().st_size > 10_000
    assert main(["compare", str(tmp_path / "missing")]) == 2
