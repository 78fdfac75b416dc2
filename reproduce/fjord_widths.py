"""FjORD's global model at each width on its page's setting, read two ways and trained for two
lengths: why its full width scores below the narrower ones after 20 rounds (docs/fjord.md).

The paper has the global model's accuracy rise with the width p; the page's runs have p = 1
lowest. Three candidate causes, each changed alone:

- **the full width's BatchNorm statistics.** Width p's running statistics are averaged over the
  clients of tier p_max >= p, who update them (momentum 0.1) only on the batches that draw p: at
  p = 1 two clients of ten, a fifth of their batches. Each run's final global model is read at
  every width with its statistics as trained (the paper's reading, the run's
  ``server_accuracy``) and with every width's statistics recomputed in one pass over the union
  of the clients' training data, the weights untouched;
- **the outer ring's training.** The channels between p = 0.8 and 1 are trained only on those
  same batches (about 80 steps in 20 rounds): the same runs at 60 rounds, three times as many;
- **too little data for width to pay.** On 300 images a client, a narrow model may learn all
  a wide one can: the same runs with 1,200 training images a client (20 rounds; four times the
  steps of every width, the outer ring's included).

And one change of the method, which Flower's baseline plots beside its default: **self-
distillation** (``fjord.kd``), with which a top-tier client trains its full width with
cross-entropy on every batch and its sampled width against that output (20 rounds).

Each run is the page's FjORD run (``reproduce/submodels_fmnist.py``'s settings: 10 clients of
at most 300 Fashion-MNIST samples, every client every round) with a checkpoint after its last
round, from which the global model is read. The 20-round runs are the page's runs again: the
table says whether they reproduce its width accuracies exactly.

    .venv/bin/python reproduce/fjord_widths.py                 # IID, the three runs, 3 seeds
    .venv/bin/python reproduce/fjord_widths.py --splits IID "Dirichlet 0.3"
    .venv/bin/python reproduce/fjord_widths.py --table-only    # runs nothing
    .venv/bin/python reproduce/fjord_widths.py --quick         # a pipeline check

Finished runs are reused (results/fjord-widths/, else their records; the recomputed readings
are kept beside the records, in reproduce/records/fjord-widths/statistics/). Writes its table
between its markers in docs/fjord.md (``--quick``: into the output folder only).
"""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any, Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import (ROOT, VERDICT_RULE, add_page_options, cell, claim_line,  # noqa: E402
                    finished, provenance, quick_folder, record_path, resource_overrides,
                    run_experiment, run_parallel, seeds_option, slug, write_generated)
from submodels_fmnist import BASE, QUICK, SPLITS  # noqa: E402

SCRIPT = "reproduce/fjord_widths.py"
# (rounds, training samples per client, self-distillation): the page's run, three times its
# rounds, four times its data, with fjord.kd. QUICK_VARIANTS: the same shapes for a pipeline
# check.
_N, _Q = BASE["max-samples-per-client"], QUICK["max-samples-per-client"]
VARIANTS = ((20, _N, False), (60, _N, False), (20, 4 * _N, False), (20, _N, True))
QUICK_VARIANTS = ((2, _Q, False), (4, _Q, False), (2, 2 * _Q, False), (2, _Q, True))
# The page's FjORD runs, whose width accuracies the 20-round runs here must reproduce.
PAGE_RUNS = ROOT / "results" / "reproduce-submodels"


def settings_of(split: Mapping[str, Any], rounds: int, samples: int,
                kd: bool = False) -> dict[str, Any]:
    """The page's FjORD run at ``rounds`` rounds and at most ``samples`` training samples a
    client (``kd``: with self-distillation), with a checkpoint after its last round."""
    return {**BASE, **split, "method": "fjord", "num-server-rounds": rounds,
            "max-samples-per-client": samples, "checkpoint-every": rounds,
            **({"fjord.kd": True} if kd else {})}


def variant_label(rounds: int, samples: int, kd: bool, base_samples: int) -> str:
    """A variant's name in the table: its rounds, its samples where not the page's, and
    self-distillation where on."""
    return (f"{rounds} rounds" + ("" if samples == base_samples else
                                  f", {samples:,} samples a client")
            + (", self-distillation" if kd else ""))


