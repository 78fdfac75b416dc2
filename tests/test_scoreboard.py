"""reproduce/scoreboard.py: its rows, run names and paired differences."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reproduce"))
import scoreboard  # noqa: E402


def test_run_names_stay_those_of_the_runs_already_made():
    assert scoreboard.run_name("dir0.3", "fedavg", "rounds", "cnn5") == "dir0.3-fedavg-cnn5"
    assert scoreboard.run_name("dir0.3", "fedhe", "async", "") == "dir0.3-fedhe-async"
    assert (scoreboard.run_name("iid", "standalone", "rounds", "htfllib-recipe")
            == "iid-standalone-htfllib-recipe")


def test_each_method_is_read_against_a_standalone_trained_with_its_recipe():
    from strategies import METHODS
    # HtFLlib's recipe keeps its run names; the methods that train so are read against it.
    assert {m for m in METHODS if scoreboard.recipe_of(m) == "htfllib-recipe"} == {
        "fd", "fedgen", "fedmrl", "fedtgp"}
    # Methods that share a recipe share its Standalone; Standalone is the reference itself.
    assert scoreboard.recipe_of("fedper") == scoreboard.recipe_of("fedrep") == "fedper-recipe"
    assert scoreboard.recipe_of("felo") == scoreboard.recipe_of("velo") == "felo-recipe"
    assert scoreboard.recipe_of("standalone") is None
    # A recipe's Standalone trains as its methods do, with the local work every row shares.
    fedhe = scoreboard.overrides("iid", "standalone", "rounds", "fedhe-recipe")
    assert fedhe["optimizer"] == "adam" and fedhe["optimizer-state"] == "keep"
    assert (fedhe["batch-size"], fedhe["local-epochs"], fedhe["local-steps"]) == (10, 1, 0)
    assert scoreboard.overrides("iid", "standalone", "rounds", "htfllib-recipe")["momentum"] == 0
    # Only what acts: SGD has no betas, a run without decay no decay factor.
    assert "adam-beta1" not in dict(scoreboard.training("fd"))
    assert "lr-decay" in dict(scoreboard.training("felo"))


def test_a_diagnostic_row_changes_one_setting_of_its_method_in_its_column_only():
    felo = scoreboard.overrides("dir0.3-p30", "felo", "rounds", "no-group-avg")
    assert felo["felo.group-avg"] is False and "velo.group-avg" not in felo
    assert felo == {**scoreboard.overrides("dir0.3-p30", "felo", "rounds", ""),
                    "felo.group-avg": False}
    assert scoreboard.overrides("dir0.3-p30", "velo", "rounds", "no-group-avg")[
        "velo.group-avg"] is False
    assert (scoreboard.run_name("dir0.3-p30", "felo", "rounds", "no-group-avg")
            == "dir0.3-p30-felo-no-group-avg")
    assert scoreboard.label("felo", "rounds", "no-group-avg") == "felo (group-avg = false)"
    assert scoreboard.DIAGNOSTICS["no-group-avg"][2] == ("dir0.3-p30",)


def test_the_difference_is_taken_seed_by_seed():
    def run(*accuracies):
        return {"accuracy": {"per_client": dict(enumerate(accuracies))}}
    mine = [run(0.8, 0.9), run(0.7, 0.7), run(0.6, 0.8)]      # means 0.85, 0.70, 0.70
    base = [run(0.8, 0.8), run(0.6, 0.6), run(0.6, 0.6)]      # means 0.80, 0.60, 0.60
    diff, std = scoreboard.paired(mine, base)
    assert diff == pytest.approx((0.05 + 0.10 + 0.10) / 3)
    assert std == pytest.approx(float(np.std([0.05, 0.10, 0.10])))


def test_labels_name_the_loop_and_the_variant():
    assert scoreboard.label("fedhe", "async", "") == "fedhe (async)"
    assert scoreboard.label("fedavg", "rounds", "cnn5") == "fedavg (cnn5 only)"
    assert scoreboard.label("standalone", "", "htfllib-recipe") == (
        "standalone (HtFLlib's recipe: fedgen, fedmrl, fd, fedtgp)")


def test_a_table_from_no_runs_is_refused_and_leaves_the_doc_alone(tmp_path, monkeypatch):
    # `--out` names the runs' folder; pointed at an empty one, --table-only wrote a blank table.
    doc = tmp_path / "scoreboard.md"
    doc.write_text("the table\n")
    monkeypatch.setattr(scoreboard, "DOC", doc)
    monkeypatch.setattr(scoreboard, "finished", lambda out, name: None)
    monkeypatch.setattr(sys, "argv", ["scoreboard.py", "--table-only", "--out",
                                      str(tmp_path / "none")])
    with pytest.raises(SystemExit, match="no runs"):
        scoreboard.main()
    assert doc.read_text() == "the table\n"
