"""reproduce/common.py's verdict rule: holds / level / fails from the paired differences."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reproduce"))
import common  # noqa: E402


@pytest.mark.parametrize("differences, expected", [
    # FedHe in synchronous rounds against Private, IID: small, but the same size every seed.
    ([0.0052, 0.0046, 0.0046], "holds"),
    # FedHe asynchronous against Private, IID: a positive mean the seeds do not agree on.
    ([0.0042, -0.0026, 0.0008], "level"),
    # FedGH against Standalone, pathological 2/10: equal means are a tie, not a win.
    ([-0.0007, 0.0047, -0.0040], "level"),
    ([-0.0160, -0.0386, -0.0132], "fails"),
    ([0.0, 0.0, 0.0], "level"),
    ([0.01], "holds"), ([0.0], "level"), ([-0.01], "fails"),  # one seed: no spread
])
def test_the_mean_difference_is_judged_against_its_spread_over_seeds(differences, expected):
    assert common.verdict(differences) == expected


def test_at_the_spread_itself_it_is_level():
    # mean 0.02, population std 0.02: neither above the spread nor below minus it.
    assert common.verdict([0.0, 0.04]) == "level"
    assert common.verdict([0.0, -0.04]) == "level"


def test_a_claim_line_pairs_the_runs_seed_by_seed():
    def run(*accuracies):
        return {"accuracy": {"per_client": dict(enumerate(accuracies))}}
    # Unpaired, 0.70 ± 0.08 against 0.68 ± 0.08 would be a tie; seed by seed a is above by
    # 0.02 every time.
    mine = [run(0.6, 0.7), run(0.7, 0.8), run(0.8, 0.9)]   # means 0.65, 0.75, 0.85
    base = [run(0.6, 0.66), run(0.7, 0.76), run(0.8, 0.86)]  # means 0.63, 0.73, 0.83
    line = common.claim_line("A", "B", mine, base)
    assert line == ("A ≥ B: holds (0.7500 vs 0.7300; paired by seed +0.0200 ± 0.0000: "
                    "+0.0200, +0.0200, +0.0200)")
    # The same runs in another seed order are no longer pairs of one seed.
    assert common.claim_line("A", "B", mine, base[::-1]).startswith("A ≥ B: level")
    with pytest.raises(ValueError):
        common.claim_line("A", "B", mine, base[:2])


def test_a_difference_that_rounds_to_zero_reads_plus_zero():
    assert common.signed(-0.0001) == "+0.000"
    assert common.signed(-0.0006) == "-0.001"
    assert common.signed(0.02) == "+0.020"
    assert common.signed(-0.00004, 4) == "+0.0000"
