"""reproduce/defaults.py: a Standalone row for every recipe, each row read against the Standalone
trained as it is, the verdicts on that basis, and the runs an invocation needs (nothing is run
here: the runs are synthetic summaries)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reproduce"))
import common  # noqa: E402
import defaults  # noqa: E402
import felo_sparse  # noqa: E402
from common import DEFAULT_SEEDS  # noqa: E402

EVERY = [m for m in common.page_methods() if m != "standalone"]


def test_every_method_is_read_against_a_standalone_row_that_trains_exactly_as_it_does():
    rows = defaults.table_rows(EVERY)
    by_key = {row.key: row for row in rows}
    alone = [row for row in rows if row.method == "standalone" and row.base]
    # One per distinct recipe of the methods on the mix, and FedAvg's recipe on its one
    # architecture; the public-data methods' cut and the sub-model methods' clients' models
    # each have a Standalone, and one per recipe of the methods read against it.
    mix = [m for m in EVERY if not (common.needs_public(m) or common.is_submodel(m))]
    assert {row.key for row in alone if row.base == "standalone" and not row.changed.get(
        "arch-mix") and "public-source" not in row.changed} == {
        f"standalone-{common.recipe_of(m)}" for m in mix if common.recipe_of(m)
        and m != "fedavg"} | {"standalone-fedre-recipe-batch-size-64",
                                "standalone-fedgh-recipe-local-epochs-1",
                                "standalone-lg-fedavg-recipe-batch-size-10"}
    # A tried change to a method's training (FedRE's repository's batch of 64, FedGH's former
    # one epoch, LG-FedAvg's scripts' batch of 10) has a Standalone of its own: the method's
    # recipe with that change.
    assert by_key["fedre-tried-0"].own == by_key["fedre-tried-2"].own \
        == "standalone-fedre-recipe-batch-size-64"
    assert by_key["standalone-fedre-recipe-batch-size-64"].changed == {
        **dict(common.recipes()["fedre-recipe"]), "batch-size": 64}
    assert {row.key for row in alone if row.key.startswith("standalone-one-arch-")} == {
        "standalone-one-arch-lg-fedavg-recipe"}
    assert {row.key for row in alone if "holdout" in row.key} == {"standalone-holdout"} | {
        f"standalone-holdout-{common.recipe_of(m)}" for m in EVERY if common.needs_public(m)}
    assert by_key["heterofl"].base == by_key["fedrolex"].base == "standalone-heterofl-models"
    assert len(common.recipes()) >= 10  # the recipes differ in batch size and steps too here
    for row in rows:
        if row.method == "standalone":
            assert row.own is None
            continue
        if row.key in EVERY:  # every method has one (a tried setting may train as no recipe)
            assert row.own is not None, row.key
        if row.own is None:
            continue
        own, base = by_key[row.own], by_key[row.base]
        assert own.method == "standalone" and row.key in needed_by(own, rows)
        # Optimizer, its lifetime, lr, betas or momentum, batches, epochs or steps: all alike
        # (feature-dim aside for a sub-model method, which reads none: its Standalone keeps
        # each slice's own head).
        mine = dict(common.training(row.method, tuple(row.changed.items())))
        theirs = dict(common.training("standalone", tuple(own.changed.items())))
        if common.is_submodel(row.method):
            assert theirs.pop("feature-dim") == 0
            mine.pop("feature-dim")
        assert mine == theirs, row.key
        # On the same ground: the same data cut and models as the Standalone Δ is against.
        assert {k: own.changed.get(k) for k in base.changed} == base.changed, row.key
        assert own.skip == base.skip == row.skip
        if not common.is_submodel(row.method):
            assert own.changed.get("arch-mix") == row.changed.get("arch-mix")
            assert own.changed.get("public-source") == row.changed.get("public-source")
    # Methods that share a recipe share its row; the runs made before keep their names.
    assert by_key["felo"].own == by_key["velo"].own == "standalone-felo-recipe"
    assert by_key["fd"].own == by_key["fedtgp"].own == "standalone-htfllib-recipe"
    assert by_key["fedavg"].own == "standalone-one-arch-lg-fedavg-recipe"
    assert by_key["fedre-tried-1"].own == "standalone-fedre-recipe"  # the headline only


def test_every_recorded_run_is_still_a_run_of_the_table():
    """The runs made before the public-data and sub-model rows joined keep their names; the
    folder also holds reproduce/felo_sparse.py's rows, which share its sparse runs."""
    rows = defaults.table_rows(EVERY)
    plan = defaults.planned(rows, defaults.needed(rows, EVERY), list(common.DEFAULTS_SETTINGS),
                            DEFAULT_SEEDS)
    sparse = [name for _, name in felo_sparse.plan({}).values()]
    names = {f"{name}-seed{s}" for name in [n for _, _, n in plan] + sparse
             for s in DEFAULT_SEEDS}
    recorded = {p.stem for p in (common.RECORDS / "defaults").glob("*.json")}
    assert len(recorded) >= 144 and recorded <= names


