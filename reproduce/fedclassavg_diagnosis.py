"""FedClassAvg diagnosis on the CPU preset: what each loss term does to the extractor, and how
well the extractor alone separates the classes, with the reference code's SupCon (T = 100 on
unnormalised features, scaled by T / 0.07), with the normalised one (T = T_base = 0.07), and
without the contrastive term (Table 4's CA+PR).

    .venv/bin/python reproduce/fedclassavg_diagnosis.py [--seeds 0 1 2] [--jobs 3 --client-num-gpus 0.5]

Every run is ``fedapp run conf/fedclassavg-code.toml --set fedclassavg.diagnose=true ...``
(finished runs are reused, ``results/fedclassavg-diagnosis/``): each round's ``rounds.jsonl``
line then has ``train_terms`` (each term's mean value over the round's batches, as it enters
the loss, and its gradient norm on the extractor and on the classifier, averaged over the
clients) and ``variants.ncm`` (nearest-class-mean accuracy of the extractor's normalised
features). Three seeds by default (9 runs); the table and the plot give each quantity's mean
over the seeds. Writes its table between its markers in ``docs/fedclassavg.md`` and
``docs/fedclassavg-diagnosis.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (DEFAULT_SEEDS, ROOT, add_resource_options, mean_std,  # noqa: E402
                    resource_overrides, run_experiment, run_parallel, write_generated,
                    seeds_option)
from fedclassavg_fmnist import METHODS, PRESET, slug  # noqa: E402

OUT = ROOT / "results" / "fedclassavg-diagnosis"
DOC = ROOT / "docs" / "fedclassavg.md"
RUNS: dict[str, dict[str, Any]] = {
    "code SupCon (T = 100, unnormalised)": METHODS["FedClassAvg"],
    "normalised SupCon (T = 0.07)": METHODS["FedClassAvg, SupCon normalised T=0.07"],
    "no contrastive term (CA+PR)": {"fedclassavg.contrastive": False}}
TERMS = ("supcon", "ce", "proximal")


# One round's line of ``rounds.jsonl`` -> a quantity, None where the run has no such term.
Quantity = Callable[[Mapping[str, Any]], "float | None"]


def term(key: str) -> Quantity:
    return lambda h: h.get("train_terms", {}).get(key)


def ratio(num: str, den: str) -> Quantity:
    """One gradient norm over another, per run (then averaged over the seeds)."""
    def value(h: Mapping[str, Any]) -> float | None:
        t = h.get("train_terms", {})
        return t[num] / t[den] if num in t else None
    return value


def ncm(h: Mapping[str, Any]) -> float | None:
    return h.get("variants", {}).get("ncm", {}).get("mean")


def accuracy(h: Mapping[str, Any]) -> float:
    return h["accuracy_mean"]


def at_round(summaries: Sequence[Mapping[str, Any]], r: int, quantity: Quantity) -> list[float]:
    """``quantity`` in round ``r`` of each seed's run; empty if the runs have no such term."""
    values = [quantity(next(h for h in s["history"] if h["round"] == r)) for s in summaries]
    return [] if any(v is None for v in values) else values


def rounds(summaries: Sequence[Mapping[str, Any]]) -> list[int]:
    return [h["round"] for h in summaries[0]["history"]]


def curve(summaries: Sequence[Mapping[str, Any]], quantity: Quantity) -> list[float] | None:
    """``quantity``'s mean over the seeds, round by round; None if the runs have no such term."""
    means = [at_round(summaries, r, quantity) for r in rounds(summaries)]
    return None if not all(means) else [mean_std(v)[0] for v in means]


def fmt(values: Sequence[float], digits: int = 3, spread: bool = False) -> str:
    """The mean over seeds (``spread``: ± their std); "—" for a term the run does not have."""
    if not values:
        return "—"
    mean, std = mean_std(values)
    text = f"{mean:.{digits}g}" if abs(mean) < 1e4 else f"{mean:.2e}"
    return text + (f" ± {std:.{digits}f}" if spread and len(values) > 1 else "")


