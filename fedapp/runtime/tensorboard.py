"""TensorBoard scalars of a run, written from the very records ``rounds.jsonl`` and
``updates.jsonl`` hold (``tensorboard = true``; the ``tensorboard`` extra).

:class:`fedapp.runtime.results.Recorder` hands each record it appends to those files to
:class:`TensorBoardWriter` as well, so the two views of a run never disagree: a scalar here is a
number of a round record, renamed by :func:`round_scalars` into TensorBoard's groups, at step =
the record's ``round`` (an evaluation of the asynchronous and device-to-device loops). Per-client
values stay in ``rounds.jsonl`` only (hundreds of curves would bury the rest). Each update of the
asynchronous loops adds its ``staleness`` at step = the update's commit number.

Event files go to ``<run folder>/tensorboard/``: ``tensorboard --logdir <results root>`` shows
every run under it side by side (docs/usage.md, "Looking at runs").
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedapp.config import ConfigError

SUBDIR = "tensorboard"
MISSING = ("tensorboard = true needs the tensorboard package, which is not installed in this "
           "environment: install it with `pip install -e \".[tensorboard]\"` (or `pip install "
           "tensorboard`), or run with tensorboard = false")

# Round-record keys -> TensorBoard tags (the part before the first '/' is the group TensorBoard
# draws together). A number (or a table of numbers) that is not named here keeps its own name.
TAGS = {
    "accuracy_mean": "accuracy/mean", "accuracy_std": "accuracy/std",
    "per_architecture": "accuracy/architecture",
    "global_accuracy_mean": "accuracy/global_mean", "global_accuracy_std": "accuracy/global_std",
    "variants": "accuracy/variant",
    "server_accuracy": "server_accuracy",  # {name: accuracy}: server_accuracy/<name>
    "train_loss": "loss/train", "train_terms": "loss/term", "server_terms": "loss/server",
    "bytes_up": "traffic/bytes_up", "bytes_down": "traffic/bytes_down",
    "framing_up": "traffic/framing_up", "framing_down": "traffic/framing_down",
    "eval_bytes_down": "traffic/eval_bytes_down",
    "seconds": "time/seconds", "client_seconds": "time/client_seconds",
    "server_seconds": "time/server_seconds",
    "virtual_seconds": "time/virtual_seconds", "virtual_time": "time/virtual_time",
    "clients_sampled": "clients/sampled", "clients_fit": "clients/fit",
    "failures": "clients/failures", "rejected": "clients/rejected",
    "updates": "clients/updates",
}
# Tables with one value per client: kept out of TensorBoard (see the module docstring).
PER_CLIENT = {"per_client", "global_per_client", "devices", "gpu_peak_mib"}


def available() -> bool:
    """Whether the tensorboard package can be imported here."""
    return importlib.util.find_spec("tensorboard") is not None


def require() -> None:
    """Raise ConfigError with what to do when ``tensorboard = true`` cannot be honoured."""
    if not available():
        raise ConfigError(MISSING)


def round_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """{tag: value} of one round record: every number in it, tables flattened to
    ``tag/key``, except ``round`` (the step), flags, lists, missing values (None: a round
    without evaluation) and per-client tables."""
    out: dict[str, float] = {}

    def walk(tag: str, value: Any) -> None:
        if isinstance(value, bool) or value is None:
            return
        if isinstance(value, (int, float)):
            if math.isfinite(value):
                out[tag] = float(value)
        elif isinstance(value, Mapping):
            for key, inner in value.items():
                if key not in PER_CLIENT:
                    walk(f"{tag}/{key}", inner)

    for key, value in record.items():
        if key != "round" and key not in PER_CLIENT:
            walk(TAGS.get(key, key), value)
    return out


def open_command(run_dirs: Sequence[Path], labels: Sequence[str],
                 program: str = "tensorboard") -> str | None:
    """The command that opens the event files of those of ``run_dirs`` that have any, each
    under its label (None when none has): what ``fedapp compare`` prints beside its plot."""
    spec = [f"{label}:{Path(run_dir).resolve() / SUBDIR}"
            for run_dir, label in zip(run_dirs, labels)
            if any((Path(run_dir) / SUBDIR).glob("events.out.tfevents.*"))]
    return f"{program} --logdir_spec {','.join(spec)}" if spec else None


class TensorBoardWriter:
    """Event files under ``run_dir/tensorboard``, one scalar per number of each record."""

    def __init__(self, run_dir: Path, resume_after: int = 0) -> None:
        require()
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run records its rounds after ``resume_after`` again: purge_step makes
        # TensorBoard drop what the killed run had written from that step on.
        self.writer = SummaryWriter(str(run_dir / SUBDIR),
                                    purge_step=resume_after + 1 if resume_after else None)

    def round(self, record: Mapping[str, Any]) -> None:
        step = int(record["round"])
        for tag, value in round_scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a crashed run keeps its curves, as it keeps rounds.jsonl

    def update(self, update: Mapping[str, Any]) -> None:
        """One update of the asynchronous loops (an ``updates.jsonl`` line)."""
        if update.get("update") is not None and update.get("staleness") is not None:
            self.writer.add_scalar("updates/staleness", float(update["staleness"]),
                                   int(update["update"]))

    def close(self) -> None:
        self.writer.close()