def test_the_public_data_rows_cut_the_same_public_set_and_skip_the_digits():
    rows = {row.key: row for row in defaults.table_rows(EVERY)}
    for method in ("fedmd", "dsfl", "feddf", "ktpfl"):
        row = rows[method]
        assert row.changed == common.PUBLIC and row.base == "standalone-holdout"
        assert row.skip == defaults.NO_PUBLIC_SET == ("digits",)
    assert rows["standalone-holdout"].changed == common.PUBLIC
    assert rows["fedgkt"].base == "standalone" and not rows["fedgkt"].changed  # no public set
    verdicts = {v: [] for v in defaults.VERDICTS}
    line = defaults.row_text(rows["fedmd"], rows, ["digits"], lambda r, c: None, verdicts)
    assert line.split("|")[2:5] == [" — ", " — ", " — "]


def needed_by(row, rows):
    """The keys of the rows that read against ``row``."""
    return {r.key for r in rows if row.key in (r.base, r.own)}


def runs_of(accuracies):
    """Summaries of one client each, one per seed, with these local accuracies."""
    return [{"accuracy": {"per_client": {"0": a}}} for a in accuracies]


def test_a_row_gives_both_differences_and_its_verdict_against_its_own_recipe():
    rows = defaults.table_rows(["felo"])
    by_key = {row.key: row for row in rows}
    # Felo's tried row, the paper's group averaging, trains with Felo's recipe too.
    assert list(by_key) == ["standalone", "standalone-felo-recipe", "felo", "felo-tried-0"]
    assert by_key["felo-tried-0"].own == "standalone-felo-recipe"
    assert by_key["felo-tried-0"].label == "felo with felo.group-avg = true"
    made = {("standalone", "A"): runs_of([0.60, 0.62, 0.58]),
            ("standalone-felo-recipe", "A"): runs_of([0.90, 0.90, 0.90]),
            ("felo", "A"): runs_of([0.70, 0.72, 0.68]),
            ("standalone", "B"): runs_of([0.80, 0.80, 0.80]),
            ("standalone-felo-recipe", "B"): runs_of([0.85, 0.85, 0.85]),
            ("felo", "B"): runs_of([0.90, 0.82, 0.85])}
    verdicts = {v: [] for v in defaults.VERDICTS}
    text = {key: defaults.row_text(row, by_key, ["A", "B", "C"],
                                   lambda r, c: made.get((r.key, c)), verdicts)
            for key, row in by_key.items()}
    cells = [c.strip() for c in text["felo"].split("|")[2:-2]]
    # A: +0.10 over the default Standalone, -0.20 (paired: -0.20, -0.18, -0.22) below its own.
    # B: above the default by 0.057; against its own +0.05, -0.03, 0: level.
    assert cells == ["0.7000 ± 0.0163", "+0.100", "-0.200 ± 0.016",
                     "0.8567 ± 0.0330", "+0.057", "+0.007 ± 0.033",
                     "not run", "—", "—"]
    assert verdicts == {"fails": ["felo on A"], "level": ["felo on B"], "holds": []}
    # The recipe's Standalone: what the recipe alone does, and no verdict of its own.
    assert [c.strip() for c in text["standalone-felo-recipe"].split("|")[2:5]] == [
        "0.9000 ± 0.0000", "+0.300", "—"]
    assert text["standalone-felo-recipe"].split("|")[1].strip() == \
        "standalone (the recipe of felo, velo)"
    assert "Adam" in text["felo"].split("|")[-2]  # the recipe column
    lines = defaults.verdict_lines(verdicts)
    assert lines[0] == common.VERDICT_RULE
    assert "- Below Standalone at its own recipe (**fails**): felo on A." in lines
    assert "- Above Standalone at its own recipe (**holds**): none." in lines


def test_a_page_table_of_the_same_columns_is_kept_and_one_of_other_columns_is_not(tmp_path):
    columns = ["A", "B"]
    begin, end = (x.format(script=defaults.SCRIPT)
                  for x in (common.GENERATED_BEGIN, common.GENERATED_END))
    row = "| felo | 0.7 | +0.1 | -0.2 ± 0.0 | 0.8 | +0.0 | +0.0 ± 0.0 | Adam |"
    doc = tmp_path / "defaults.md"
    doc.write_text("\n".join([begin, "caption", "", *defaults.header(columns), row, "",
                              *defaults.verdict_lines({"fails": ["felo on A", "fd, tried on B"],
                                                       "level": ["felo on B"]}), end]))
    rows, verdicts = defaults.previous_table(doc, columns)
    assert rows == {"felo": row}
    assert verdicts == {"fails": ["felo on A", "fd, tried on B"], "level": ["felo on B"],
                        "holds": []}
    assert defaults.previous_table(doc, ["A", "B", "C"]) == ({}, {})


