"""Where a message's seconds go: timestamps from every process on its way, for the benchmarks
(a deployment: ``benchmarks/deployed_round.py``; a simulation:
``benchmarks/runtime_overhead.py --timeline``), off unless ``FEDAPP_TIMELINE`` names a folder.

Four kinds of line, all on this machine's wall clock (a loopback deployment or a simulation:
one clock):

- ``server``: the ServerApp's synchronous driver pushed message ``id`` at ``pushed`` and had its
  reply at ``replied`` (``fedapp.loops.grid_io.PromptGrid``);
- ``supernode``: the SuperNode received message ``id`` at ``received``, saw its ClientApp's reply
  at ``reply_seen``, had sent the reply to the SuperLink at ``reply_told`` and its objects at
  ``reply_sent``
  (``fedapp.cli.prompt_supernode``);
- ``clientapp``: the ClientApp process that handled message ``id``: forked at ``forked``, asked
  its SuperNode for its work at ``connected``, had the context, run, FAB and the message's
  object tree at ``listed``, the message's objects at ``objects`` and the message at ``pulled``,
  installed the FAB at ``installed``, loaded the app at ``loaded``, had the reply at
  ``handled``, pushed it at ``pushed`` and was about to exit at ``exited``
  (``fedapp.cli.warm_superexec``);
- ``handler``: the ClientApp in process ``pid`` began handling message ``id`` at ``entered``
  and had its reply at ``left`` (``fedapp.client_app``), wherever it runs: in a simulation, a
  Ray actor of the simulation engine (``benchmarks/runtime_overhead.py``,
  :data:`SIMULATED_PHASES`, :func:`handover_gaps`).

Each process appends to its own file (``<kind>-<pid>.jsonl``): lines of concurrent processes
never interleave. :func:`read` gathers them; :func:`phases` joins a message's marks by its id.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

ENV = "FEDAPP_TIMELINE"
# A folder: the synchronous ServerApp stops after each round until the benchmark has run
# its own round (benchmarks/runtime_overhead.py --interleave; :func:`between_rounds`).
PAUSE_ENV = "FEDAPP_PAUSE_BETWEEN_ROUNDS"
PAUSE_LIMIT = 900.0  # seconds a paused ServerApp waits before it fails the run


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def write(kind: str, **fields: Any) -> None:
    """Append one line of ``kind`` to this process's file, if a timeline is on."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    path = Path(folder) / f"{kind}-{os.getpid()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"kind": kind, **fields}) + "\n")


def now() -> float:
    return time.time()


def between_rounds(server_round: int, limit: float = PAUSE_LIMIT) -> None:
    """If ``FEDAPP_PAUSE_BETWEEN_ROUNDS`` names a folder, write ``round-<r>.done`` there and
    wait for ``round-<r>.go`` (at most ``limit`` seconds), else return at once.

    A benchmark's reference loop then runs its round while the Flower run stands still, so
    both are timed on the same machine minutes apart at most: on a shared 2-core machine the
    speed of the same training moves by half within minutes, which no ratio of two separate
    runs survives. A round's own seconds (from its first call to its evaluations recorded)
    leave the pause out."""
    folder = os.environ.get(PAUSE_ENV)
    if not folder:
        return
    (Path(folder) / f"round-{server_round}.done").touch()
    go, deadline = Path(folder) / f"round-{server_round}.go", time.monotonic() + limit
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{PAUSE_ENV}: no {go} after {limit:.0f} s")
        time.sleep(0.05)


def read(folder: Path) -> list[dict[str, Any]]:
    lines = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines() if line]
    return lines


# A message's way, in order: (phase, from, to); "server" marks are the ServerApp's.
PHASES = [("to the SuperNode (SuperLink, the node's poll)", "server.pushed",
           "supernode.received"),
          ("to a ClientApp process (SuperExec's poll, fork)", "supernode.received",
           "clientapp.forked"),
          ("connect to the SuperNode, start the heartbeat", "clientapp.forked",
           "clientapp.connected"),
          ("pull context, run, FAB and the message's object tree", "clientapp.connected",
           "clientapp.listed"),
          ("pull the message's objects", "clientapp.listed", "clientapp.pulled"),
          ("install the FAB", "clientapp.pulled", "clientapp.installed"),
          ("load the ClientApp", "clientapp.installed", "clientapp.loaded"),
          ("handle the message (data, model, training or evaluation)", "clientapp.loaded",
           "clientapp.handled"),
          # The SuperNode sees the reply once the ClientApp has pushed the message, before
          # its objects (the ClientApp's "pushed"): the node's sending waits for them.
          ("the reply to the SuperNode", "clientapp.handled", "supernode.reply_seen"),
          ("the SuperNode sends the reply to the SuperLink", "supernode.reply_seen",
           "supernode.reply_told"),
          ("the SuperNode sends its objects (as the ClientApp pushes them)",
           "supernode.reply_told", "supernode.reply_sent"),
          ("back to the ServerApp (SuperLink, the driver's pulls)", "supernode.reply_sent",
           "server.replied")]


