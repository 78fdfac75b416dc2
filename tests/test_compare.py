"""`fedapp compare` across recipes: the training settings that differ between runs, named from
each run's config.json, and each method read against a Standalone run trained as it is."""

from __future__ import annotations

import re

import pytest

from fedapp.cli.main import main
from fedapp.cli.run import resolve_settings
from fedapp.runtime.results import Recorder, round_record
from strategies import settings_report


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    """The plots are tested in test_results.py; here they would only take the time."""
    monkeypatch.setattr("fedapp.runtime.results.plot_runs", lambda *args, **kwargs: None)


def recorded_run(tmp_path, name, accuracy, *settings):
    """A finished run folder of one round, with the config.json ``fedapp run`` writes for
    ``--set`` ``settings`` (every effective value and its layer)."""
    config = settings_report(resolve_settings(None, list(settings))[0])
    method = config["settings"]["method"]
    rec = Recorder(tmp_path / name, method=method, dataset="synthetic", num_clients=1,
                   num_rounds=1, config=config, partition={"clients": []})
    rec.record_round(round_record(1, [{"partition-id": 0, "arch": "cnn1", "accuracy": accuracy}],
                                  {"bytes_up": 8, "bytes_down": 8, "framing_up": 0,
                                   "framing_down": 0, "eval_bytes_down": 0},
                                  {"clients_fit": 1, "failures": 0, "rejected": 0}, 1.0))
    rec.finish()
    return str(tmp_path / name)


def compare(tmp_path, capsys, *runs) -> str:
    assert main(["compare", *runs, "--output", str(tmp_path / "cmp.png")]) == 0
    return capsys.readouterr().out


def setting_rows(out: str) -> dict[str, list[str]]:
    """The table of differing training settings: {setting: its value in each run}."""
    return {cells[0]: cells[1:] for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
             if line.startswith("| ") and not line.startswith(("| run |", "| setting |")))
            if len(cells) == 3}


def test_runs_with_different_optimizers_name_every_training_setting_that_differs(
        tmp_path, capsys):
    # Standalone's recipe (the global defaults, one SGD for the whole run) against FedHe's
    # (Adam 1e-3 kept, 3 batches of 50): docs/recipes.md.
    a = recorded_run(tmp_path, "standalone-run", 0.6, "method=standalone")
    b = recorded_run(tmp_path, "fedhe-run", 0.7, "method=fedhe")
    out = compare(tmp_path, capsys, a, b)
    assert "These runs train with different recipes" in out
    assert "The 11 training setting(s) that differ" in out
    # Run against run, "—" where that run's optimizer or schedule does not read the setting.
    assert setting_rows(out) == {
        "optimizer": ['"sgd"', '"adam"'], "lr": ["0.01", "0.001"],
        "momentum": ["0.9", "—"], "adam-beta1": ["—", "0.9"], "adam-beta2": ["—", "0.999"],
        "weight-decay": ["0.001", "0.0"], "grad-clip": ["50.0", "0.0"],
        "batch-size": ["64", "50"], "drop-last": ["false", "—"], "local-epochs": ["1", "—"],
        "local-steps": ["0", "3"]}
    # Both keep one optimizer for the whole run and never decay the lr: not named.
    assert not re.search(r"^\| (optimizer-state|lr-decay-at|feature-dim) \|", out, re.M)
    # No Standalone at FedHe's recipe among them: what would make one, from the one there is.
    assert ("- fedhe-run: no Standalone run at its recipe among these, so its difference to "
            "standalone-run is partly its recipe's; the same run as standalone-run with "
            '--set optimizer="adam" --set lr=0.001 --set weight-decay=0.0 --set grad-clip=0.0 '
            "--set batch-size=50 --set local-steps=3 is one.") in out


def test_a_method_is_read_against_the_standalone_run_at_its_own_recipe(tmp_path, capsys):
    default = recorded_run(tmp_path, "standalone", 0.60, "method=standalone")
    felo = recorded_run(tmp_path, "felo", 0.70, "method=felo")
    # Standalone trained with Felo's recipe, as `--set` gives it; and one of another seed.
    recipe = ["optimizer=\"adam\"", "lr=0.001", "weight-decay=0.0", "grad-clip=0.0",
              "lr-decay-at=\"0.5\"", "lr-decay=0.1", "batch-size=50", "local-steps=10"]
    other_seed = recorded_run(tmp_path, "standalone-felo-seed1", 0.95, "method=standalone",
                              "seed=1", *recipe)
    same = recorded_run(tmp_path, "standalone-felo", 0.90, "method=standalone", *recipe)
    out = compare(tmp_path, capsys, default, felo, other_seed, same)
    # The run of the same seed, not the default Standalone nor the other seed.
    assert "- felo against Standalone at its own recipe (standalone-felo): 0.7000 − 0.9000 = " \
           "-0.2000" in out
    assert "standalone-felo-seed1)" not in out
    # Across recipes all the same: the default Standalone trains otherwise.
    assert "These runs train with different recipes" in out
    assert "Other settings that differ: seed (0 / 0 / 1 / 0)." in out
    # With only the other seed there, it is read against that one and says so.
    out = compare(tmp_path, capsys, felo, other_seed)
    assert ("- felo against Standalone at its own recipe (standalone-felo-seed1): 0.7000 − "
            "0.9500 = -0.2500 (the two runs also differ in seed)") in out
    assert "Every run trains with the same recipe: optimizer = \"adam\", lr = 0.001" in out


def test_runs_without_their_settings_are_said_to_be_unknown(tmp_path, capsys):
    run = recorded_run(tmp_path, "known", 0.5, "method=standalone")
    bare = tmp_path / "bare"
    Recorder(bare, method="fedavg", dataset="synthetic", num_clients=1, num_rounds=1,
             config={"method": "fedavg"}, partition={}).finish()
    out = compare(tmp_path, capsys, run, str(bare))
    assert "No config.json in bare: how those runs trained is not known" in out
    assert "different recipes" not in out and "same recipe" not in out