def width_accuracies(model: Any, widths: Sequence[Fraction], test: tuple[Any, Any],
                     train_x: Any = None) -> dict[str, float]:
    """{``width-<p>``: accuracy on ``test``} of ``model`` (FjORD's global model, PerWidthBN) at
    each width: with its BatchNorm statistics as they are, or, given ``train_x``, with width
    p's statistics first recomputed as the mean and variance of each BatchNorm's input over
    all of ``train_x`` in one pass (each layer's from the layers below it already recomputed:
    one batch, evaluation mode, the statistics written just before each layer uses them)."""
    import torch
    from client_models.width import PerWidthBN, set_width
    from fedapp.runtime.training import evaluate
    norms = [m for m in model.modules() if isinstance(m, PerWidthBN)]
    model.eval()
    out = {}
    for p in widths:
        set_width(model, p if p < 1 else None)
        if train_x is not None:
            def recompute(module: PerWidthBN, args: tuple) -> None:
                i = next(i for i, q in module.widths.items() if q == p)
                x = args[0]
                getattr(module, f"running_mean_{i}").copy_(x.mean((0, 2, 3)))
                getattr(module, f"running_var_{i}").copy_(x.var((0, 2, 3)))
            hooks = [m.register_forward_pre_hook(recompute) for m in norms]
            try:
                with torch.no_grad():
                    model(train_x)
            finally:
                for hook in hooks:
                    hook.remove()
        with torch.no_grad():  # the project's evaluation, in the server's batches
            out[f"width-{float(p):g}"] = evaluate(model, *test)[1]
    set_width(model, None)
    return out


