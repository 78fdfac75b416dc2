"""Checkpoints and resume, in process: every registered method, stopped after a checkpoint and
resumed with fresh clients (empty ``context.state``, as in a new run), ends where the
uninterrupted run ends. The real kill-and-resume through `fedapp run` is in test_flwr_run.py."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from fedapp.runtime import checkpoint
from fedapp.runtime.results import Recorder
from strategies import METHODS
from tests.conftest import InProcessFederation
from tests.test_hostile_uploads import small_smoke_overrides


def _federation(method, run_dir, resume_after=0, **extra):
    overrides = {**small_smoke_overrides(method), "checkpoint_every": 2,
                 "num_server_rounds": 3, "output_dir": str(run_dir.parent),
                 "run_name": run_dir.name, "fraction_fit": 0.6, **extra}
    recorder = Recorder(run_dir, method=method, dataset="synthetic", num_clients=3,
                        num_rounds=3, config={}, partition={}, resume_after=resume_after)
    return InProcessFederation(method, recorder=recorder, **overrides)


def _state_sent(fed, rnd):
    """What the server sends for evaluation in round ``rnd`` (its global state, decoded)."""
    from fedapp.runtime.payload import decode
    return [decode(ins.parameters)
            for _, ins in fed.strategy.configure_evaluate(rnd, None, fed.manager)]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_run_resumed_after_its_checkpoint_ends_like_the_whole_run(method, tmp_path):
    # (Also the check, for every method, that a skipped evaluation changes nothing trained.)
    whole = _federation(method, tmp_path / "whole")
    for rnd in (1, 2, 3):
        whole.fit_round(rnd)
        final = whole.evaluate_round(rnd)
    # The same run, evaluated only every second round (and the last), stopped during round 3
    # (it trained, then died before evaluating) ...
    first = _federation(method, tmp_path / "cut", eval_every=2)
    for rnd in (1, 2):
        first.fit_round(rnd)
        assert bool(first.evaluate_round(rnd)) == (rnd == 2)
    first.fit_round(3)
    # ... and resumed: a new strategy from the checkpoint, clients with empty state. Neither
    # the skipped evaluation nor the resume may change what is trained.
    done, state = checkpoint.load_server(tmp_path / "cut" / "checkpoint")
    assert done == 2
    resumed = _federation(method, tmp_path / "cut", resume_after=done, resume=True,
                          eval_every=2)
    resumed.strategy.restore(done, state)
    resumed.fit_round(1)  # Flower's round 1 of the resumed run is round 3
    again = resumed.evaluate_round(1)
    assert {p: m["accuracy"] for p, m in again.items()} == \
        {p: m["accuracy"] for p, m in final.items()}
    got_all, want_all = _state_sent(resumed, 1), _state_sent(whole, 3)
    assert len(got_all) == len(want_all) > 0
    for got, want in zip(got_all, want_all):
        assert got.keys() == want.keys()
        assert all(np.array_equal(got[k], want[k]) for k in got)
    assert [h["round"] for h in resumed.strategy.recorder.history] == [1, 2, 3]


def test_client_state_files_keep_what_a_resume_can_need(tmp_path):
    for rnd in range(1, 10):
        checkpoint.save_client(tmp_path, 4, rnd, RecordDict({"c": ConfigRecord({"v": rnd})}),
                               checkpoint_every=3)
    folder = tmp_path / "partition-4"
    # After round 9 the last checkpoint may be round 9 or, if the server died first, round 6:
    # the newest file at or before 6 and everything after it stay.
    assert sorted(p.name for p in folder.iterdir()) == [
        f"round-{r}.state" for r in (6, 7, 8, 9)]
    assert checkpoint.load_client(tmp_path, 4, 7)["c"]["v"] == 7
    assert checkpoint.load_client(tmp_path, 4, 100)["c"]["v"] == 9
    assert checkpoint.load_client(tmp_path, 4, 5) is None
    assert checkpoint.load_client(tmp_path, 5, 9) is None


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    from flwr.app import Context

    from fedapp.config import ConfigError
    from fedapp.server_app import server_fn
    context = Context(run_id=1, node_id=0, state=RecordDict(), node_config={}, run_config={
        "dataset": "synthetic", "num-clients": 3, "partition": "iid",
        "max-samples-per-client": 0, "output-dir": str(tmp_path), "run-name": "nothing",
        "resume": True})
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        server_fn(context)


@pytest.mark.parametrize("method", ["compfl", "fedhe"])
def test_client_state_on_disk_changes_no_result_and_leaves_no_arrays_in_memory(method,
                                                                               tmp_path):
    from flwr.app import ArrayRecord

    from fedapp.config import ConfigError
    runs = {}
    for where in ("memory", "disk"):
        fed = _federation(method, tmp_path / where, checkpoint_every=0, client_state=where)
        for rnd in (1, 2, 3):
            fed.fit_round(rnd)
            runs.setdefault(where, []).append(
                {p: m["accuracy"] for p, m in fed.evaluate_round(rnd).items()})
            held = [k for c in fed.contexts for k, v in c.state.items()
                    if isinstance(v, ArrayRecord)]
            assert bool(held) == (where == "memory")
    assert runs["disk"] == runs["memory"]
    assert len(list((tmp_path / "disk" / "client-state").glob("partition-*/idle.state"))) == 3
    with pytest.raises(ConfigError, match="client-state = 'disk' is invalid with"):
        _federation(method, tmp_path / "x", client_state="disk")
