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


def test_a_diagnostic_row_changes_one_setting_of_its_method_in_its_columns_only():
    felo = scoreboard.overrides("dir0.3-p30", "felo", "rounds", "group-avg")
    assert felo["felo.group-avg"] is True and "velo.group-avg" not in felo
    assert felo == {**scoreboard.overrides("dir0.3-p30", "felo", "rounds", ""),
                    "felo.group-avg": True}
    assert scoreboard.overrides("iid", "velo", "rounds", "group-avg")["velo.group-avg"] is True
    assert (scoreboard.run_name("dir0.3-p30", "felo", "rounds", "group-avg")
            == "dir0.3-p30-felo-group-avg")
    assert scoreboard.label("felo", "rounds", "group-avg") == (
        "felo (group-avg = true, the paper's)")
    assert scoreboard.DIAGNOSTICS["group-avg"][2] == tuple(scoreboard.SETTINGS)
    # FedGen's generator at the rate its default replaced: its own method only.
    fedgen = scoreboard.overrides("iid", "fedgen", "rounds", "server-lr-0.1")
    assert fedgen == {**scoreboard.overrides("iid", "fedgen", "rounds", ""),
                      "fedgen.server-lr": 0.1}
    assert "fedgen.server-lr" not in scoreboard.overrides("iid", "felo", "rounds",
                                                          "server-lr-0.1")
    assert (scoreboard.run_name("two-class", "fedgen", "rounds", "server-lr-0.1")
            == "two-class-fedgen-server-lr-0.1")


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


def test_every_recorded_run_is_still_a_run_of_the_table():
    """The runs made before the public-data and sub-model rows joined keep their names."""
    wanted = scoreboard.planned(set(scoreboard.page_methods()), set(scoreboard.SETTINGS))
    names = {f"{scoreboard.run_name(setting, *key)}-seed{s}"
             for (key, setting) in wanted for s in scoreboard.SEEDS}
    recorded = {p.stem for p in (scoreboard.common.RECORDS / "scoreboard").glob("*.json")}
    assert len(recorded) >= 447 and recorded <= names


def test_a_public_data_method_and_its_standalone_cut_the_same_public_set():
    common = scoreboard.common
    for method in ("fedmd", "dsfl", "feddf", "ktpfl"):
        mine = scoreboard.overrides("dir0.3", method, "rounds", "")
        assert mine["public-source"] == "train-holdout"
        assert scoreboard.base_variant(method, "") == scoreboard.ground(method) == "holdout"
        recipe = scoreboard.on_ground("holdout", scoreboard.recipe_of(method))
        alone = scoreboard.overrides("dir0.3", "standalone", "rounds", recipe)
        # The same data, partition and cut; the training of the method's recipe.
        assert {k: alone[k] for k in (*scoreboard.COMMON, "partition", "public-source")} == {
            k: mine[k] for k in (*scoreboard.COMMON, "partition", "public-source")}
        assert common.training("standalone", tuple(alone.items()), scoreboard.TRAINING) == (
            scoreboard.training(method))
    assert scoreboard.overrides("iid", "standalone", "rounds", "holdout") == {
        **scoreboard.overrides("iid", "standalone", "rounds", ""), **common.PUBLIC}
    # FedGKT needs no public set: it reads against the Standalone of the mix.
    assert scoreboard.ground("fedgkt") == "" and "public-source" not in scoreboard.overrides(
        "iid", "fedgkt", "rounds", "")
    assert scoreboard.label("fedmd", "rounds", "") == "fedmd (public set held out)"


def test_a_sub_model_method_maps_the_mix_to_levels_at_equal_budget():
    # Parameters at 1x28x28, 10 classes: CNN-1..5 2,044,758 / 1,526,342 / 1,031,758 / 829,158
    # / 525,258, shares of CNN-1's 1, 0.746, 0.505, 0.405, 0.257; heterofl-conv's levels a, b, c
    # 1,556,874 / 391,370 / 98,922, shares 1, 0.251, 0.064: a, a, b, b, b (0.505 is 0.254
    # from b, 0.495 from a). FjORD's widths 1, 0.8, 0.6, 0.4: shares 1, 0.643, 0.363, 0.163.
    # DepthFL's cnn4 at depths 4, 3: 1,560,424 / 374,622, shares 1, 0.240.
    assert scoreboard.own_settings("heterofl") == {
        "heterofl.rates": "cnn1=a,cnn2=a,cnn3=b,cnn4=b,cnn5=b"}
    assert scoreboard.own_settings("fedrolex") == {
        "fedrolex.rates": "cnn1=a,cnn2=a,cnn3=b,cnn4=b,cnn5=b"}
    assert scoreboard.own_settings("fjord") == {
        "fjord.rates": "cnn1=1,cnn2=0.8,cnn3=0.8,cnn4=0.6,cnn5=0.4"}
    assert scoreboard.own_settings("depthfl") == {
        "depthfl.model": "cnn4", "depthfl.depths": "cnn1:4,cnn2:4,cnn3:3,cnn4:3,cnn5:3"}
    # HeteroFL's and FedRolex's clients train the same models: one Standalone serves both.
    assert scoreboard.ground("heterofl") == scoreboard.ground("fedrolex") == "heterofl-models"
    assert scoreboard.ground("fjord") == "fjord-models"
    alone = scoreboard.overrides("iid", "standalone", "rounds", "heterofl-models-fedrolex-recipe")
    assert alone["lr"] == 2e-4 and alone["feature-dim"] == 0
    assert alone["arch-mix"].startswith("reproduce.submodel_models:width__heterofl_conv__")
    # Only the rows of the methods asked for run: FedRolex's recipe is FedRolex's to run.
    wanted = scoreboard.planned({"standalone", "heterofl"}, {"iid"})
    assert wanted[("heterofl", "rounds", ""), "iid"]
    assert wanted[("standalone", "rounds", "heterofl-models-heterofl-recipe"), "iid"]
    assert not wanted[("standalone", "rounds", "heterofl-models-fedrolex-recipe"), "iid"]
    assert not wanted[("heterofl", "rounds", ""), "dir0.3"]
