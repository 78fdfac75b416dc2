"""reproduce/common.run_parallel: the reproduction scripts' ``--jobs``."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reproduce"))
import common  # noqa: E402


def test_runs_only_the_missing_ones_concurrently_and_reports_every_failure(tmp_path,
                                                                           monkeypatch):
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "summary.json").write_text("{}")
    started, lock, at_once, running = [], threading.Lock(), [0], [0]

    def fake_run(preset, overrides, name, out_dir):
        with lock:
            started.append(name)
            running[0] += 1
            at_once[0] = max(at_once[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        if overrides.get("fail"):
            raise RuntimeError(f"{name} failed")
        (out_dir / name).mkdir()
        (out_dir / name / "summary.json").write_text(json.dumps({"name": name}))

    monkeypatch.setattr(common, "run_experiment", fake_run)
    experiments = [(None, {}, "done"), (None, {}, "a"), (None, {"fail": True}, "b"),
                   (None, {}, "c"), (None, {"fail": True}, "d"), (None, {}, "a")]
    with pytest.raises(RuntimeError, match="2 of 4 runs failed: b, d"):
        common.run_parallel(experiments, tmp_path, jobs=2)
    assert sorted(started) == ["a", "b", "c", "d"]          # "done" is reused; "a" runs once
    assert at_once[0] == 2                                  # two at a time, never more
    assert (tmp_path / "c" / "summary.json").exists()       # a failure stops no other run


def test_resource_options_refuse_what_means_nothing():
    import argparse
    parser = argparse.ArgumentParser()
    common.add_resource_options(parser)
    assert parser.parse_args(["--jobs", "3", "--client-num-gpus", "0.5"]).jobs == 3
    for bad in (["--jobs", "0"], ["--client-num-gpus", "-1"], ["--client-num-gpus", "nan"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_one_job_leaves_the_runs_to_the_script(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "run_experiment", lambda *a: pytest.fail("ran"))
    common.run_parallel([(None, {}, "a")], tmp_path, jobs=1)


@pytest.fixture(autouse=True)
def records(tmp_path, monkeypatch):
    """A records folder of the test's own (never the repository's)."""
    folder = tmp_path / "records"
    monkeypatch.setattr(common, "RECORDS", folder)
    monkeypatch.setattr(common, "READ", {})
    return folder


def test_a_recorded_run_is_reused_where_its_results_folder_is_empty(tmp_path, records,
                                                                     monkeypatch):
    out = tmp_path / "scoreboard"
    (records / "scoreboard").mkdir(parents=True)
    (records / "scoreboard" / "a-seed0.json").write_text(json.dumps({"accuracy": 0.5}))
    monkeypatch.setattr(common.subprocess, "run", lambda *a, **k: pytest.fail("ran"))
    assert common.finished(out, "a-seed0") == records / "scoreboard" / "a-seed0.json"
    assert common.finished(out, "a-seed1") is None
    assert common.run_experiment(None, {}, "a-seed0", out)["accuracy"] == 0.5
    common.run_parallel([(None, {}, "a-seed0")], out, jobs=2)   # nothing left to run
    # The table the script then writes says where its runs were made.
    common.write_generated(tmp_path / "doc.md", "s.py", "| table |")
    assert "This script's run was made at commits unknown (1)" in (
        tmp_path / "doc.md").read_text()


def test_a_finished_run_is_recorded_with_where_it_was_made(tmp_path, records, monkeypatch):
    out = tmp_path / "scoreboard"

    def fake_fedapp(cmd, **kwargs):
        name = cmd[cmd.index("--set") + 1].split("=", 1)[1].strip('"')
        (out / name).mkdir(parents=True)
        (out / name / "summary.json").write_text(json.dumps({"accuracy": 0.7}))
        return common.subprocess.CompletedProcess(cmd, 0, "fedapp: done\nresults in x\n")

    real_run = common.subprocess.run
    monkeypatch.setattr(common.subprocess, "run",
                        lambda cmd, **k: fake_fedapp(cmd, **k) if "run" in cmd[3:4]
                        else real_run(cmd, **k))
    assert common.run_experiment(None, {"seed": 0}, "b-seed0", out)["accuracy"] == 0.7
    kept = json.loads((records / "scoreboard" / "b-seed0.json").read_text())
    assert kept["accuracy"] == 0.7
    origin = kept["provenance"]
    assert set(origin) >= {"commit", "dirty", "cpu", "cpu_capability", "torch"}
    assert origin["torch"] == __import__("torch").__version__
    # A run found under results/ without a record is recorded as such: where it was made is
    # not known.
    (out / "c-seed0").mkdir()
    (out / "c-seed0" / "summary.json").write_text(json.dumps({"accuracy": 0.1}))
    common.run_experiment(None, {}, "c-seed0", out)
    assert "commit" not in json.loads(
        (records / "scoreboard" / "c-seed0.json").read_text())["provenance"]


def test_a_record_keeps_its_settings_and_is_refused_once_its_name_asks_for_others(tmp_path,
                                                                                  records):
    from fedapp.cli.run import resolve_settings
    from strategies import settings_report
    out = tmp_path / "defaults"
    made = settings_report(resolve_settings(None, ["seed=0", 'method="fd"'])[0])["settings"]
    # A run found under results/ is recorded with its config.json's settings.
    (out / "a-seed0").mkdir(parents=True)
    (out / "a-seed0" / "summary.json").write_text(json.dumps({"accuracy": 0.4}))
    (out / "a-seed0" / "config.json").write_text(json.dumps({"settings": made}))
    assert common.run_experiment(None, {"seed": 0, "method": "fd"}, "a-seed0", out)
    assert json.loads((records / "defaults" / "a-seed0.json").read_text())["settings"] == made
    # Where it ran and what it is called are no difference; a path on its machine neither.
    moved = {**made, "client-num-gpus": 0.5, "run-name": "x", "data-dir": "/elsewhere"}
    (records / "defaults" / "b-seed0.json").write_text(json.dumps(
        {"accuracy": 0.5, "settings": moved}))
    assert common.run_experiment(None, {"seed": 0, "method": "fd"}, "b-seed0", out)
    # A default that changed since the run was made: the name now asks for another run.
    (records / "defaults" / "c-seed0.json").write_text(json.dumps(
        {"accuracy": 0.6, "settings": {**made, "lr": 0.5, "fd.lambda": 9.0}}))
    with pytest.raises(RuntimeError, match=r"c-seed0 was made with lr = 0\.5 \(0\.01 now\), "
                                           r"fd\.lambda = 9\.0 \(1\.0 now\)"):
        common.run_experiment(None, {"seed": 0, "method": "fd"}, "c-seed0", out)
    # A record kept before records held their settings is reused as it is.
    (records / "defaults" / "d-seed0.json").write_text(json.dumps({"accuracy": 0.7}))
    assert common.run_experiment(None, {"seed": 0, "method": "fd"}, "d-seed0", out)


def test_a_pipeline_checks_runs_are_never_recorded(tmp_path, records, monkeypatch):
    # --quick runs (shrunk settings) land beside the script's real runs; a record of them
    # would be reused as evidence by a later full run on another machine.
    out = common.quick_folder(tmp_path / "reproduce-felo")
    (out / "a-seed0").mkdir(parents=True)
    (out / "a-seed0" / "summary.json").write_text(json.dumps({"accuracy": 0.3}))
    assert common.run_experiment(None, {}, "a-seed0", out)["accuracy"] == 0.3
    assert not records.exists()


def test_a_pipeline_check_fails_when_a_client_failed(tmp_path, records):
    # A run survives failed rounds (max-empty-rounds); a pipeline check must not.
    out = common.quick_folder(tmp_path / "reproduce-felo")
    for name, failures in (("ok-seed0", 0), ("crash-seed0", 3)):
        (out / name).mkdir(parents=True)
        (out / name / "summary.json").write_text(json.dumps(
            {"accuracy": 0.3, "failures": failures, "failed_clients": [1, 4] * (failures > 0)}))
    assert common.run_experiment(None, {}, "ok-seed0", out)["accuracy"] == 0.3
    with pytest.raises(RuntimeError, match=r"3 client update\(s\) failed .*\[1, 4\]"):
        common.run_experiment(None, {}, "crash-seed0", out)
    # The real runs keep their failures as data (a fault table may inject them).
    real = tmp_path / "reproduce-felo"
    (real / "crash-seed0").mkdir(parents=True)
    (real / "crash-seed0" / "summary.json").write_text(json.dumps({"failures": 3}))
    assert common.run_experiment(None, {}, "crash-seed0", real)["failures"] == 3


def test_a_sweep_counts_each_of_its_runs_once_in_the_tables_provenance(tmp_path, records,
                                                                       monkeypatch):
    out = tmp_path / "scoreboard"

    def fake_sweep(cmd, **kwargs):   # one `fedapp run --sweep seed=0,1`: both runs' folders
        name = cmd[cmd.index("--set") + 1].split("=", 1)[1].strip('"')
        for seed in cmd[-1].split("=", 1)[1].split(","):
            (out / f"{name}-seed{seed}").mkdir(parents=True)
            (out / f"{name}-seed{seed}" / "summary.json").write_text("{}")
        return common.subprocess.CompletedProcess(cmd, 0, "")

    monkeypatch.setattr(common, "provenance", lambda made_here: {"commit": "abcdef1"})
    monkeypatch.setattr(common.subprocess, "run", fake_sweep)
    common.run_seeds(None, {}, "d", [0, 1], out)
    assert len(common.READ) == 2
    assert "This script's 2 runs were made at commits abcdef1 (2)" in common.provenance_line(
        common.READ.values())
    common.run_seeds(None, {}, "d", [0, 1], out)  # the same runs read again by another table
    assert len(common.READ) == 2


def test_a_table_says_where_its_runs_were_made():
    here = {"commit": "199b52b8656a", "dirty": False, "cpu": "AMD EPYC",
            "cpu_capability": "AVX512", "torch": "2.14.1"}
    runs = [{"provenance": here}, {"provenance": here}, {"provenance": {**here, "dirty": True}},
            {"provenance": {"recorded_from": "earlier"}}, {}]
    line = common.provenance_line(runs)
    assert common.provenance_line(runs[::-1]) == line  # ties by name, not by reading order
    assert line.startswith("This script's 5 runs were made at commits 199b52b (2), unknown (2), "
                           "199b52b with uncommitted changes (1), on AMD EPYC (AVX512), "
                           "torch 2.14.1 (3)")


def test_a_run_made_on_a_gpu_and_off_git_says_so(monkeypatch):
    # A copy of the tree sent to a GPU machine has no .git: its commit comes from
    # FEDAPP_SOURCE_COMMIT, and the table names the GPU beside the CPU.
    real_run = common.subprocess.run
    monkeypatch.setattr(common.subprocess, "run",
                        lambda cmd, **k: common.subprocess.CompletedProcess(cmd, 128, "", "")
                        if cmd[0] == "git" else real_run(cmd, **k))
    monkeypatch.setenv("FEDAPP_SOURCE_COMMIT", "0123456789ab")
    torch = __import__("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    origin = common.provenance(True)
    assert origin["commit"] == "0123456789ab" and origin["gpu"] == "NVIDIA H200"
    assert origin["dirty"] is None  # without git, nobody can tell
    line = common.provenance_line([{"provenance": origin}])
    assert "0123456 (uncommitted changes not known) (1), on " in line
    assert " with NVIDIA H200, torch " in line
    # No git installed at all reads the same.
    monkeypatch.setattr(common.subprocess, "run", lambda cmd, **k: (_ for _ in ()).throw(
        FileNotFoundError("git")) if cmd[0] == "git" else real_run(cmd, **k))
    assert common.provenance(True)["commit"] == "0123456789ab"
