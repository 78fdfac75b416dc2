"""Everything a run writes: one folder per run under the absolute ``output-dir``.

``config.json`` (every effective setting, ``settings``, and the layer it came from, ``layers``:
default, the method's recipe, a preset, --set), ``partition.json`` (per-client class counts),
``rounds.jsonl`` (one line per round, appended as the run goes, so a crashed run keeps its
history), ``summary.json`` and ``accuracy.png`` (or, for a run that stopped, ``failed.json``:
why); the asynchronous loop adds ``updates.jsonl`` (one line per client update) and
``timeline.png``. With ``tensorboard = true`` the same records also go to TensorBoard event
files in ``tensorboard/`` (``fedapp.runtime.tensorboard``).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

PROGRESS_TAG = "[fedapp]"
FAILURE_FILE = "failed.json"  # why a run stopped, written by the ServerApp


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), float(arr.std())


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_accuracy(mean: float | None, std: float | None) -> str:
    """'0.7475 ± 0.0738', or 'n/a' when no client was evaluated."""
    return "n/a" if mean is None else f"{mean:.4f} ± {std:.4f}"


def bytes_per_client_per_round(rounds: Sequence[dict[str, Any]], key: str) -> float:
    """The mean over the round records ``rounds`` (those with uploads) of that round's
    ``key`` bytes (``bytes_up``, ``framing_down``, ...) over the clients they came from, or
    went to for a ``*_down`` key: a client that crashed was sent its payload but uploaded
    nothing, and a rejected upload still crossed the wire. 0 without rounds."""
    def clients(h: dict[str, Any]) -> int:
        if key.endswith("_down"):
            return h.get("clients_sampled", h["clients_fit"])
        return h["clients_fit"] + h.get("rejected", 0)
    vals = [h[key] / clients(h) for h in rounds]
    return float(np.mean(vals)) if vals else 0.0


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as pretty JSON atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    # allow_nan=False: NaN is not JSON; metrics are checked before they get here, so a
    # non-finite value is a bug to report, not a file to write that no JSON reader accepts.
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=_json_default,
                              allow_nan=False) + "\n")
    tmp.replace(path)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj)}")


class Recorder:
    """Collects per-round records and writes the run folder."""

    def __init__(self, run_dir: Path, *, method: str, dataset: str, num_clients: int,
                 num_rounds: int, config: dict[str, Any], partition: dict[str, Any],
                 resume_after: int = 0, tensorboard: bool = False) -> None:
        """A new run folder, or with ``resume_after`` = k the folder of a run resumed after
        round k: its first k records are kept (a killed run may have written more).
        ``tensorboard``: every record also becomes TensorBoard scalars."""
        self.run_dir = run_dir
        self.meta = {"method": method, "dataset": dataset, "num_clients": num_clients,
                     "rounds": num_rounds}
        self.num_rounds = num_rounds
        self.started = time.time()
        run_dir.mkdir(parents=True, exist_ok=True)
        rounds = run_dir / "rounds.jsonl"
        kept = rounds.read_text().splitlines()[:resume_after] if resume_after else []
        if len(kept) < resume_after:
            raise FileNotFoundError(f"{rounds} holds {len(kept)} rounds; the checkpoint was "
                                    f"taken after round {resume_after}")
        self.history: list[dict[str, Any]] = [json.loads(line) for line in kept]
        rounds.write_text("".join(line + "\n" for line in kept))
        (run_dir / FAILURE_FILE).unlink(missing_ok=True)  # a resumed run's earlier failure
        write_json(run_dir / "config.json", config)
        write_json(run_dir / "partition.json", partition)
        self.tensorboard = None
        if tensorboard:
            from fedapp.runtime.tensorboard import TensorBoardWriter
            self.tensorboard = TensorBoardWriter(run_dir, resume_after)

    def record_round(self, record: dict[str, Any]) -> str:
        """Append one round's record; return the progress line for it."""
        self.history.append(record)
        with open(self.run_dir / "rounds.jsonl", "a") as fh:
            fh.write(json.dumps(record, default=_json_default, allow_nan=False) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.round(record)
        # The first round carries the start-up (Ray actors, imports): estimate from the rest.
        recent = [h["seconds"] for h in self.history[1:][-5:]] or [record["seconds"]]
        eta = float(np.mean(recent)) * (self.num_rounds - record["round"])
        if record.get("evaluated", True):
            accuracy = format_accuracy(record["accuracy_mean"], record["accuracy_std"])
        else:
            accuracy = "not evaluated"
        loss = record.get("train_loss")
        return (f"{PROGRESS_TAG} round {record['round']}/{self.num_rounds} | accuracy "
                f"{accuracy} | train loss {'n/a' if loss is None else f'{loss:.4f}'}"
                f"{format_server_accuracy(record.get('server_accuracy', {}))} | "
                f"clients {record['clients_fit']}/{record.get('clients_sampled', '?')} | up "
                f"{human_bytes(record['bytes_up'])} down {human_bytes(record['bytes_down'])} | "
                f"{record['seconds']:.1f} s | ETA {eta:.0f} s")

    def record_failure(self, kind: str, reason: str) -> None:
        """Write why the run stopped (``failed.json``: ``kind``, ``reason``), for ``fedapp``
        to say so in its message and exit status."""
        write_json(self.run_dir / FAILURE_FILE, {"kind": kind, "reason": reason})

    def record_update(self, update: dict[str, Any]) -> None:
        """Append one client update of the asynchronous loop to ``updates.jsonl``."""
        with open(self.run_dir / "updates.jsonl", "a") as fh:
            fh.write(json.dumps(update, default=_json_default, allow_nan=False) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.update(update)

    def summary(self) -> dict[str, Any]:
        """The run's summary (docs/usage.md, 'Results')."""
        # The accuracy of the last evaluated round (the last round always is, unless the run
        # stopped early); records without an "evaluated" list predate eval-every.
        evaluated = [h for h in self.history if h.get("evaluated", True)]
        last = evaluated[-1] if evaluated else {}
        per_client = last.get("per_client", {})
        # None (JSON null), not NaN, when no client could be evaluated in the last round.
        acc_mean, acc_std = _mean_std(list(per_client.values())) if per_client else (None, None)
        rounds_with_fit = [h for h in self.history if h["clients_fit"] > 0]

        def per_client_per_round(key: str, rounds: Sequence[dict] = rounds_with_fit) -> float:
            return bytes_per_client_per_round(rounds, key)
        last_fit = rounds_with_fit[-1:]  # steady state of methods that send nothing in round 1

        accuracy = {"mean": acc_mean, "std": acc_std, "per_client": per_client,
                    "per_architecture": last.get("per_architecture", {})}
        if "global_accuracy_mean" in last:
            accuracy["global_mean"] = last["global_accuracy_mean"]
            accuracy["global_std"] = last["global_accuracy_std"]
            accuracy["global_per_client"] = last.get("global_per_client", {})
        if "variants" in last:
            accuracy["variants"] = last["variants"]
        # The server's own models (a method's server_predict) as of the last round they were
        # scored in: the clients' last evaluated round, unless no client could be evaluated.
        server = next((h["server_accuracy"] for h in reversed(self.history)
                       if "server_accuracy" in h), None)
        if server is not None:
            accuracy["server"] = server
        malicious = next((h["malicious_clients"] for h in reversed(self.history)
                          if "malicious_clients" in h), None)
        if malicious is not None:
            # What robustness papers report: the honest clients' mean, beside everyone's.
            honest = [v for k, v in per_client.items() if int(k) not in malicious]
            accuracy["honest_mean"], accuracy["honest_std"] = (
                _mean_std(honest) if honest else (None, None))
        # Client-level differential privacy: what the run spent, as of its last round.
        privacy = next((h["privacy"] for h in reversed(self.history) if "privacy" in h), None)
        communication = {
            "bytes_up": int(sum(h["bytes_up"] for h in self.history)),
            "bytes_down": int(sum(h["bytes_down"] for h in self.history)),
            "per_client_per_round_up": per_client_per_round("bytes_up"),
            "per_client_per_round_down": per_client_per_round("bytes_down"),
            "floats_per_client_per_round_up": per_client_per_round("bytes_up") / 4,
            "floats_per_client_per_round_down": per_client_per_round("bytes_down") / 4,
            "framing_bytes_up": int(sum(h["framing_up"] for h in self.history)),
            "framing_bytes_down": int(sum(h["framing_down"] for h in self.history)),
            "framing_per_client_per_round_up": per_client_per_round("framing_up"),
            "framing_per_client_per_round_down": per_client_per_round("framing_down"),
            "last_round_floats_per_client_up": per_client_per_round("bytes_up", last_fit) / 4,
            "last_round_floats_per_client_down": per_client_per_round("bytes_down", last_fit) / 4,
            "evaluation_bytes_down": int(sum(h["eval_bytes_down"] for h in self.history)),
            "note": "bytes_* count the arrays' data (float32 = 4 bytes, as the papers count); "
                    "framing_* is the encoding around it (npy headers, array names); "
                    "evaluation traffic is reported apart from training traffic.",
        }
        return {**self.meta, "evaluated_rounds": [h["round"] for h in evaluated],
                "accuracy": accuracy, "communication": communication,
                "failures": int(sum(h["failures"] for h in self.history)),
                "rejected": int(sum(h["rejected"] for h in self.history)),
                # Who: {partition id: rounds in which it failed / had its upload refused}.
                "failed_clients": _tally(h.get("failed_clients", []) for h in self.history),
                "rejected_clients": _tally(h.get("rejected_clients", []) for h in self.history),
                # Rounds without a usable update (the method's state stayed as it was).
                "empty_rounds": [h["round"] for h in self.history if h.get("empty_round")],
                **({"malicious_clients": malicious} if malicious is not None else {}),
                **({"privacy": privacy} if privacy is not None else {}),
                # What the run takes if clients are as fast as fedapp.runtime.speeds says.
                "virtual_seconds": float(sum(h.get("virtual_seconds", 0.0)
                                             for h in self.history)),
                "wall_seconds": time.time() - self.started,
                # When the ServerApp began recording (seconds since the epoch): what came before
                # it, the run's start-up, is told apart from its end (fedapp.cli.run).
                "started_at": self.started, "history": self.history}

    def finish(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write ``summary.json`` (with a loop's ``extra`` keys) and the plot; return it."""
        summary = {**self.summary(), **(extra or {})}
        write_json(self.run_dir / "summary.json", summary)
        plot_runs([summary], self.run_dir / "accuracy.png", [summary["method"]])
        if self.tensorboard is not None:
            self.tensorboard.close()
        return summary


def _tally(lists) -> dict[str, int]:
    counts: dict[int, int] = {}
    for ids in lists:
        for pid in ids:
            counts[pid] = counts.get(pid, 0) + 1
    return {str(pid): n for pid, n in sorted(counts.items())}


def plot_runs(summaries: Sequence[dict[str, Any]], path: Path, labels: Sequence[str]) -> None:
    """Mean accuracy ± std and cumulative bytes per round of one or more runs, in one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_bytes) = plt.subplots(1, 2, figsize=(11, 4))
    for summary, label in zip(summaries, labels):
        hist = [h for h in summary["history"] if h.get("evaluated", True)]
        rounds = [h["round"] for h in hist]
        mean = np.array([h["accuracy_mean"] for h in hist], dtype=float)  # None -> nan
        std = np.array([h["accuracy_std"] for h in hist], dtype=float)
        line, = ax_acc.plot(rounds, mean, marker="o", ms=3, label=label)
        ax_acc.fill_between(rounds, mean - std, mean + std, alpha=0.15, color=line.get_color())
        every = summary["history"]
        total = np.cumsum([h["bytes_up"] + h["bytes_down"] for h in every])
        ax_bytes.plot([h["round"] for h in every], total / 2**20, marker="o", ms=3, label=label,
                      color=line.get_color())
    ax_acc.set(xlabel="round", ylabel="local test accuracy (mean ± std over clients)")
    ax_bytes.set(xlabel="round", ylabel="cumulative MiB (up + down)")
    for ax in (ax_acc, ax_bytes):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def round_record(server_round: int, evals: Sequence[dict[str, Any]], traffic: dict[str, int],
                 counts: dict[str, int], seconds: float, client_seconds: float = 0.0,
                 server_accuracy: dict[str, float] | None = None) -> dict[str, Any]:
    """One ``rounds.jsonl`` line from the clients' evaluation metrics and the round's traffic;
    ``server_accuracy`` ({name: accuracy} of the models the server holds, on the global test
    set) only where the method has any: other records stay as they were."""
    per_client = {str(e["partition-id"]): float(e["accuracy"]) for e in evals}
    by_arch: dict[str, list[float]] = {}
    for e in evals:
        by_arch.setdefault(str(e["arch"]), []).append(float(e["accuracy"]))
    mean, std = _mean_std(list(per_client.values()))
    record: dict[str, Any] = {
        "round": server_round, "accuracy_mean": mean, "accuracy_std": std,
        "per_client": dict(sorted(per_client.items(), key=lambda kv: int(kv[0]))),
        "per_architecture": {a: float(np.mean(v)) for a, v in sorted(by_arch.items())},
        **traffic, **counts, "seconds": seconds, "client_seconds": client_seconds}
    globals_ = {str(e["partition-id"]): float(e["global-accuracy"])
                for e in evals if "global-accuracy" in e}
    if globals_:
        g_mean, g_std = _mean_std(list(globals_.values()))
        record.update(global_accuracy_mean=g_mean, global_accuracy_std=g_std,
                      global_per_client=globals_)
    # Other ways a method can predict (``accuracy-<name>`` metrics, e.g. FedGH's global
    # header installed): the same statistics, under "variants".
    variants: dict[str, dict[str, float]] = {}
    for e in evals:
        for key, value in e.items():
            if key.startswith("accuracy-") and isinstance(value, (int, float)):
                variants.setdefault(key[len("accuracy-"):], {})[str(e["partition-id"])] = \
                    float(value)
    if variants:
        record["variants"] = {}
        for name, values in sorted(variants.items()):
            v_mean, v_std = _mean_std(list(values.values()))
            record["variants"][name] = {"mean": v_mean, "std": v_std, "per_client": values}
    if server_accuracy:
        record["server_accuracy"] = {str(k): float(v) for k, v in server_accuracy.items()}
    if math.isnan(mean):
        record["accuracy_mean"] = record["accuracy_std"] = None
    return record


def format_server_accuracy(accuracy: dict[str, float]) -> str:
    """The progress line's part for the server's own models: ' | server 0.8123' for one,
    named when several, their mean beyond three (the record holds each)."""
    if not accuracy:
        return ""
    if len(accuracy) == 1:
        (name, value), = accuracy.items()
        return f" | server {value:.4f}" if name == "server" else f" | server {name} {value:.4f}"
    if len(accuracy) <= 3:
        return " | server " + ", ".join(f"{k} {v:.4f}" for k, v in accuracy.items())
    return f" | server mean {np.mean(list(accuracy.values())):.4f} of {len(accuracy)} models"


def plot_timeline(updates: Sequence[dict[str, Any]], evaluations: Sequence[float], path: Path,
                  title: str) -> None:
    """Clients x virtual time: one bar per update from its dispatch to its commit (grey:
    rejected, red: failed), dotted lines where evaluations were called."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients = sorted({u["client"] for u in updates})
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(clients) + 1.5))
    colours = {"ok": "tab:blue", "rejected": "tab:grey", "failed": "tab:red"}
    for u in updates:
        start, end = u["virtual_start"], u["virtual_end"]
        ax.barh(clients.index(u["client"]), end - start, left=start, height=0.6,
                color=colours[u["status"]], edgecolor="white", linewidth=0.5)
    for t in evaluations:
        ax.axvline(t, color="black", linestyle=":", linewidth=0.8)
    ax.set_yticks(range(len(clients)), [str(c) for c in clients])
    ax.set(xlabel="virtual time (1 = one update of a normal-speed client)", ylabel="client",
           title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
