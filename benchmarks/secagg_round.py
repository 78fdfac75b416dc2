"""What does secure aggregation cost a deployed round, in seconds and in bytes?

Starts a loopback deployment (``fedapp.cli.loopback``, as tests/test_deploy.py does: a SuperLink
with TLS and SuperNode authentication, ``--clients`` registered SuperNodes on this machine, one
torch thread each as they share its cores) and runs on it, for each method, the smoke preset
without and with ``secure-aggregation = true`` (Flower's SecAgg+: four messages to every node per
round instead of one, the uploads masked; docs/privacy.md), one after the other on the same
nodes. For each method and mode it reports, from the run's ``rounds.jsonl``:

- the median seconds of the rounds after the first (the first also starts each node's ClientApp
  for the run and warms its caches);
- the bytes up and down per client per round (``fedapp.runtime.results``'s summary formula);
  with SecAgg+ "up" is the masked dense upload (int64 values of the method's fixed layout), and
  the key exchanges of SecAgg+'s other three messages are not counted (docs/privacy.md);

the load average before each run, and writes all of it as JSON to ``--out``. Every process it
starts is stopped when it ends.

    .venv/bin/python benchmarks/secagg_round.py --out secagg.json       # 4 SuperNodes, 4 rounds
    .venv/bin/python benchmarks/secagg_round.py --clients 2 --rounds 2 --out /tmp/s.json  # check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fedapp.cli.loopback import Loopback, Processes  # noqa: E402
from fedapp.runtime.results import bytes_per_client_per_round  # noqa: E402

METHODS = ("lg-fedavg", "fedproto")  # SecAgg+ as-is (a head's average), a fixed layout (a table)


def round_figures(run_dir: Path) -> dict[str, Any]:
    """A run's rounds: every round's seconds, the median of those after the first (None for a
    one-round run), and the bytes up and down per client per round over the rounds with
    uploads."""
    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    seconds = [r["seconds"] for r in rounds]
    with_fit = [r for r in rounds if r["clients_fit"] > 0]
    return {"round_seconds": seconds,
            "median_later_round_seconds": statistics.median(seconds[1:]) if seconds[1:]
            else None,
            "bytes_up_per_client_per_round": bytes_per_client_per_round(with_fit, "bytes_up"),
            "bytes_down_per_client_per_round": bytes_per_client_per_round(with_fit,
                                                                           "bytes_down"),
            "clients_fit": [r["clients_fit"] for r in rounds]}


def run_settings(method: str, secure: bool, clients: int, rounds: int) -> list[str]:
    """``fedapp deploy run``'s preset and settings for one method and mode."""
    return ["smoke", "--set", f'method="{method}"', "--set", f"num-clients={clients}",
            "--set", f"num-server-rounds={rounds}",
            "--set", f"secure-aggregation={'true' if secure else 'false'}"]


def table(results: list[dict[str, Any]]) -> str:
    """The results as a Markdown table."""
    def seconds(s: float | None) -> str:
        return "-" if s is None else f"{s:.2f}"
    lines = ["| method | secure aggregation | later rounds s (median) | up B/client/round "
             "| down B/client/round | load average before |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['method']} | {'yes' if r['secure'] else 'no'} | "
                     f"{seconds(r['median_later_round_seconds'])} | "
                     f"{r['bytes_up_per_client_per_round']:,.0f} | "
                     f"{r['bytes_down_per_client_per_round']:,.0f} | "
                     f"{r['load_average_before'][0]:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=4, help="SuperNodes (= num-clients)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--out", type=Path, required=True, help="the JSON result")
    args = parser.parse_args()
    if args.clients < 2 or args.rounds < 1:
        parser.error("--clients must be at least 2 (SecAgg+ needs a cohort) and --rounds 1")
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    tmp = Path(tempfile.mkdtemp(prefix="fedapp-secagg-round-"))
    processes = Processes(tmp / "logs")
    results = []
    try:
        link = Loopback(tmp / "deployment", processes, args.clients,
                        supernode_options=("--threads", "1"))
        for method in args.methods:
            for secure in (False, True):
                name = f"{method}-{'secure' if secure else 'plain'}"
                load = os.getloadavg()
                start = time.perf_counter()
                proc = link.run(*run_settings(method, secure, args.clients, args.rounds),
                                "--set", f'run-name="{name}"', "--output-dir",
                                str(tmp / "results"), timeout=3600)
                if proc.returncode != 0:
                    raise SystemExit(f"{name} failed:\n{proc.stdout}{proc.stderr}")
                results.append({"method": method, "secure": secure,
                                "load_average_before": list(load),
                                "end_to_end_seconds": time.perf_counter() - start,
                                **round_figures(tmp / "results" / name)})
                print(f"[secagg_round] {name}: {json.dumps(results[-1])}", flush=True)
    finally:
        left = processes.stop_all()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    args.out.write_text(json.dumps(
        {"commit": commit, "clients": args.clients, "rounds": args.rounds, "preset": "smoke",
         "results": results, "logs": str(tmp)}, indent=1))
    print(f"\nsmoke preset, {args.clients} SuperNodes on loopback, {args.rounds} rounds; "
          f"logs in {tmp}\n\n{table(results)}")
    if left:
        print(f"processes still running after the stop: {left}", file=sys.stderr)


if __name__ == "__main__":
    main()
