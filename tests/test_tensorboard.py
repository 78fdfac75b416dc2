"""TensorBoard scalars (``tensorboard = true``): read back from the event files, they are the
numbers of ``rounds.jsonl`` and ``updates.jsonl``; a missing package is a clear refusal."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from fedapp.cli.main import main
from fedapp.config import PROJECT_ROOT, ConfigError, pyproject_defaults, read_preset
from fedapp.runtime.results import Recorder, round_record
from fedapp.runtime.tensorboard import SUBDIR
from tests.conftest import InProcessFederation
from tests.test_hostile_uploads import small_smoke_overrides

NOT_INSTALLED = ("the tensorboard package is not installed; `bash scripts/setup.sh` (the test "
                 "extra) installs it")


def read_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every event file in ``run_dir/tensorboard``, read by
    TensorBoard's own reader (which also applies a resumed run's purge of later steps)."""
    pytest.importorskip("tensorboard", reason=NOT_INSTALLED)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / SUBDIR), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_against_rounds(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar TensorBoard shows is the number ``rounds.jsonl`` holds for that round, and
    every number ``rounds.jsonl`` holds (but per-client tables) is shown."""
    scalars = read_scalars(run_dir)
    records = lines(run_dir / "rounds.jsonl")
    assert records, "the run recorded no round"
    want: dict[str, dict[int, float]] = {}

    def put(tag, step, value):
        if value is not None and not isinstance(value, bool):
            want.setdefault(tag, {})[step] = value

    for r in records:
        step = r["round"]
        put("accuracy/mean", step, r["accuracy_mean"])
        put("accuracy/std", step, r["accuracy_std"])
        for arch, value in r["per_architecture"].items():
            put(f"accuracy/architecture/{arch}", step, value)
        for name, value in r.get("train_terms", {}).items():
            put(f"loss/term/{name}", step, value)
        for name, stats in r.get("variants", {}).items():
            put(f"accuracy/variant/{name}/mean", step, stats["mean"])
            put(f"accuracy/variant/{name}/std", step, stats["std"])
        put("loss/train", step, r.get("train_loss"))
        for key in ("bytes_up", "bytes_down", "framing_up", "framing_down", "eval_bytes_down"):
            put(f"traffic/{key}", step, r[key])
        for key in ("seconds", "client_seconds", "server_seconds", "virtual_seconds",
                    "virtual_time"):
            put(f"time/{key}", step, r.get(key))
        for key, tag in (("clients_fit", "fit"), ("clients_sampled", "sampled"),
                         ("failures", "failures"), ("rejected", "rejected"),
                         ("updates", "updates")):
            put(f"clients/{tag}", step, r.get(key))
        if "global_accuracy_mean" in r:
            put("accuracy/global_mean", step, r["global_accuracy_mean"])
            put("accuracy/global_std", step, r["global_accuracy_std"])
    shown = {tag: steps for tag, steps in scalars.items() if not tag.startswith("updates/")}
    assert shown.keys() == want.keys()
    for tag, steps in want.items():
        # Event files store 32-bit floats.
        assert shown[tag] == pytest.approx(steps, rel=1e-6, abs=1e-9), tag
    return scalars


def test_event_files_hold_the_rounds_records(tmp_path):
    # A real strategy and its real clients (no Ray): FedClassAvg with its diagnostics reports
    # loss terms and a second accuracy ("variants"); evaluation every other round leaves
    # round 1 without accuracies, which TensorBoard then does not show at step 1.
    method = "fedclassavg"
    recorder = Recorder(tmp_path / "run", method=method, dataset="synthetic", num_clients=3,
                        num_rounds=2, config={}, partition={}, tensorboard=True)
    overrides = {**small_smoke_overrides(method), "num_server_rounds": 2, "eval_every": 2,
                 "eval_global_test": True, "fedclassavg.diagnose": True,
                 "synthetic_train": 60, "synthetic_test": 30, "fedclassavg.views": "none"}
    fed = InProcessFederation(method, recorder=recorder, **overrides)
    for rnd in (1, 2):
        fed.fit_round(rnd)
        fed.evaluate_round(rnd)
    records = lines(tmp_path / "run" / "rounds.jsonl")
    assert records[0]["accuracy_mean"] is None and records[1]["accuracy_mean"] is not None
    assert records[1]["train_terms"] and records[1]["variants"]  # exercised, not vacuous
    scalars = check_against_rounds(tmp_path / "run")
    assert set(scalars["accuracy/mean"]) == {2}
    assert set(scalars["traffic/bytes_up"]) == {1, 2}
    assert "accuracy/global_mean" in scalars
    assert not any("per_client" in tag for tag in scalars)


def test_asynchronous_updates_add_their_staleness(tmp_path):
    rec = Recorder(tmp_path / "run", method="fedhe", dataset="synthetic", num_clients=2,
                   num_rounds=1, config={}, partition={}, tensorboard=True)
    updates = [{"update": 1, "client": 0, "status": "ok", "staleness": 0},
               {"update": None, "client": 1, "status": "failed", "staleness": None},
               {"update": 2, "client": 1, "status": "ok", "staleness": 1},
               {"update": 3, "client": 0, "status": "rejected", "staleness": 2}]
    for u in updates:
        rec.record_update(u)
    evals = [{"partition-id": 0, "arch": "cnn1", "accuracy": 0.5},
             {"partition-id": 1, "arch": "cnn2", "accuracy": 0.75}]
    traffic = {"bytes_up": 10, "bytes_down": 20, "framing_up": 1, "framing_down": 2,
               "eval_bytes_down": 3}
    rec.record_round(round_record(1, evals, traffic, {"clients_fit": 2, "failures": 1,
                                                      "rejected": 1, "updates": 3,
                                                      "virtual_time": 2.5}, 1.0))
    rec.finish()
    scalars = check_against_rounds(tmp_path / "run")
    on_disk = [u for u in lines(tmp_path / "run" / "updates.jsonl") if u["update"] is not None]
    assert scalars["updates/staleness"] == {u["update"]: u["staleness"] for u in on_disk}
    assert scalars["clients/updates"] == {1: 3} and scalars["time/virtual_time"] == {1: 2.5}


def _rounds(rec: Recorder, first: int, accs: list[float]) -> None:
    traffic = {"bytes_up": 8, "bytes_down": 4, "framing_up": 0, "framing_down": 0,
               "eval_bytes_down": 0}
    for r, acc in enumerate(accs, start=first):
        rec.record_round(round_record(r, [{"partition-id": 0, "arch": "cnn1", "accuracy": acc}],
                                      traffic, {"clients_fit": 1, "failures": 0,
                                                "rejected": 0}, 1.0))


def test_a_resumed_run_replaces_the_rounds_it_records_again(tmp_path):
    # Killed after round 3 with a checkpoint after round 1: the resumed run records rounds
    # 2 and 3 again (with other numbers here), and TensorBoard must show those only.
    run_dir = tmp_path / "run"
    args = dict(method="fedavg", dataset="synthetic", num_clients=1, num_rounds=3, config={},
                partition={}, tensorboard=True)
    first = Recorder(run_dir, **args)
    _rounds(first, 1, [0.1, 0.2, 0.3])
    first.tensorboard.close()
    resumed = Recorder(run_dir, **args, resume_after=1)
    _rounds(resumed, 2, [0.7, 0.8])
    resumed.finish()
    scalars = check_against_rounds(run_dir)
    assert scalars["accuracy/mean"] == pytest.approx({1: 0.1, 2: 0.7, 3: 0.8})


def test_tensorboard_off_writes_no_event_file(tmp_path):
    rec = Recorder(tmp_path / "run", method="fedavg", dataset="synthetic", num_clients=1,
                   num_rounds=1, config={}, partition={})
    _rounds(rec, 1, [0.5])
    rec.finish()
    assert not (tmp_path / "run" / SUBDIR).exists()
    assert (tmp_path / "run" / "rounds.jsonl").exists()  # the run's records are written


def test_the_server_app_hands_the_setting_to_its_recorder(tmp_path):
    pytest.importorskip("tensorboard", reason=NOT_INSTALLED)
    from fedapp.server_app import server_fn
    run_config = {**pyproject_defaults(), **read_preset(PROJECT_ROOT / "conf" / "smoke.toml"),
                  "tensorboard": True, "output-dir": str(tmp_path), "run-name": "tb"}
    context = Context(run_id=1, node_id=0, state=RecordDict(), run_config=run_config,
                      node_config={})
    recorder = server_fn(context).strategy.recorder
    assert recorder.tensorboard is not None
    assert any((tmp_path / "tb" / SUBDIR).glob("events.out.tfevents.*"))
    recorder.tensorboard.close()


def test_asked_for_but_not_installed_is_refused_with_what_to_do(tmp_path, monkeypatch, capsys):
    # ``sys.modules[name] = None`` is how Python spells "cannot be imported".
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match=r"pip install -e \"\.\[tensorboard\]\""):
        Recorder(tmp_path / "run", method="fedavg", dataset="synthetic", num_clients=1,
                 num_rounds=1, config={}, partition={}, tensorboard=True)
    assert main(["run", "smoke", "--set", "tensorboard=true", "--output-dir",
                 str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "tensorboard = true needs the tensorboard package" in err
    assert "tensorboard = false" in err


def test_compare_shows_both_ways_to_look_at_runs(tmp_path, capsys):
    pytest.importorskip("tensorboard", reason=NOT_INSTALLED)
    for name, tensorboard in (("with-tb", True), ("without", False)):
        rec = Recorder(tmp_path / name, method="fedavg", dataset="synthetic", num_clients=1,
                       num_rounds=2, config={}, partition={}, tensorboard=tensorboard)
        _rounds(rec, 1, [0.4, 0.6])
        rec.finish()
    runs = [str(tmp_path / "with-tb"), str(tmp_path / "without")]
    assert main(["compare", *runs, "--output", str(tmp_path / "cmp.png")]) == 0
    out = capsys.readouterr().out
    assert f"plot: {tmp_path / 'cmp.png'}" in out
    [line] = [line for line in out.splitlines() if line.startswith("TensorBoard")]
    program, flag, spec = line.split(": ", 1)[1].split()
    assert Path(program).name == "tensorboard" and Path(program).is_file()
    assert flag == "--logdir_spec"
    label, path = spec.split(":", 1)  # only the run that has event files, under its name
    assert label == "with-tb"
    assert read_scalars(Path(path).parent)["accuracy/mean"] == pytest.approx({1: 0.4, 2: 0.6})
    assert main(["compare", runs[1], "--output", str(tmp_path / "one.png")]) == 0
    assert "run with --set tensorboard=true" in capsys.readouterr().out
