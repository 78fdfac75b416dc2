"""``fedapp compare``: several finished runs in one plot and one table, and what their training
has in common.

Each method trains with its authors' recipe (docs/recipes.md): two runs of different methods
are, unless a preset pinned one recipe, runs of different optimizers, learning rates and local
steps, and a difference in accuracy mixes what the method does with what its recipe does. So
the command names every training setting that differs between the runs (each run's
``config.json`` holds every effective setting) and says when the comparison is across recipes;
where a Standalone run trained with a method's own recipe is among the runs, it reads the
method against that run, and where none is, it says how to make one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedapp.cli.flower import BIN
from fedapp.config import RECIPE_KEYS, toml_value, training_settings

# Settings that name a run, say where it ran or what it wrote beside its results: never a
# difference worth reporting between two runs. (``method`` is the table's own column.)
NOT_COMPARED = frozenset({"method", "run-name", "output-dir", "explicit-settings", "resume",
                          "client-num-cpus", "client-num-gpus", "tensorboard",
                          "checkpoint-every", "wait-for-clients-seconds"})
NOT_READ = "—"  # a training setting the run's optimizer or schedule does not read


def compare_table(summaries: Sequence[dict], labels: Sequence[str]) -> str:
    """One markdown table row per run."""
    from fedapp.runtime.results import format_accuracy, human_bytes
    rows = ["| run | method | dataset | clients | rounds | accuracy (mean ± std) | "
            "global accuracy | up / client / round | down / client / round | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for s, label in zip(summaries, labels):
        acc, com = s["accuracy"], s["communication"]
        glob = f"{acc['global_mean']:.4f}" if acc.get("global_mean") is not None else "-"
        rows.append(f"| {label} | {s['method']} | {s['dataset']} | {s['num_clients']} | "
                    f"{s['rounds']} | {format_accuracy(acc['mean'], acc['std'])} | {glob} | "
                    f"{human_bytes(com['per_client_per_round_up'])} | "
                    f"{human_bytes(com['per_client_per_round_down'])} | "
                    f"{s['wall_seconds']:.0f} |")
    return "\n".join(rows)


def run_settings(run_dir: Path) -> dict[str, Any] | None:
    """Every effective setting of the run in ``run_dir`` (its ``config.json``); None if the
    run has none to read."""
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    saved = saved.get("settings", saved) if isinstance(saved, dict) else {}
    # Older runs wrote the flat settings alone; a run made by hand may hold no training at all.
    return saved if any(k in saved for k in RECIPE_KEYS) else None


def shown(training: Mapping[str, Any], key: str) -> str:
    return toml_value(training[key]) if key in training else NOT_READ


def differing(values: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> list[str]:
    """The ``keys`` whose value (as shown, ``—`` where absent) is not the same in every one of
    ``values``."""
    return [k for k in keys if len({shown(v, k) for v in values}) > 1]


def other_differences(settings: Sequence[Mapping[str, Any]]) -> list[str]:
    """The settings other than training that differ between runs: the shared ones, and a
    method's own (``<method>.<key>``) where every run has it (runs of one method)."""
    keys = [k for k in dict.fromkeys(k for s in settings for k in s)
            if k not in NOT_COMPARED and k not in RECIPE_KEYS
            and ("." not in k or all(k in s for s in settings))]
    return differing(settings, keys)


