"""reproduce/robustness.py: which cells exist, their run names, the pairing with the attack-free
run, the choice of the best rule and the order of the plan."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reproduce"))
import robustness  # noqa: E402


def test_ten_and_thirty_percent_of_ten_clients_are_one_and_three_attackers():
    assert robustness.attackers(0.1) == 1 and robustness.attackers(0.3) == 3
    assert robustness.attackers(None) == 0


def test_run_names_carry_the_attack_the_share_and_the_rule_with_its_parameter():
    assert robustness.run_name("fedgh", "none", None, "none") == "fedgh-none"
    assert robustness.run_name("fedgh", "scale", 0.3, "none") == "fedgh-scale-p30"
    assert robustness.run_name("lg-fedavg", "collude", 0.1, "median") == \
        "lg-fedavg-collude-p10-median"
    assert robustness.run_name("fedgh", "none", 0.3, "trimmed-mean") == \
        "fedgh-none-trimmed-mean-b0.3"
    assert robustness.run_name("fedgh", "sign-flip", 0.1, "multi-krum") == \
        "fedgh-sign-flip-p10-multi-krum-f1"
    # A rule without a parameter needs one attack-free run for both shares.
    assert robustness.run_name("fedgh", "none", 0.1, "geomed") == \
        robustness.run_name("fedgh", "none", 0.3, "geomed")


def test_each_run_is_the_scoreboards_setting_with_what_the_cell_changes():
    o = robustness.overrides("fedgh", "scale", 0.3, "multi-krum")
    assert o["dirichlet-alpha"] == 0.3 and o["num-clients"] == 10 and o["num-server-rounds"] == 20
    assert (o["attack"], o["malicious-fraction"]) == ("scale", 0.3)
    assert (o["robust-aggregation"], o["robust-krum-f"]) == ("multi-krum", 3)
    assert robustness.overrides("fedgh", "none", 0.1, "trimmed-mean")[
        "robust-trim-fraction"] == 0.1
    clean = robustness.overrides("fedgh", "none", None, "none")
    assert not {"attack", "malicious-fraction", "robust-aggregation"} & set(clean)
    assert robustness.overrides("fedavg", "none", None, "none")["arch-mix"] == "cnn5"
    assert robustness.overrides("fedmd", "none", None, "none")["public-source"] == \
        "train-holdout"


def test_the_cells_are_what_fedapp_run_accepts():
    attacks = robustness.attacks()
    # targeted needs per-class rows; every other attack applies to every method.
    assert robustness.method_attacks("fedproto", attacks) == attacks
    assert robustness.method_attacks("lg-fedavg", attacks) == [a for a in attacks
                                                               if a != "targeted"]
    assert robustness.candidates("lg-fedavg") == list(robustness.CANDIDATES)
    # Per-class rows take the median-type rules; two clients per architecture leave Krum out.
    assert robustness.candidates("fedproto") == ["median", "trimmed-mean", "geomed"]
    assert robustness.candidates("fedper") == ["median", "trimmed-mean", "geomed"]
    assert robustness.candidates("fedgkt") == []
    rule, why = robustness.best_rule("fedgkt", attacks, Path("/nonexistent"), None, ())
    assert rule is None and "server-distillation" in why
    assert "standalone" not in robustness.methods()


def summary(per_client, malicious=None):
    out = {"accuracy": {"per_client": {str(k): v for k, v in enumerate(per_client)}}}
    return out if malicious is None else {**out, "malicious_clients": malicious}


def test_the_honest_clients_are_compared_with_the_same_clients_without_attackers():
    clean = [summary([0.8, 0.6, 0.9, 0.5]), summary([0.7, 0.7, 0.7, 0.7])]
    attacked = [summary([0.1, 0.5, 0.6, 0.4], malicious=[0]),
                summary([0.2, 0.6, 0.0, 0.6], malicious=[0, 2])]
    assert robustness.honest_mean(attacked[0]) == pytest.approx(0.5)
    diffs = robustness.versus_clean(attacked, clean)
    # Seed 0: honest 1, 2, 3: 0.5 against (0.6 + 0.9 + 0.5) / 3; seed 1: 1, 3: 0.6 against 0.7.
    assert diffs == pytest.approx([0.5 - 2.0 / 3, 0.6 - 0.7])
    assert robustness.text([0.5, 0.6], diffs) == "0.550 ± 0.050 (-0.133 ± 0.033)"
    assert robustness.text([0.5], [0.0]) == "0.500 (+0.000)"


def test_the_best_rule_is_the_pre_pass_best_on_average_over_the_attacks(tmp_path):
    attacks = ["sign-flip", "scale"]
    rules = robustness.candidates("lg-fedavg")
    assert robustness.best_rule("lg-fedavg", attacks, tmp_path, None, ()) == (None, "pending")
    honest = {("median", "sign-flip"): 0.6, ("median", "scale"): 0.6,
              ("trimmed-mean", "sign-flip"): 0.9, ("trimmed-mean", "scale"): 0.1,
              ("geomed", "sign-flip"): 0.7, ("geomed", "scale"): 0.5,
              ("multi-krum", "sign-flip"): 0.3, ("multi-krum", "scale"): 0.3}
    for rule in rules:
        for attack in attacks:
            name = robustness.run_name("lg-fedavg", attack, robustness.PREPASS_FRACTION, rule)
            run = tmp_path / f"{name}-seed{robustness.PREPASS_SEED}"
            run.mkdir()
            (run / "summary.json").write_text(json.dumps(
                summary([0.0, honest[rule, attack]], malicious=[0])))
    scores = robustness.prepass_scores("lg-fedavg", rules, attacks, tmp_path)
    assert scores == pytest.approx({"median": 0.6, "trimmed-mean": 0.5, "geomed": 0.6,
                                    "multi-krum": 0.3})
    # median and geomed tie at 0.6: the first in CANDIDATES wins.
    assert robustness.best_rule("lg-fedavg", attacks, tmp_path, None, ()) == ("median",
                                                                             "pre-pass")
    assert robustness.best_rule("lg-fedavg", attacks, tmp_path, "geomed", ()) == (
        "geomed", "fixed by --rule")


def test_the_plan_runs_whole_cells_stage_by_stage(tmp_path):
    attacks = ["sign-flip", "targeted"]
    stages = robustness.plan(["lg-fedavg", "fedproto"], attacks, [0.3, 0.1], [0, 1, 2],
                             tmp_path, None, attacks, ())
    assert list(stages) == ["pre-pass", "attack-free", "30 % attackers", "10 % attackers"]
    prepass = stages["pre-pass"]
    # lg-fedavg: 4 rules under sign-flip; fedproto: 3 rules under both attacks.
    assert len(prepass) == 4 + 3 * 2
    assert all(c.seeds == (robustness.PREPASS_SEED,) and c.fraction == 0.3 for c in prepass)
    assert [c.name for c in stages["attack-free"]] == ["lg-fedavg-none", "fedproto-none"]
    # Before the pre-pass the rule is a placeholder counted once per share.
    names = [c.name for c in stages["30 % attackers"]]
    assert names == ["lg-fedavg-none-<best-rule>-p30", "lg-fedavg-sign-flip-p30",
                     "lg-fedavg-sign-flip-p30-<best-rule>-p30", "fedproto-none-<best-rule>-p30",
                     "fedproto-sign-flip-p30", "fedproto-sign-flip-p30-<best-rule>-p30",
                     "fedproto-targeted-p30", "fedproto-targeted-p30-<best-rule>-p30"]
    assert all(c.seeds == (0, 1, 2) for c in stages["10 % attackers"])
    # A fixed rule without a parameter: one attack-free run with it serves both shares.
    fixed = robustness.plan(["lg-fedavg"], attacks, [0.3, 0.1], [0], tmp_path, "median",
                            attacks, ())
    assert fixed["pre-pass"] == []
    assert [c.name for c in fixed["10 % attackers"]] == ["lg-fedavg-sign-flip-p10",
                                                         "lg-fedavg-sign-flip-p10-median"]
    assert fixed["30 % attackers"][0].name == "lg-fedavg-none-median"


def write_run(out, name, per_client, malicious=None, failed=None):
    run = out / name
    run.mkdir(parents=True)
    if failed:
        (run / "failed.json").write_text(json.dumps({"kind": "non-finite", "reason": failed}))
    else:
        (run / "summary.json").write_text(json.dumps(summary(per_client, malicious)))


def test_the_table_reads_each_cell_against_the_attack_free_run(tmp_path, monkeypatch):
    import common
    monkeypatch.setattr(common, "RECORDS", tmp_path / "records")
    monkeypatch.setattr(common, "READ", {})
    out, attacks = tmp_path / "robustness", ["sign-flip"]
    for rule, acc in zip(robustness.candidates("lg-fedavg"), (0.5, 0.4, 0.7, 0.6)):
        write_run(out, f"{robustness.run_name('lg-fedavg', 'sign-flip', 0.3, rule)}-seed3",
                  [0.0] * 3 + [acc] * 7, malicious=[0, 1, 2])
    # A pre-pass run the server stopped counts 0, and is not run again.
    stopped_run = f"{robustness.run_name('lg-fedavg', 'sign-flip', 0.3, 'median')}-seed3"
    (out / stopped_run / "summary.json").unlink()
    (out / stopped_run / "failed.json").write_text(json.dumps({"kind": "non-finite",
                                                               "reason": "NaN"}))
    assert robustness.prepass_scores("lg-fedavg", robustness.candidates("lg-fedavg"), attacks,
                                      out)["median"] == 0.0
    write_run(out, "lg-fedavg-none-seed0", [0.9] * 3 + [0.8] * 7)
    write_run(out, "lg-fedavg-sign-flip-p30-seed0", [0.1] * 3 + [0.5] * 7, malicious=[0, 1, 2])
    write_run(out, "lg-fedavg-sign-flip-p30-geomed-seed0", [], failed="state is NaN")
    cell = robustness.Cell("lg-fedavg", "sign-flip", 0.3, "geomed", (0,))
    assert robustness.missing(cell, out) == []
    body, found = robustness.table(["lg-fedavg", "fedgkt"], attacks, [0.3], [0], out, None,
                                   attacks, (), "cmd")
    assert found
    rows = body.splitlines()
    assert "| lg-fedavg — geomed | none | 0.830 | not run |" in rows
    assert "|  | sign-flip | 0.500 (-0.300) | stopped |" in rows
    assert "| fedgkt — no rule | none | not run | no rule |" in rows
    assert "- lg-fedavg-sign-flip-p30-geomed-seed0: non-finite: state is NaN" in rows
    assert "| lg-fedavg | 1 | 0.000 | 0.400 | **0.700** | 0.600 |" in rows
    assert any(r.startswith("- fedgkt: setting robust-aggregation") for r in rows)
    # Every run the table read is counted in its provenance line.
    assert len(common.READ) == 2 + 3


def test_a_quick_sitting_runs_stage_by_stage_and_reports_what_failed(tmp_path, monkeypatch):
    """The whole script with a stand-in for ``fedapp run``: the pre-pass decides the rule the
    later stages run, one failing cell leaves the others run, the table goes to --out."""
    import common
    monkeypatch.setattr(common, "RECORDS", tmp_path / "records")
    monkeypatch.setattr(common, "READ", {})
    made = []

    def fake_run_seeds(preset, o, name, seeds, out):
        if name == "fedproto-targeted-p10":
            raise RuntimeError(f"{name} failed with exit status 1")
        for s in seeds:
            run = Path(out) / f"{name}-seed{s}"
            if not run.exists():
                made.append(run.name)
                bad = robustness.attackers(o.get("malicious-fraction"))
                rule = o.get("robust-aggregation", "none")
                acc = {"none": 0.2 if bad else 0.4, "geomed": 0.7}.get(rule, 0.6)
                write_run(Path(out), run.name, [0.0] * bad + [acc] * (10 - bad),
                          malicious=list(range(bad)) if "attack" in o else None)
        return [json.loads((Path(out) / f"{name}-seed{s}" / "summary.json").read_text())
                for s in seeds]
    monkeypatch.setattr(robustness, "run_seeds", fake_run_seeds)
    monkeypatch.setattr(sys, "argv", ["robustness.py", "--quick", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="fedproto-targeted-p10: seeds 0"):
        robustness.main()
    # The pre-pass first (seed 3), each method's best rule (geomed) in the later stages.
    assert made[0] == "lg-fedavg-sign-flip-p30-median-seed3"
    assert "lg-fedavg-sign-flip-p30-geomed-seed0" in made
    assert not any("median-seed0" in m or "krum-f1" in m for m in made)
    assert made.index("fedproto-targeted-p30-geomed-seed0") < made.index(
        "lg-fedavg-sign-flip-p10-seed0")
    page = (tmp_path / "quick" / "robustness.md").read_text()
    assert "| fedproto — geomed | none | 0.400 | 0.700 (+0.300) | 0.400 | 0.700 (+0.300) |" \
        in page
    assert "|  | targeted | not run | 0.700 (+0.300) | 0.200 (-0.200) | 0.700 (+0.300) |" \
        in page
    assert "|  | sign-flip | 0.200 (-0.200) | 0.700 (+0.300) | 0.200 (-0.200) | 0.700 (+0.300) |" \
        in page