COLUMNS: dict[str, tuple[Quantity, int, bool]] = {
    "SupCon term": (term("supcon-loss"), 3, False),
    "CE term": (term("ce-loss"), 3, False),
    "proximal term": (term("proximal-loss"), 3, False),
    "‖∇SupCon‖ / ‖∇CE‖ on the extractor": (ratio("supcon-grad-extractor",
                                                   "ce-grad-extractor"), 3, False),
    "‖∇prox‖ / ‖∇CE‖ on the classifier": (ratio("proximal-grad-classifier",
                                                 "ce-grad-classifier"), 3, False),
    "NCM accuracy of the extractor": (ncm, 4, True),
    "accuracy (own classifier)": (accuracy, 4, True)}


def table(runs: Mapping[str, Sequence[Mapping[str, Any]]], at: list[int]) -> list[str]:
    lines = ["| SupCon / round | " + " | ".join(COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 1) + "|"]
    for label, summaries in runs.items():
        for r in at:
            lines.append(f"| {label}, round {r} | " + " | ".join(
                fmt(at_round(summaries, r, q), digits, spread)
                for q, digits, spread in COLUMNS.values()) + " |")
    return lines


def plot(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    for n, (label, summaries) in enumerate(runs.items()):
        x = rounds(summaries)
        colour = f"C{n}"
        for name, style in zip(TERMS, ("-", "--", ":")):
            values = curve(summaries, term(f"{name}-loss"))
            if values is not None:
                axes[0].plot(x, values, style, color=colour, label=f"{name}, {label}")
        for name, style in zip(("supcon", "ce"), ("-", "--")):
            values = curve(summaries, term(f"{name}-grad-extractor"))
            if values is not None:
                axes[1].plot(x, values, style, color=colour, label=f"{name}, {label}")
        axes[2].plot(x, curve(summaries, accuracy), "-", color=colour,
                     label=f"accuracy, {label}")
        axes[2].plot(x, curve(summaries, ncm), "--", color=colour,
                     label=f"NCM of the extractor, {label}")
    axes[0].set(yscale="log", xlabel="round", ylabel="term value (mean over batches, clients)",
                title="loss terms as they enter the loss (mean over seeds)")
    axes[1].set(yscale="log", xlabel="round", ylabel="gradient norm on the extractor",
                title="each term's pull on the extractor (mean over seeds)")
    axes[2].set(xlabel="round", ylabel="mean per-client local test accuracy",
                title="classifier vs nearest class mean (mean over seeds)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    add_resource_options(parser)
    args = parser.parse_args()
    plan = {label: [(PRESET, {"partition": "dirichlet", **overrides, "fedclassavg.diagnose": True,
                              "seed": seed, **resource_overrides(args)},
                     f"{slug(label)}-s{seed}") for seed in args.seeds]
            for label, overrides in RUNS.items()}
    run_parallel([e for row in plan.values() for e in row], OUT, args.jobs)
    runs = {label: [run_experiment(*e, OUT) for e in row] for label, row in plan.items()}
    last = runs[next(iter(runs))][0]["rounds"]
    command = ".venv/bin/python reproduce/fedclassavg_diagnosis.py" + (
        seeds_option(args.seeds))
    one = len(args.seeds) == 1
    lines = [f"Produced by `{command}`. "
             f"Dir(0.5), 10 clients x 300 samples, {last} rounds, seed{'' if one else 's'} "
             f"{', '.join(map(str, args.seeds))}; each term averaged over the round's batches "
             "and the clients; gradient norms per batch"
             + ("" if one else "; every cell the mean over seeds (a ratio: of each run's "
                "ratio), the accuracies ± their std over seeds") + ".", "",
             *table(runs, sorted({1, last // 2, last})), "",
             "![diagnosis](fedclassavg-diagnosis.png)"]
    plot(runs, ROOT / "docs" / "fedclassavg-diagnosis.png")
    text = "\n".join(lines)
    write_generated(DOC, "reproduce/fedclassavg_diagnosis.py", text)
    print(text)


if __name__ == "__main__":
    main()