def recipe_report(settings: Sequence[Mapping[str, Any] | None], labels: Sequence[str],
                  accuracies: Sequence[float | None], methods: Sequence[str]) -> list[str]:
    """Lines on the runs' training: which training settings differ (a table, run against
    run), then each method's run against a Standalone run with the same training, where one is
    among them. ``settings``: each run's effective settings (None: not known)."""
    lines = []
    unknown = [label for label, s in zip(labels, settings) if s is None]
    if unknown:
        lines.append("No config.json in " + ", ".join(unknown) + ": how those runs trained is "
                     "not known, so whether they share a recipe is not checked.")
    known = [(label, s, acc, m) for label, s, acc, m in zip(labels, settings, accuracies,
                                                            methods) if s is not None]
    if len(known) < 2:
        return lines
    training = [training_settings(s) for _, s, _, _ in known]
    keys = differing(training, RECIPE_KEYS)
    if not keys:
        lines.append("Every run trains with the same recipe: " + ", ".join(
            f"{k} = {shown(training[0], k)}" for k in training[0]) + ".")
    else:
        lines += [f"These runs train with different recipes (docs/recipes.md): a difference in "
                  f"accuracy between them mixes what each method does with what its training "
                  f"does. The {len(keys)} training setting(s) that differ (from each run's "
                  f"config.json; {NOT_READ}: not read by that run's optimizer or schedule):",
                  "", "| setting | " + " | ".join(label for label, _, _, _ in known) + " |",
                  "|---|" + "---|" * len(known)]
        lines += [f"| {k} | " + " | ".join(shown(t, k) for t in training) + " |" for k in keys]
    others = other_differences([s for _, s, _, _ in known])
    if others:
        lines.append(("" if not keys else "\n") + "Other settings that differ: " + "; ".join(
            f"{k} ({' / '.join(shown(s, k) for _, s, _, _ in known)})" for k in others) + ".")
    lines += standalone_reading(known, training)
    return lines


def standalone_reading(known: Sequence[tuple[str, Mapping[str, Any], float | None, str]],
                       training: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each method's run against the Standalone run (of those compared) that trains as it
    does, preferring the one whose other settings differ least (the same data, federation and
    seed); where there is none but another Standalone, the settings that would make one."""
    alone = [i for i, (_, _, _, m) in enumerate(known) if m == "standalone"]
    lines = []
    for i, (label, settings, acc, method) in enumerate(known):
        if method == "standalone":
            continue
        same = [j for j in alone if training[j] == training[i]]
        if same:
            j = min(same, key=lambda j: len(other_differences([settings, known[j][1]])))
            base_label, base_settings, base_acc, _ = known[j]
            also = other_differences([settings, base_settings])
            diff = ("n/a" if acc is None or base_acc is None
                    else f"{acc:.4f} − {base_acc:.4f} = {acc - base_acc:+.4f}")
            lines.append(f"- {label} against Standalone at its own recipe ({base_label}): "
                         f"{diff}" + (f" (the two runs also differ in {', '.join(also)})"
                                      if also else ""))
        elif alone:
            j = alone[0]
            flags = " ".join(f"--set {k}={toml_value(v)}" for k, v in training[i].items()
                             if known[j][1].get(k) != v)
            lines.append(f"- {label}: no Standalone run at its recipe among these, so its "
                         f"difference to {known[j][0]} is partly its recipe's; the same run as "
                         f"{known[j][0]} with {flags} is one.")
    if lines:
        lines.insert(0, "\nEach method against Standalone trained the same way (mean client "
                        "accuracy, method − Standalone):")
    return lines


def cmd_compare(args: argparse.Namespace) -> int:
    from fedapp.runtime.results import plot_runs
    summaries, labels, settings = [], [], []
    for run_dir in args.runs:
        path = Path(run_dir) / "summary.json"
        if not path.is_file():
            print(f"fedapp: {path} not found (did that run complete?)", file=sys.stderr)
            return 2
        summaries.append(json.loads(path.read_text()))
        labels.append(Path(run_dir).resolve().name)
        settings.append(run_settings(Path(run_dir)))
    out = Path(args.output)
    plot_runs(summaries, out, labels)
    print(compare_table(summaries, labels))
    report = recipe_report(settings, labels, [s["accuracy"]["mean"] for s in summaries],
                           [s["method"] for s in summaries])
    if report:
        print("\n" + "\n".join(report))
    print(f"\nplot: {out.resolve()}")
    # The other way to look at runs: every per-round number, interactively.
    from fedapp.runtime.tensorboard import open_command
    command = open_command(args.runs, labels, program=str(BIN / "tensorboard"))
    if command:
        print(f"TensorBoard (every per-round number): {command}")
    else:
        print("TensorBoard: none of these runs wrote event files; run with --set "
              "tensorboard=true to have them (docs/usage.md, 'Looking at runs')")
    return 0