def read_widths(run_dir: Path, settings: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """The final global model of the run in ``run_dir`` (its checkpoint) at every width, its
    statistics as trained and recomputed on every client's training data."""
    import torch
    from fedapp.data import setup
    from fedapp.data.partitions import load_client_data
    from fedapp.runtime.checkpoint import load_server
    from fedapp.runtime.client_base import load_arrays
    cfg = common.run_config(settings)
    _, state = load_server(run_dir / "checkpoint")
    data = setup.dataset(cfg)
    spec = setup.partition_spec(cfg)
    train_x = torch.cat([load_client_data(data, spec, pid).train_x
                         for pid in range(cfg.num_clients)])
    model = cfg.settings.width_model(cfg, Fraction(1), tuple(data.train_x.shape[1:]),
                                     data.num_classes)
    load_arrays(model, state["global_model"])
    widths, test = cfg.settings.width_set(), setup.global_test(cfg)
    as_trained = width_accuracies(model, widths, test)
    return {"as-trained": as_trained,
            "recomputed": width_accuracies(model, widths, test, train_x)}


def statistics_path(out: Path, name: str) -> Path:
    """Where a run's two readings are kept: beside its record, in a folder of their own (the
    records folder holds run records only)."""
    path = record_path(out, name)
    return path.parent / "statistics" / path.name


def readings(out: Path, name: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The run's two readings: kept ones if any, else read from its checkpoint (and kept,
    unless ``out`` is a pipeline check's)."""
    kept = statistics_path(out, name)
    if kept.exists():
        return json.loads(kept.read_text())
    run_dir = out / name
    if not (run_dir / "checkpoint").is_dir():
        raise RuntimeError(f"{name}: no checkpoint in {run_dir} and no kept readings in "
                           f"{kept}: delete the run's folder and record to make it anew")
    result = {**read_widths(run_dir, settings), "provenance": provenance(made_here=True)}
    if out.name != common.QUICK:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps(result, indent=1) + "\n")
    return result


def check_reading(name: str, summary: Mapping[str, Any], read: Mapping[str, Any]) -> None:
    """The reading "as trained" is the run's own ``server_accuracy`` of its last round (up to
    an image whose logits tie within float error across batch sizes): else this script does not
    read the model the run evaluated."""
    server = summary["accuracy"]["server"]
    off = {w: (a, server.get(w)) for w, a in read["as-trained"].items()
           if server.get(w) is None or abs(a - server[w]) > 0.002}
    if off:
        raise RuntimeError(f"{name}: the checkpoint's global model read at each width gives "
                           f"{off} (reading, the run's server_accuracy): not the run's model")


def same_as_page(summaries: Sequence[Mapping[str, Any]], split: str,
                 seeds: Sequence[int]) -> str:
    """Whether the 20-round runs' width accuracies are the page's runs' to the last digit."""
    page = [finished(PAGE_RUNS, f"fjord-{slug(split.split()[0])}-fjord-seed{s}") for s in seeds]
    if any(p is None for p in page):
        return "The page's runs of these seeds are not here to compare with."
    theirs = [json.loads(p.read_text())["accuracy"]["server"] for p in page]
    mine = [s["accuracy"]["server"] for s in summaries]
    return ("The 20-round runs reproduce the page's width accuracies exactly at every seed."
            if mine == theirs else
            "The 20-round runs do **not** reproduce the page's width accuracies: " + "; ".join(
                f"seed {s}: {m} against {t}" for s, m, t in zip(seeds, mine, theirs) if m != t))


def table(split: str, by_variant: Mapping[str, list[dict[str, Any]]],
          seeds: Sequence[int]) -> str:
    """The widths' accuracies of each variant (``by_variant``: its label -> its runs' readings)
    with the claims p = 1 ≥ the next width and recomputed ≥ as trained."""
    widths = list(next(iter(by_variant.values()))[0]["as-trained"])
    lines = [f"### FjORD's global model by width, {split} ({len(seeds)} seed"
             f"{'s' if len(seeds) > 1 else ''}: "
             f"{', '.join(map(str, seeds))}; accuracy on the global test set)", "",
             "| run | BatchNorm statistics | " + " | ".join(
                 f"p = {w.removeprefix('width-')}" for w in widths) + " |",
             "|---|---|" + "---|" * len(widths)]
    for variant, runs in by_variant.items():
        for reading, label in (("as-trained", "as trained (the paper's)"),
                               ("recomputed", "recomputed on all clients' data")):
            lines.append(f"| {variant} | {label} | " + " | ".join(
                cell((r[reading][w] for r in runs), 3) for w in widths) + " |")
    lines.append("")
    top, below = widths[-1], widths[-2]
    for variant, runs in by_variant.items():
        for reading in ("as-trained", "recomputed"):
            lines.append("- " + claim_line(
                f"{variant}, statistics {reading.replace('-', ' ')}: p = 1",
                f"p = {below.removeprefix('width-')}", runs, runs,
                lambda r, k=reading: r[k][top], lambda r, k=reading: r[k][below]))
    for variant, runs in by_variant.items():
        lines.append("- " + claim_line(
            f"{variant}, p = 1: statistics recomputed", "as trained", runs, runs,
            lambda r: r["recomputed"][top], lambda r: r["as-trained"][top]))
    # Self-distillation against the same run without it (same seeds, same partitions).
    for variant, runs in by_variant.items():
        base = variant.removesuffix(", self-distillation")
        if base != variant and base in by_variant:
            for reading in ("as-trained", "recomputed"):
                lines.append("- " + claim_line(
                    f"{variant}, p = 1, statistics {reading.replace('-', ' ')}",
                    f"{base} without it", runs, by_variant[base],
                    lambda r, k=reading: r[k][top], lambda r, k=reading: r[k][top]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--splits", nargs="+", choices=[s for s, _ in SPLITS],
                        default=["IID"])
    add_page_options(parser, ROOT / "results" / "fjord-widths")
    args = parser.parse_args()

    resources, seeds, out = resource_overrides(args), args.seeds, args.out.resolve()
    extra, doc, variants = {}, ROOT / "docs" / "fjord.md", VARIANTS
    if args.quick:
        seeds, out = seeds[:1], quick_folder(out)
        extra = {k: v for k, v in QUICK.items()
                 if k not in ("num-server-rounds", "max-samples-per-client")}
        doc, variants = out / "fjord.md", QUICK_VARIANTS
    base_samples = variants[0][1]
    splits = [(name, s) for name, s in SPLITS if name in args.splits]

    def experiments(split: str, split_settings: dict, rounds: int, samples: int, kd: bool):
        more = ("" if samples == base_samples else f"-{samples}-samples") + ("-kd" if kd else "")
        return [(None, {**settings_of(split_settings, rounds, samples, kd), **extra,
                        "seed": seed, **resources},
                 f"{slug(split.split()[0])}-{rounds}-rounds{more}-seed{seed}")
                for seed in seeds]

    plan = [(split, s, *v) for split, s in splits for v in variants]
    if not args.table_only:
        run_parallel([e for p in plan for e in experiments(*p)], out, args.jobs)

    tables, missing = [], []
    for split, split_settings in splits:
        by_variant, page_runs = {}, None
        for rounds, samples, kd in variants:
            label = variant_label(rounds, samples, kd, base_samples)
            todo = experiments(split, split_settings, rounds, samples, kd)
            if args.table_only and any(
                    finished(out, n) is None or not (statistics_path(out, n).exists()
                                                      or (out / n / "checkpoint").is_dir())
                    for _, _, n in todo):
                missing.append(f"{label} under {split}")
                continue
            summaries = [run_experiment(*e, out) for e in todo]
            by_variant[label] = [readings(out, n, settings) for _, settings, n in todo]
            for (_, _, name), run, read in zip(todo, summaries, by_variant[label]):
                check_reading(name, run, read)
            if (rounds, samples, kd) == VARIANTS[0]:
                page_runs = summaries
        if not by_variant:
            continue
        tables.append(table(split, by_variant, seeds))
        if not args.quick and page_runs is not None:
            tables.append(same_as_page(page_runs, split, seeds))
    command = f".venv/bin/python {SCRIPT}" + (" --quick" if args.quick else "") + (
        seeds_option(args.seeds)) + ("" if args.splits == ["IID"] else " --splits " + " ".join(
            f'"{s}"' if " " in s else s for s in args.splits))
    write_generated(doc, SCRIPT, "\n\n".join([
        f"Produced by `{command}`.", VERDICT_RULE, *tables,
        *([f"Not run yet at every seed, so not in the tables: {', '.join(missing)}."]
          if missing else [])]))
    print(f"[reproduce] wrote {doc}")


if __name__ == "__main__":
    main()
