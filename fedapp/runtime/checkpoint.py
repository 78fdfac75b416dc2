"""Checkpoints: a run killed after round k resumes from its last checkpoint to the same numbers.

What a resumed run needs is exactly what lives across rounds, and nothing else — every random
stream is keyed by (seed, partition, round), so no generator state is saved:

- the server's: the strategy's method state (every attribute a method adds to the base: global
  header, stores, per-architecture models, ...) and the round it was taken after, written by
  the ServerApp every ``checkpoint-every`` rounds into ``<run>/checkpoint/`` (the records of
  the rounds so far are ``rounds.jsonl`` already);
- each client's: its ``context.state`` (the private model and whatever else a method keeps
  there), written after every local training into a state folder as one file per round
  (``partition-<id>/round-<r>.state``), so that a client can go back to "as of round k"
  whichever round the server's last checkpoint was taken after.

With ``client-state = "disk"`` the same folder also holds each client's arrays between its
messages (``partition-<id>/idle.state``, :func:`put_away` / :func:`take_back`), so that an idle
client costs no memory whatever the number of clients.

The server's checkpoint is a pickle of the server's own objects, read only from the run folder
the server itself wrote — never anything a client sent (client payloads are plain .npy arrays,
never unpickled). Client state files are Flower's own protobuf encoding of a ``RecordDict``.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE
from flwr.common.serde import ProtoRecordDict, recorddict_from_proto, recorddict_to_proto

SERVER_FILE = "server.pkl"
ROUND_FILE = re.compile(r"round-(\d+)\.state")


def _write_atomically(path: Path, data: bytes) -> None:
    """A reader (or a resumed run) never sees half a file: write aside, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)


# -- the server's side ----------------------------------------------------------------------------

def save_server(folder: Path, server_round: int, method_state: dict[str, Any]) -> None:
    """The strategy's method state as of the end of ``server_round``."""
    _write_atomically(folder / SERVER_FILE,
                      pickle.dumps({"round": server_round, "state": method_state}))


def load_server(folder: Path) -> tuple[int, dict[str, Any]]:
    """(round, method state) of the last checkpoint in ``folder``; FileNotFoundError if none."""
    checkpoint = pickle.loads((folder / SERVER_FILE).read_bytes())
    return int(checkpoint["round"]), checkpoint["state"]


# -- a client's side ----------------------------------------------------------------------------

def _rounds(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir()
                  if (m := ROUND_FILE.fullmatch(p.name)))


def save_client(state_dir: Path, partition_id: int, server_round: int, state: RecordDict,
                checkpoint_every: int) -> None:
    """Keep ``state`` as this client's state after ``server_round``, and forget what no
    resumed run can need: every file but the newest one at or before the checkpoint before
    the last one that may have been written, and those after it."""
    folder = state_dir / f"partition-{partition_id}"
    # Never on disk: the secret keys and mask seed of Flower's SecAgg+ mod (secure-aggregation).
    state = RecordDict({k: v for k, v in state.items() if k != RECORD_KEY_STATE})
    _write_atomically(folder / f"round-{server_round}.state",
                      recorddict_to_proto(state).SerializeToString())
    # The server may have been killed before writing the checkpoint of the current block, so
    # the one before it is the oldest a resume can start from.
    oldest_resume = (server_round // checkpoint_every - 1) * checkpoint_every
    kept = [r for r in _rounds(folder) if r <= oldest_resume][-1:]
    for r in _rounds(folder):
        if r <= oldest_resume and r not in kept:
            (folder / f"round-{r}.state").unlink(missing_ok=True)


def load_client(state_dir: Path, partition_id: int, up_to_round: int) -> RecordDict | None:
    """This client's state as of the end of ``up_to_round`` (its newest file at or before
    it), or None if it had not trained by then."""
    folder = state_dir / f"partition-{partition_id}"
    rounds = [r for r in _rounds(folder) if r <= up_to_round]
    if not rounds:
        return None
    blob = (folder / f"round-{rounds[-1]}.state").read_bytes()
    return recorddict_from_proto(ProtoRecordDict.FromString(blob))


IDLE_FILE = "idle.state"


def put_away(state_dir: Path, partition_id: int, state: RecordDict, changed: bool = True
             ) -> None:
    """Move the arrays of ``state`` (the private model and whatever arrays a method keeps) to
    this client's idle file, leaving only the small config records in memory (``changed``
    False: the file already holds them, they are only dropped from memory)."""
    arrays = RecordDict({k: v for k, v in state.items() if isinstance(v, ArrayRecord)})
    if not arrays:
        return
    if changed:
        _write_atomically(state_dir / f"partition-{partition_id}" / IDLE_FILE,
                          recorddict_to_proto(arrays).SerializeToString())
    for key in list(arrays):
        del state[key]


def take_back(state_dir: Path, partition_id: int, state: RecordDict) -> None:
    """The inverse of :func:`put_away` (nothing to do before the client's first training)."""
    path = state_dir / f"partition-{partition_id}" / IDLE_FILE
    if path.exists():
        for key, record in recorddict_from_proto(
                ProtoRecordDict.FromString(path.read_bytes())).items():
            state[key] = record
