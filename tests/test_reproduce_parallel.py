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
                   (None, {}, "c"), (None, {"fail": True}, "d")]
    with pytest.raises(RuntimeError, match="2 of 4 runs failed: b, d"):
        common.run_parallel(experiments, tmp_path, jobs=2)
    assert sorted(started) == ["a", "b", "c", "d"]          # "done" is reused, not rerun
    assert at_once[0] == 2                                  # two at a time, never more
    assert (tmp_path / "c" / "summary.json").exists()       # a failure stops no other run


def test_one_job_leaves_the_runs_to_the_script(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "run_experiment", lambda *a: pytest.fail("ran"))
    common.run_parallel([(None, {}, "a")], tmp_path, jobs=1)
