"""Where a deployed message's seconds go: timestamps from both ends of one message, for the
benchmarks (``benchmarks/deployed_round.py``), off unless ``FEDAPP_TIMELINE`` names a folder.

Two kinds of line, both on this machine's wall clock (a loopback deployment: one clock):

- ``server``: the ServerApp's synchronous driver pushed message ``id`` at ``pushed`` and had its
  reply at ``replied`` (``fedapp.loops.grid_io.PromptGrid``);
- ``clientapp``: the ClientApp process that handled message ``id``: forked at ``forked``, asked
  its SuperNode for its work at ``connected``, had the context, run, FAB and the message's
  object tree at ``listed``, the message's objects at ``objects`` and the message at ``pulled``,
  installed the FAB at ``installed``, loaded the app at ``loaded``, had the reply at
  ``handled``, pushed it at ``pushed`` and was about to exit at ``exited``
  (``fedapp.cli.warm_superexec``).

Each process appends to its own file (``<kind>-<pid>.jsonl``): lines of concurrent processes
never interleave. :func:`read` gathers them; :func:`phases` pairs the two ends by message id.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

ENV = "FEDAPP_TIMELINE"


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


def read(folder: Path) -> list[dict[str, Any]]:
    lines = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines() if line]
    return lines


# A message's way, in order: (phase, from, to); "server" marks are the ServerApp's.
PHASES = [("to the ClientApp (SuperLink, SuperNode, SuperExec, fork)", "server.pushed",
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
          ("push the reply", "clientapp.handled", "clientapp.pushed"),
          ("back to the ServerApp (SuperNode, SuperLink, its pulls)", "clientapp.pushed",
           "server.replied")]


def phases(lines: list[dict[str, Any]], last: int | None = None) -> list[dict[str, float]]:
    """Per message that both ends recorded, in the order the server pushed them: the seconds of
    each phase of :data:`PHASES` and ``total`` (push to reply). ``last``: only the server's
    last so many messages (the later rounds: not the identity queries, not round 1 with the
    nodes' first ClientApps and the FAB's first install)."""
    clientapps = {x["id"]: x for x in lines if x["kind"] == "clientapp" and x.get("id")}
    servers = sorted((x for x in lines if x["kind"] == "server"), key=lambda x: x["pushed"])
    needed = {end.split(".")[1] for _, start, end in PHASES if end.startswith("clientapp.")}
    out = []
    for server in servers[-last if last else 0:]:
        app = clientapps.get(server["id"])
        if app is None or not needed <= set(app):
            continue
        marks = {f"server.{k}": v for k, v in server.items()}
        marks.update({f"clientapp.{k}": v for k, v in app.items()})
        row = {name: marks[end] - marks[start] for name, start, end in PHASES}
        row["total"] = server["replied"] - server["pushed"]
        out.append(row)
    return out
