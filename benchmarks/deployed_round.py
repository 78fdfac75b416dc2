"""What does a round cost deployed, beside the same round simulated?

Starts a loopback deployment (``fedapp deploy``: TLS, two authenticated SuperNodes on this
machine), runs the same experiment on it with each way of starting the ClientApp process
(``--clientapp forked``: forked from a process that imported torch and Flower once, the default;
``fresh``: a new interpreter per message, as Flower's own SuperExec does) and each idle wait of
the SuperNodes (``--poll-seconds``: 0.5, the default, or 3, Flower's own, with Flower's 1 s
before a missing object is asked for again) and torch threads of
each node (``--threads``: 1, as the two share this machine's cores, or torch's own), then runs
it in simulation (``fedapp run``), and prints each variant's round 1 and mean later round from
the run's ``rounds.jsonl``. For the first variant (the default deployment) it also prints where
a later round's message spends its seconds, from the timestamps of every process on its way
(``fedapp.runtime.timeline``). Two more variants change one thing of the first each: the
SuperLink's state in memory instead of its database (``fedapp deploy superlink --state``), and a
message's objects sent eight at a time (``FEDAPP_OBJECT_TRANSFERS``). Every process it starts
is stopped when it ends.

    .venv/bin/python benchmarks/deployed_round.py                       # LG-FedAvg, 4 rounds
    .venv/bin/python benchmarks/deployed_round.py --method fedproto --rounds 6
    .venv/bin/python benchmarks/deployed_round.py --variants 1   # the default deployment only
    .venv/bin/python benchmarks/deployed_round.py --only 1 5 6   # these, each with its timeline
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fedapp.cli.flower import _free_port, stop_process_group, wait_for_port  # noqa: E402
from fedapp.runtime.object_pulls import PULL_ENV, TRANSFERS_ENV  # noqa: E402
from fedapp.runtime import timeline  # noqa: E402

FEDAPP = [sys.executable, "-m", "fedapp.cli.main"]


def fedapp(*args: str, log: Path | None = None, wait: bool = True):
    """``fedapp ARGS``: waited for (its output into ``log``), or started in its own group."""
    out = open(log, "w") if log else subprocess.DEVNULL
    if wait:
        proc = subprocess.run([*FEDAPP, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise SystemExit(f"fedapp {' '.join(args)} failed" + (f"; see {log}" if log else ""))
        return proc
    return subprocess.Popen([*FEDAPP, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def rounds(run_dir: Path) -> tuple[float, float]:
    """(round 1 seconds, mean seconds of the later rounds)."""
    seconds = [json.loads(line)["seconds"]
               for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    later = seconds[1:] or seconds
    return seconds[0], sum(later) / len(later)


# (label, --clientapp, --poll-seconds, --threads, the SuperLink's --state, objects sent at a
# time). Two nodes share this machine's cores, so one torch thread each, as simulation gives
# each virtual client one CPU; the second row shows what torch's own thread count (every core,
# in each node) costs them. The last two change one thing of the first: where the SuperLink
# keeps messages and their objects (its database, one SQL write or more per object, or its
# memory), and how many of a message's objects travel at once (Flower's two, or eight).
VARIANTS = [("deployed, ClientApp forked, poll 0.5 s, 1 thread", "forked", 0.5, 1, "database",
             None),
            ("deployed, ClientApp forked, poll 0.5 s, torch's threads", "forked", 0.5, 0,
             "database", None),
            ("deployed, ClientApp forked, poll 3 s (Flower's waits), 1 thread", "forked", 3.0, 1,
             "database", None),
            ("deployed, ClientApp fresh (Flower's), poll 3 s (Flower's waits), 1 thread", "fresh",
             3.0, 1, "database", None),
            ("deployed as the first, the SuperLink's state in memory", "forked", 0.5, 1,
             "memory", None),
            ("deployed as the first, 8 objects at a time", "forked", 0.5, 1, "database", 8)]


def deployed(tmp: Path, clientapp: str, poll: float, threads: int, state: str,
             transfers: int | None, settings: list[str],
             trace: Path | None = None) -> tuple[float, float]:
    """A loopback deployment of the variant, one run on it: (round 1 s, later rounds s). With
    ``trace``, every process it starts writes its timeline there."""
    # A deployment folder each: a SuperLink keeps its registered nodes in its database.
    tag = f"{clientapp}-{poll:g}-{threads}-{state}-{transfers or 'flower'}"
    if trace is not None:
        os.environ[timeline.ENV] = str(trace)
    if poll >= 3:  # Flower's waits: its SuperNode's 3 s, and 1 s before a missing object's retry
        os.environ[PULL_ENV] = "1"
    if transfers:  # every process started below: the nodes, their ClientApps, the ServerApp
        os.environ[TRANSFERS_ENV] = str(transfers)
    d = ["--dir", str(tmp / f"deployment-{tag}")]
    fedapp("deploy", "certs", *d)
    fedapp("deploy", "node-key", "site0", "site1", *d)
    started = []
    try:
        port = _free_port()
        link = fedapp("deploy", "superlink", "--port", str(port), "--state", state, *d,
                      log=tmp / f"superlink-{tag}.log", wait=False)
        started.append(link)
        wait_for_port(link, port, "the SuperLink", tmp / f"superlink-{tag}.log")
        fedapp("deploy", "connect", f"127.0.0.1:{port}", *d)
        keys = tmp / f"deployment-{tag}" / "keys"
        fedapp("deploy", "register", str(keys / "site0.pub"), str(keys / "site1.pub"), *d)
        for k in (0, 1):
            started.append(fedapp(
                "deploy", "supernode", "--superlink", f"127.0.0.1:{port}",
                "--key", str(keys / f"site{k}.key"), "--port", str(_free_port()),
                "--node-config", f"partition-id={k} num-partitions=2",
                "--clientapp", clientapp, "--poll-seconds", str(poll),
                "--threads", str(threads), *d,
                log=tmp / f"site{k}-{tag}.log", wait=False))
        name = f"deployed-{tag}"
        fedapp("deploy", "run", *settings, "--set", f'run-name="{name}"',
               "--output-dir", str(tmp / "results"), *d, log=tmp / f"{name}.log")
        return rounds(tmp / "results" / name)
    finally:
        os.environ.pop(timeline.ENV, None)
        os.environ.pop(PULL_ENV, None)
        os.environ.pop(TRANSFERS_ENV, None)
        for proc in reversed(started):
            stop_process_group(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="lg-fedavg")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--variants", type=int, default=len(VARIANTS),
                        help="run the first N deployed variants (default: all); simulation "
                             "always")
    parser.add_argument("--only", type=int, nargs="+", metavar="K",
                        help="run these deployed variants (1 is the first), in this order, "
                             "instead; each has its timeline printed")
    args = parser.parse_args()
    if any(not 1 <= k <= len(VARIANTS) for k in args.only or []):
        parser.error(f"--only takes variants 1 to {len(VARIANTS)}")
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    # The smoke preset (synthetic data), two clients of the two smallest CNNs.
    settings = ["smoke", "--set", f'method="{args.method}"', "--set", "num-clients=2",
                "--set", 'arch-mix="cnn5,cnn4"', "--set", f"num-server-rounds={args.rounds}"]
    tmp = Path(tempfile.mkdtemp(prefix="fedapp-deployed-round-"))
    load = os.getloadavg()[0]
    results = {}
    chosen = ([VARIANTS[k - 1] for k in args.only] if args.only
              else VARIANTS[:args.variants])
    traced = chosen if args.only else chosen[:1]  # the timeline of every one chosen by --only
    for i, (label, *variant) in enumerate(chosen):
        start = time.perf_counter()
        results[label] = (*deployed(tmp, *variant, settings,
                                    trace=tmp / f"timeline-{i}" if i < len(traced) else None),
                          time.perf_counter() - start)
    start = time.perf_counter()
    fedapp("run", *settings, "--set", 'run-name="simulated"', "--output-dir",
           str(tmp / "results"), log=tmp / "simulated.log")
    results["simulation"] = (*rounds(tmp / "results" / "simulated"), time.perf_counter() - start)
    print(f"\n{args.method}, smoke preset, 2 clients, {args.rounds} rounds; load average "
          f"{load:.2f} before the first run; logs in {tmp}\n")
    print("| variant | round 1 s | later rounds s (mean) | end to end s |\n|---|---|---|---|")
    for label, (first, later, total) in results.items():
        print(f"| {label} | {first:.1f} | {later:.1f} | {total:.0f} |")
    # The later rounds: a training and an evaluation message to each of the two nodes.
    for i, (label, *_) in enumerate(traced):
        print("\n" + label + ". "
              + "\n".join(timeline.breakdown(tmp / f"timeline-{i}", last=4 * (args.rounds - 1))))


if __name__ == "__main__":
    main()