# The same in a simulation, where a message goes from the link state to the engine's queue,
# to a Ray actor with the node's Context, and back.
SIMULATED_PHASES = [
    ("to the ClientApp (link state, the engine's queue and worker, Ray, the Context, the app)",
     "server.pushed", "handler.entered"),
    ("handle the message (the client: model, training or evaluation, payload)",
     "handler.entered", "handler.left"),
    ("back to the ServerApp (Ray, the Context's update, link state, the driver's pulls)",
     "handler.left", "server.replied")]


def phases(lines: list[dict[str, Any]], last: int | None = None,
           way: list[tuple[str, str, str]] = PHASES) -> list[dict[str, float]]:
    """Per message that every process recorded, in the order the server pushed them: the seconds of
    each phase of ``way`` (:data:`PHASES` or :data:`SIMULATED_PHASES`) and ``total`` (push
    to reply). ``last``: only the server's last so many messages (the later rounds: not the
    identity queries, not round 1 with the nodes' first ClientApps and the FAB's first
    install)."""
    by_id: dict[str, dict[str, float]] = {}  # a message's marks, from every process
    for line in lines:
        if line.get("id") is not None:
            marks = by_id.setdefault(line["id"], {})
            marks.update({f"{line['kind']}.{k}": v for k, v in line.items()
                          if k not in ("kind", "id")})
    needed = {mark for _, start, end in way for mark in (start, end)}
    out = []
    for server in _last_pushed(lines, last):
        marks = by_id[server["id"]]
        if not needed <= set(marks):
            continue
        row = {name: marks[end] - marks[start] for name, start, end in way}
        row["total"] = server["replied"] - server["pushed"]
        out.append(row)
    return out


def handover_gaps(lines: list[dict[str, Any]], last: int | None = None) -> list[float]:
    """In a simulation, the seconds a ClientApp process (a Ray actor) stands between handing
    back one message and starting the next one, which was already waiting: what the engine
    costs per message (the reply's way back through Ray, the Context's update, the next
    message and Context through Ray to the actor) while the round waits for it. Over the
    server's last ``last`` messages (all if None). Two things can widen a gap: a message pushed
    shortly before the previous one was handed back may still wait for the engine's next
    sweep of the link state (every 0.1 s), and a message whose handling raised leaves no
    mark, so the gap around it holds its handling."""
    pushed = {x["id"]: x["pushed"] for x in _last_pushed(lines, last)}
    by_process: dict[int, list[dict[str, Any]]] = {}
    for x in lines:
        if x["kind"] == "handler" and x["id"] in pushed:
            by_process.setdefault(x.get("pid", 0), []).append(x)
    gaps = []
    for handled in by_process.values():
        handled.sort(key=lambda x: x["entered"])
        gaps += [after["entered"] - before["left"] for before, after in zip(handled, handled[1:])
                 if pushed[after["id"]] <= before["left"]]
    return gaps


def handled_seconds(lines: list[dict[str, Any]], last: int | None = None) -> float:
    """The seconds the ClientApps spent handling the server's last ``last`` messages (all if
    None), summed."""
    ids = {x["id"] for x in _last_pushed(lines, last)}
    return sum(x["left"] - x["entered"] for x in lines
               if x["kind"] == "handler" and x["id"] in ids)


def _last_pushed(lines: list[dict[str, Any]], last: int | None) -> list[dict[str, Any]]:
    """The server's lines of its last ``last`` pushed messages (all if None), oldest first."""
    servers = sorted((x for x in lines if x["kind"] == "server"), key=lambda x: x["pushed"])
    return servers[-last if last else 0:]


def breakdown(folder: Path, last: int, way: list[tuple[str, str, str]] = PHASES) -> list[str]:
    """Markdown rows: each phase of ``way`` over the ``last`` messages (median and range)."""
    import numpy as np
    lines = read(folder)
    rows = phases(lines, last=last, way=way)
    if not rows:
        return ["(no message was recorded by every process on its way)"]
    out = [f"Where a message of a later round spends its seconds ({len(rows)} messages: "
           "median, min-max):", "", "| phase | s |", "|---|---|"]
    for name in [p[0] for p in way] + ["total"]:
        v = np.array([r[name] for r in rows])
        out.append(f"| {name} | {np.median(v):.3f} ({v.min():.3f}-{v.max():.3f}) |")
    if way is SIMULATED_PHASES and (gaps := handover_gaps(lines, last)):
        v = np.array(gaps)
        out += ["", f"Between two messages on one actor, the next one waiting (the engine's "
                f"cost per message): {np.median(v):.3f} s median ({v.min():.3f}-{v.max():.3f}), "
                f"{v.sum():.2f} s over {len(v)} handovers."]
    return out

