"""How long the recorded runs took: per records folder (a script's results folder), the runs,
where they were made and, for those made on a CPU alone, the sum of their own wall seconds — what `make reproduce` would spend
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
from common import RECORDS, cpu_wall_seconds  # noqa: E402


def main() -> None:
    print("| records folder | runs | on a GPU | machine not recorded | the others: wall minutes "
          "in all | the others: median wall s |")
    print("|---|---|---|---|---|---|")
    for folder in sorted(p for p in RECORDS.iterdir() if p.is_dir()):
        runs = [json.loads(f.read_text()) for f in sorted(folder.glob("*.json"))]
        origins = [r.get("provenance", {}) for r in runs]
        on_gpu = sum("gpu" in o for o in origins)
        unknown = sum("cpu" not in o for o in origins)
        walls = cpu_wall_seconds(folder)
        print(f"| {folder.name} | {len(runs)} | {on_gpu} | {unknown} | {sum(walls) / 60:.0f} | "
              f"{statistics.median(walls) if walls else float('nan'):.0f} |")


if __name__ == "__main__":
    main()
