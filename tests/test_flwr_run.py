"""Real `flwr run` simulations (tens of seconds each): the app works end to end, and a run that
fails says so in its exit status."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fedapp.cli import LocalSuperLink, _run_status
from fedapp.config import PROJECT_ROOT

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def fedapp(*args, timeout=600):
    return subprocess.run([str(BIN / "fedapp"), *args], capture_output=True, text=True,
                          timeout=timeout)


def test_smoke_lg_fedavg_writes_results_with_exact_traffic(tmp_path):
    proc = fedapp("run", "conf/smoke.toml", "--set", 'method="lg-fedavg"',
                  "--set", 'run-name="smoke"', "--output-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("[fedapp] round") == 2  # one progress line per round
    run = tmp_path / "smoke"
    summary = json.loads((run / "summary.json").read_text())
    for key in ("method", "dataset", "num_clients", "rounds", "accuracy", "communication",
                "wall_seconds", "history"):
        assert key in summary
    for key in ("mean", "std", "per_client", "per_architecture"):
        assert key in summary["accuracy"]
    assert set(summary["accuracy"]["per_client"]) == {"0", "1", "2"}
    # Smoke preset: d=500 (default feature-dim), C=10 -> the head is 5010 floats each way.
    com = summary["communication"]
    assert com["per_client_per_round_up"] == com["per_client_per_round_down"] == 5010 * 4
    assert len(summary["history"]) == 2
    assert len((run / "rounds.jsonl").read_text().splitlines()) == 2
    assert (run / "accuracy.png").stat().st_size > 0
    partition = json.loads((run / "partition.json").read_text())
    assert partition["architectures"] == ["cnn5", "cnn4", "cnn3"]


def test_bad_setting_is_refused_before_anything_starts():
    proc = fedapp("run", "conf/smoke.toml", "--set", 'method="nope"', timeout=120)
    assert proc.returncode == 2
    for name in ("standalone", "fedavg", "lg-fedavg"):
        assert name in proc.stderr


def test_a_failed_run_exits_non_zero(tmp_path):
    # lr=1e30 makes every client's head NaN; the strategy rejects all uploads, the round
    # fails, the ServerApp raises — and although `flwr run` itself exits 0, fedapp reads the
    # run status and exits 1.
    proc = fedapp("run", "conf/smoke.toml", "--set", "lr=1e30", "--set", 'run-name="bad"',
                  "--output-dir", str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "did not complete" in proc.stderr and "finished:failed" in proc.stderr
    log = (tmp_path / "bad" / "flwr.log").read_text()
    assert "NaN" in log and "no client returned a usable update" in log
    assert not (tmp_path / "bad" / "summary.json").exists()


def test_plain_flwr_run_with_a_preset(tmp_path):
    # Exactly what the README shows, without fedapp; results go to ~/fedapp-results by
    # default, so HOME points into tmp_path here.
    link = LocalSuperLink(Path(tempfile.mkdtemp(prefix="fedapp-test-home-")),
                          tmp_path / "superlink.log")
    link.env["HOME"] = str(tmp_path)
    try:
        link.start()
        proc = subprocess.run(
            [str(BIN / "flwr"), "run", ".", "--stream", "--run-config", "conf/smoke.toml",
             "--federation-config", "num-supernodes=3"],
            cwd=PROJECT_ROOT, env=link.env, capture_output=True, text=True, timeout=600)
        run_id = next(line.split()[-1] for line in proc.stdout.splitlines()
                      if "Successfully started run" in line)
        assert _run_status(link.env, run_id) == "finished:completed", proc.stdout[-3000:]
    finally:
        link.stop()
    # The default method is FedGH. Smoke clients hold all 10 classes: 10 x (500 + 1) floats
    # up; the global header, 500 x 10 + 10, down from round 2 on.
    [summary] = (tmp_path / "fedapp-results").glob("fedgh-synthetic-*/summary.json")
    summary = json.loads(summary.read_text())
    assert summary["rounds"] == 2
    com = summary["communication"]
    assert com["last_round_floats_per_client_up"] == com["last_round_floats_per_client_down"] \
        == 5010
    assert "global-header" in summary["accuracy"]["variants"]
    assert link.process.poll() is not None  # nothing left running


def test_one_seed_one_result_whatever_ray_does(tmp_path):
    # Two virtual clients train in parallel, finish in any order and are sampled 2 of 3: the
    # per-client accuracies of every round must still be identical across runs.
    histories = []
    for name in ("a", "b"):
        proc = fedapp("run", "conf/smoke.toml", "--set", "fraction-fit=0.6",
                      "--set", "num-server-rounds=3", "--set", f'run-name="{name}"',
                      "--output-dir", str(tmp_path))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        rounds = (tmp_path / name / "rounds.jsonl").read_text().splitlines()
        histories.append([json.loads(r)["per_client"] for r in rounds])
    assert histories[0] == histories[1]
