"""How long the recorded runs took: per records folder (a script's results folder), the runs,
where they were made and the sum of their own wall seconds — what `make reproduce` would spend
remaking them on the same kind of machine, one run at a time, besides each run's start (about
half a minute of Flower and Ray on 2 cores) and the runs it has no record of yet.

    .venv/bin/python reproduce/records_time.py
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RECORDS  # noqa: E402


def main() -> None:
    print("| records folder | runs | of which on a GPU | CPU runs: wall minutes in all "
          "| CPU runs: median wall s |")
    print("|---|---|---|---|---|")
    for folder in sorted(p for p in RECORDS.iterdir() if p.is_dir()):
        runs = [json.loads(f.read_text()) for f in sorted(folder.glob("*.json"))]
        on_cpu = [r["wall_seconds"] for r in runs
                  if "gpu" not in r.get("provenance", {}) and "wall_seconds" in r]
        print(f"| {folder.name} | {len(runs)} | {len(runs) - len(on_cpu)} | "
              f"{sum(on_cpu) / 60:.0f} | "
              f"{statistics.median(on_cpu) if on_cpu else float('nan'):.0f} |")


if __name__ == "__main__":
    main()
