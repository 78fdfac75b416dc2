"""reproduce/felo_sparse.py: its rows with and without group averaging are docs/defaults.md's
runs (same names, same settings), so the two scripts share them, and each other row changes
exactly one thing of the paper's Felo."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reproduce"))
import defaults  # noqa: E402
import felo_sparse  # noqa: E402


def defaults_runs() -> dict[str, dict]:
    """docs/defaults.md's sparse runs of Felo, Velo and Standalone: name -> settings."""
    rows = defaults.table_rows(["felo", "velo"])
    plan = defaults.planned(rows, defaults.needed(rows, ["felo", "velo"]),
                            [felo_sparse.COLUMN], [0])
    return {name: {**defaults.DEFAULTS_SETTINGS[column](), "method": row.method, **row.changed}
            for column, row, name in plan}


def test_the_rows_with_and_without_group_averaging_are_docs_defaults_runs():
    shared = defaults_runs()
    rows = felo_sparse.plan({})
    default, paper = list(felo_sparse.CHANGES)[:2]
    for who in ("felo", "velo", "standalone"):
        settings, name = rows[who, default]
        assert shared[name] == settings, who
    for who in ("felo", "velo"):  # defaults.TRIED's rows: the paper's group averaging
        settings, name = rows[who, paper]
        assert shared[name] == settings and settings[f"{who}.group-avg"] is True, who


def test_every_other_row_changes_one_thing_of_the_papers():
    rows = felo_sparse.plan({})
    default, paper = list(felo_sparse.CHANGES)[:2]
    for (who, change), (settings, _) in rows.items():
        if change in (default, paper):
            continue
        base = rows[who, paper if (who, paper) in rows else default][0]
        differ = {k for k in {*settings, *base} if settings.get(k) != base.get(k)}
        assert len(differ) == 1, (who, change, differ)
    # a change to the recipe is made to Standalone too; group averaging is Felo's alone
    assert ("standalone", 'optimizer-state = "fresh" (a new Adam every visit)') in rows
    assert ("standalone", paper) not in rows
    assert "felo.group-avg" not in rows["felo", default][0]


def test_a_plain_invocation_makes_the_missing_rows_and_table_only_none(monkeypatch, tmp_path):
    asked = []
    monkeypatch.setattr(felo_sparse, "run_seeds", lambda _p, settings, name, seeds, out:
                        asked.append(name) or [{"accuracy": {"per_client": {"0": 0.5}}}] * 3)
    monkeypatch.setattr(felo_sparse, "finished", lambda out, name: None)  # nothing made yet
    monkeypatch.setattr(felo_sparse, "write_generated", lambda *a: None)
    monkeypatch.setattr(sys, "argv", ["felo_sparse.py"])
    felo_sparse.main()  # one job at a time: every row is run by run_seeds, in order
    assert asked == [name for _, name in felo_sparse.plan({}).values()]
    asked.clear()
    monkeypatch.setattr(sys, "argv", ["felo_sparse.py", "--table-only"])
    felo_sparse.main()
    assert asked == []