def test_an_invocation_runs_its_methods_rows_and_the_standalone_rows_they_read_against():
    rows = defaults.table_rows(EVERY)
    assert defaults.needed(rows, ["fedhe"]) == {"standalone", "standalone-fedhe-recipe", "fedhe"}
    assert defaults.needed(rows, ["fedavg"]) == {
        "standalone", "fedavg", "standalone-one-arch", "standalone-one-arch-lg-fedavg-recipe"}
    plan = defaults.planned(rows, defaults.needed(rows, ["fd"]), list(defaults.DEFAULTS_SETTINGS),
                            [0, 1, 2])
    assert [name for _, _, name in plan] == [
        "fashion-mnist-standalone", "fashion-mnist-standalone-htfllib-recipe",
        "fashion-mnist-fd", "digits-standalone", "digits-standalone-htfllib-recipe",
        "digits-fd", "fashion-mnist-sparse-standalone",
        "fashion-mnist-sparse-standalone-htfllib-recipe", "fashion-mnist-sparse-fd"]
    # Every method asked for: every row.
    assert defaults.needed(rows, EVERY) == {row.key for row in rows}


def test_the_sparse_column_has_each_client_train_about_ten_times():
    sparse = common.DEFAULTS_SETTINGS["Fashion-MNIST sparse"]()
    assert (sparse["num-clients"], sparse["max-samples-per-client"], sparse["partition"],
            sparse["dirichlet-alpha"]) == (100, 300, "dirichlet", 0.3)
    assert sparse["fraction-fit"] * sparse["num-server-rounds"] == pytest.approx(10)
    # FedClassAvg's defaults were chosen on the other two; its script keeps to them.
    assert common.FEDCLASSAVG_SETTINGS == ("Fashion-MNIST", "digits")


def test_the_script_writes_every_row_and_verdict_from_the_runs_it_reads(tmp_path, monkeypatch):
    """main() end to end, its runs replaced by synthetic summaries (each run's accuracy a
    function of its name and seed), the pages written under ``tmp_path``."""
    import zlib

    import numpy as np

    columns = {"A": lambda: {"num-clients": 10}, "B": lambda: {"num-clients": 100}}
    asked: list[str] = []

    def run_seeds(preset, overrides, name, seeds, out):
        asked.append(name)
        return runs_of([float(np.random.default_rng([zlib.crc32(name.encode()), s]).uniform(
            0.5, 0.9)) for s in seeds])

    monkeypatch.setattr(defaults, "DEFAULTS_SETTINGS", columns)
    monkeypatch.setattr(defaults, "run_seeds", run_seeds)
    monkeypatch.setattr(defaults, "run_parallel", lambda *args: None)
    monkeypatch.setattr(defaults, "ROOT", tmp_path)
    monkeypatch.setattr(defaults, "DOC", tmp_path / "docs" / "defaults.md")
    monkeypatch.setattr(sys, "argv", ["defaults.py", "--out", str(tmp_path / "runs")])
    defaults.main()
    text = (tmp_path / "docs" / "defaults.md").read_text()
    rows = defaults.table_rows(EVERY)
    assert len(asked) == len(rows) * len(columns)  # every row in every column, once
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert lines[0] == defaults.header(["A", "B"])[0]
    assert [line.split("|")[1].strip() for line in lines[1:]] == [row.label for row in rows]
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    # Every method row, in every column, has one verdict against its own recipe's Standalone.
    judged = [e for v, start in defaults.VERDICTS.items() for line in text.splitlines()
              if line.startswith(f"- {start}") for e in line[len(start) + 2:].rstrip(".")
              .split("; ") if e != "none"]
    with_own = [row.label for row in rows if row.own and row.method != "standalone"]
    assert sorted(judged) == sorted(f"{label} on {c}" for label in with_own for c in "AB")
    assert common.VERDICT_RULE in text
    # A page of the methods from HtFLlib: its rows, with the Standalone at each one's recipe.
    page = (tmp_path / "docs" / "fedgen.md").read_text()
    assert "| standalone (HtFLlib's recipe: fedgen, fedmrl, fd, fedtgp) |" in page
    assert "| fedgen |" in page and "| felo |" not in page
