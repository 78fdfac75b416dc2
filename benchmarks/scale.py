"""How do memory and time grow with the number of clients? ``fedapp run`` at several scales,
with the whole process tree's memory sampled while it runs.

Work: FedGH on Fashion-MNIST (IID, at most ``--samples-per-client`` training samples per client,
300 by default; the shards hold 6 each at 10,000 clients), the CNN-1..5 mix, one local epoch of batch-64 SGD per round. A fixed number of
clients trains per round (``--participants``; ``fraction-fit`` is set to almost 0 and
``min-fit-clients`` to that number) and only the round's participants are evaluated
(``eval-clients = "participants"``), so the work per round is the same at every scale and what
grows with the number of clients is the framework's own cost.

Memory: every second the proportional set size (PSS, shared pages divided among the processes
sharing them) of every process started after the benchmark began is summed: the CLI, the
SuperLink, the ServerApp, the simulation and Ray's processes and actors. The peak is reported.
Time: each round's wall ``seconds`` from ``rounds.jsonl``; round 1 also pays for starting the Ray
actors (the server learns which partition each node holds from the simulation engine, without a
message per client).

    .venv/bin/python benchmarks/scale.py --clients 100,1000,10000 --participants 20 --rounds 3
    .venv/bin/python benchmarks/scale.py --clients 10000 --participants 100 --rounds 20

Each scale is a separate ``fedapp run``; run nothing else meanwhile (the times are the point).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FEDAPP = [sys.executable, "-m", "fedapp.cli.main"]
GIB = 1024 ** 3


def settings(clients: int, args: argparse.Namespace) -> dict:
    return {"method": "fedgh", "dataset": "fmnist", "partition": "iid", "num-clients": clients,
            "num-server-rounds": args.rounds, "arch-mix": "cnn1,cnn2,cnn3,cnn4,cnn5",
            "max-samples-per-client": args.samples_per_client, "local-epochs": 1,
            "batch-size": 64,
            # n = max(min-fit-clients, ceil(fraction-fit * clients)): exactly `participants`.
            "fraction-fit": 1e-9, "min-fit-clients": args.participants,
            "eval-clients": "participants", "client-state": args.client_state,
            "seed": args.seed, "run-name": f"scale-{clients}"}


def _pss_bytes(pid: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass  # the process ended between listing and reading
    return 0


def _pids() -> set[str]:
    return {p for p in os.listdir("/proc") if p.isdigit()}


class MemorySampler(threading.Thread):
    """Peak summed PSS of the processes that did not exist when it was made (except itself)."""

    def __init__(self, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.before = _pids() - {str(os.getpid())}
        self.interval, self.peak, self.peak_processes = interval, 0, 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            new = _pids() - self.before - {str(os.getpid())}
            total = sum(_pss_bytes(p) for p in new)
            if total > self.peak:
                self.peak, self.peak_processes = total, len(new)
            self._done.wait(self.interval)

    def stop(self) -> None:
        self._done.set()
        self.join()


def one_scale(clients: int, args: argparse.Namespace, out: Path) -> dict:
    sets = []
    for key, value in settings(clients, args).items():
        sets += ["--set", f"{key}={json.dumps(value) if isinstance(value, str) else value}"]
    sampler = MemorySampler()
    sampler.start()
    start = time.perf_counter()
    proc = subprocess.run([*FEDAPP, "run", *sets, "--output-dir", str(out)], cwd=ROOT)
    end_to_end = time.perf_counter() - start
    sampler.stop()
    if proc.returncode != 0:
        raise SystemExit(f"{clients} clients: fedapp run failed with {proc.returncode}")
    run_dir = out / f"scale-{clients}"
    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    later = [r["seconds"] for r in rounds[1:]]
    return {"clients": clients, "peak_gib": sampler.peak / GIB,
            "processes": sampler.peak_processes, "round1": rounds[0]["seconds"],
            "later": sum(later) / len(later) if later else float("nan"),
            "later_client": (sum(r["client_seconds"] for r in rounds[1:]) / len(later)
                             if later else float("nan")),
            "server": summary["wall_seconds"], "end_to_end": end_to_end,
            "accuracy": summary["accuracy"]["mean"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="100,1000,10000",
                        help="comma-separated numbers of clients, one run each")
    parser.add_argument("--participants", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples-per-client", type=int, default=300,
                        help="cap on each client's training samples (the IID shard of 60,000 "
                             "is smaller above 200 clients: 6 at 10,000); give 6 to keep the "
                             "work per client the same at every scale")
    parser.add_argument("--client-state", default="disk", choices=("memory", "disk"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="",
                        help="where the runs go (default: a fresh temporary folder)")
    args = parser.parse_args()
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="fedapp-scale-")).resolve()
    rows = [one_scale(int(n), args, out) for n in args.clients.split(",")]
    print(f"\nFedGH, Fashion-MNIST, CNN-1..5, at most {args.samples_per_client} samples per "
          f"client, {args.participants} clients train per round "
          f"(and are evaluated), {args.rounds} rounds, client-state = {args.client_state}; "
          f"runs in {out}\n")
    print("| clients | peak memory (PSS, GiB) | processes | round 1 s | later rounds s "
          "(clients' compute) | ServerApp s | end to end s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['peak_gib']:.2f} | {r['processes']} | {r['round1']:.1f} | "
              f"{r['later']:.1f} ({r['later_client']:.1f}) | {r['server']:.0f} | "
              f"{r['end_to_end']:.0f} |")


if __name__ == "__main__":
    main()
