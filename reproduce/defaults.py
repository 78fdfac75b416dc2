"""Every registered method with its own default recipe, on two small data sets, beside
Standalone: do the defaults lose in silence?

Each method runs with nothing set but the data and the federation (common.DEFAULTS_SETTINGS:
Fashion-MNIST, and scikit-learn's handwritten digits, on which nothing was tuned), so it trains
with its recipe (docs/recipes.md) and its own defaults — what ``--set method=...`` gives a
user. Standalone (local training: the global defaults, one optimizer for the whole run) sits
beside every method; FedAvg, which needs one architecture, runs on the smallest CNN, with a
Standalone of that CNN beside it. Three seeds, each method's seeds on one SuperLink. Writes
docs/defaults.md, and the evidence tables of the pages of the methods taken from HtFLlib
(``PAGES``: their rows beside Standalone, LG-FedAvg, FedProto and FedAvg).

    .venv/bin/pip install -e ".[reproduce]"      # scikit-learn, for the digits
    .venv/bin/python reproduce/defaults.py                      # every method, 3 seeds
    .venv/bin/python reproduce/defaults.py --methods fedgh fedhe --seeds 0
    .venv/bin/python reproduce/defaults.py --jobs 8 --client-num-gpus 0.25   # 8 runs at once

Finished runs are reused (results/defaults/), so an interrupted run resumes. With
``--methods``, the table's other rows are kept as the page has them (written by an earlier
invocation of this script), so one method can be added or re-run without re-running the rest;
the caption names the methods whose rows were taken from the page.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (DEFAULT_SEEDS, DEFAULTS_SETTINGS, ROOT, add_resource_options,  # noqa: E402
                    cell, mean_client_accuracy, mean_std, page_methods, read_generated,
                    resource_overrides, run_parallel, run_seeds, training_caption,
                    write_generated, seeds_option)

from fedapp.config import toml_value  # noqa: E402

SCRIPT = "reproduce/defaults.py"
OUT = ROOT / "results" / "defaults"
DOC = ROOT / "docs" / "defaults.md"
# FedAvg needs one architecture: the smallest CNN of the mix, the model FML, FedMRL and FedKD
# share beside each client's own (so its row is "the shared model alone").
ONE_ARCH = {"arch-mix": "cnn5"}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


LOSERS = "Below Standalone by more than the seed spread: "


def previous_table(doc: Path) -> tuple[dict[str, str], list[str]]:
    """The rows (label -> row) and the "below Standalone" entries of the table ``doc`` has."""
    text = read_generated(doc, SCRIPT)
    rows = {line.split("|")[1].strip(): line for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| method |")}
    losers = [line[len(LOSERS):].rstrip(".").split(", ") for line in text.splitlines()
              if line.startswith(LOSERS) and not line.endswith("none.")]
    return rows, losers[0] if losers else []


# The pages of the methods added from HtFLlib, each with its methods' rows beside the baselines
# every one of them is compared with (FedAvg: the shared model alone, for the shared-model pages).
BASELINES = ["standalone", "lg-fedavg", "fedproto", "fedavg"]
# Settings tried where a method's defaults lose to local training here, to tell the cause
# (docs/defaults.md explains each): method -> the changed settings of each try.
TRIED = {"fedre": [{"fedre.server-batch-size": 1}, {"batch-size": 10}]}
PAGES = {"docs/htfl-methods-1.md": ["fd", "fedre", "fedtgp"], "docs/fedgen.md": ["fedgen"],
         "docs/fedl2g.md": ["fedl2g"], "docs/shared-model-methods.md": ["fml", "fedmrl", "fedkd"]}


def main() -> None:
    METHODS = page_methods()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS),
                        default=[m for m in METHODS if m != "standalone"])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--out", type=Path, default=OUT)
    add_resource_options(parser)
    args = parser.parse_args()
    out, seeds, resources = args.out.resolve(), args.seeds, resource_overrides(args)

    every = [m for m in METHODS if m != "standalone"]
    data_sets = list(DEFAULTS_SETTINGS)
    header = ["| method | " + " | ".join(f"{d} | Δ {d}" for d in data_sets) + " | recipe |",
              "|---|" + "---|---|" * len(data_sets) + "---|"]
    rows: dict[str, str] = {}
    losers: list[str] = []
    old_rows, old_losers = previous_table(DOC)
    fresh: set[str] = set()  # the keys of the rows computed by this invocation

    def asked(method: str, owners: tuple[str, ...] = ()) -> bool:
        """Whether a row is run: its owners (default: ``method``; none: always) are asked for."""
        owners = owners or ((method,) if method != "standalone" else ())
        return not owners or bool(set(owners) & set(args.methods))

    def experiments(method: str, changed: dict, name: str,
                    base: dict | None = None) -> list[tuple[None, dict, str]]:
        """A row's runs, and its Standalone's, on every data set at every seed."""
        return [(None, {**DEFAULTS_SETTINGS[d](), "method": m, **c, "seed": seed, **resources},
                 f"{slug(d)}-{n}-seed{seed}")
                for m, c, n in [(method, changed, name)] + (
                    [] if base is None else
                    [("standalone", base, "standalone" + ("-one-arch" if base else ""))])
                for d in data_sets for seed in seeds]

    def row(key: str, label: str, method: str, changed: dict, name: str,
            base: dict | None = None, owners: tuple[str, ...] = ()) -> None:
        """Three seeds of ``method`` with ``changed`` on each data set, beside Standalone
        with ``base`` (None: this is a baseline row, no Δ). The row belongs to ``owners``
        (default: ``method``; none: always run); when none of them is asked for, the page's
        row is kept."""
        if not asked(method, owners):
            if label in old_rows:
                rows[key] = old_rows[label]
                losers.extend(e for e in old_losers if e.rsplit(" on ", 1)[0] == label)
            return
        fresh.add(key)
        cells = []
        for d in data_sets:
            mine = [mean_client_accuracy(s) for s in run_seeds(
                None, {**DEFAULTS_SETTINGS[d](), "method": method, **changed, **resources},
                f"{slug(d)}-{name}", seeds, out)]
            text = cell(mine) + " | "
            if base is None:
                cells.append(text + "—")
                continue
            standalone = [mean_client_accuracy(s) for s in run_seeds(
                None, {**DEFAULTS_SETTINGS[d](), "method": "standalone", **base, **resources},
                f"{slug(d)}-standalone" + ("-one-arch" if base else ""), seeds, out)]
            (mean, std), (base_mean, base_std) = mean_std(mine), mean_std(standalone)
            cells.append(text + f"{mean - base_mean:+.3f}")
            if mean < base_mean - max(std, base_std):
                losers.append(f"{label} on {d}")
        rows[key] = (f"| {label} | " + " | ".join(cells) + " | "
                     + training_caption(None, {"method": method, **changed}) + " |")

    # The table's rows in order: (key, label, method, changed settings, run name, base, owners).
    specs: list[tuple] = [("standalone", "standalone", "standalone", {}, "standalone")]
    for method in every:
        one_arch = METHODS[method].homogeneous_only
        extra = ONE_ARCH if one_arch else {}
        specs.append((method, method + (f" ({ONE_ARCH['arch-mix']} only)" if one_arch else ""),
                      method, extra, method + ("-one-arch" if one_arch else ""), extra))
        if one_arch:
            specs.append(("standalone-one-arch", f"standalone ({ONE_ARCH['arch-mix']} only)",
                          "standalone", ONE_ARCH, "standalone-one-arch", None, (method,)))
        for i, changed in enumerate(TRIED.get(method, [])):
            what = ", ".join(f"{k} = {toml_value(v)}" for k, v in changed.items())
            specs.append((f"{method}-tried-{i}", f"{method} with {what}", method, changed,
                          f"{method}-{slug(what)}", {}))
    # Local training with the same steps as the eight methods taken from HtFLlib (their shared
    # recipe: batch 10, six times the global default's steps per round), so that what they add
    # to local training can be told from what their recipe alone adds.
    htfllib_recipe = dict(METHODS["fd"].recipe)
    specs.append(("standalone-htfllib", "standalone with HtFLlib's recipe (FD's)", "standalone",
                  htfllib_recipe, "standalone-htfllib-recipe", {},
                  tuple(m for m in every if dict(METHODS[m].recipe) == htfllib_recipe)))

    # With --jobs, every run the asked rows need, that many at a time; the rows then reuse them.
    run_parallel([e for spec in specs if asked(spec[2], *spec[6:])
                  for e in experiments(*spec[2:6])], out, args.jobs)
    for spec in specs:
        row(*spec)

    ran = [m for m in every if m in args.methods]
    kept = [m for m in every if m not in ran and any(
        k == m or k.startswith(f"{m}-tried-") for k in rows)]
    covered = ran + kept

    def caption(command: str) -> str:
        return (f"Produced by `.venv/bin/python {command}"
                + ("" if covered == every else f" --methods {' '.join(covered)}")
                + seeds_option(seeds)
                + "`"
                + (f" (in parts: the last invocation, `--methods {' '.join(ran)}`, re-ran the"
                   " baselines and replaced those methods' rows, keeping the others')"
                   if kept and ran else "")
                + ". Mean per-client local-test accuracy after the last round, ± std over "
                f"{len(seeds)} seed(s); Δ = against Standalone on the same data and "
                "architectures (local training with its own recipe). Every method trains with "
                "its own recipe, shown in the last column.")

    lines = [caption(SCRIPT), "", *header, *rows.values(), "",
             LOSERS
             + (", ".join(losers) if losers else "none") + "."]
    write_generated(DOC, SCRIPT, "\n".join(lines))
    print(f"[reproduce] wrote {DOC}")
    for page, methods in PAGES.items():
        wanted = (BASELINES + methods
                  + [f"{m}-tried-{i}" for m in methods for i in range(len(TRIED.get(m, [])))]
                  + ["standalone-one-arch", "standalone-htfllib"])
        if all(m in rows for m in wanted) and fresh & set(methods):
            write_generated(ROOT / page, SCRIPT, "\n".join(
                [caption(SCRIPT) + " The whole table: [defaults.md](defaults.md).", "",
                 *header, *(rows[m] for m in wanted)]))
            print(f"[reproduce] wrote {page}")


if __name__ == "__main__":
    main()
