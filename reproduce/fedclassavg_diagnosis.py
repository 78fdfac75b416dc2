"""FedClassAvg diagnosis on the CPU preset: what each loss term does to the extractor, and how
well the extractor alone separates the classes, with the reference code's SupCon (T = 100 on
unnormalised features, scaled by T / 0.07), with the normalised one (T = T_base = 0.07), and
without the contrastive term (Table 4's CA+PR).

    .venv/bin/python reproduce/fedclassavg_diagnosis.py [--seed 0] [--jobs 3 --client-num-gpus 0.5]

Every run is ``fedapp run conf/fedclassavg-code.toml --set fedclassavg.diagnose=true ...``
(finished runs are reused, ``results/fedclassavg-diagnosis/``): each round's ``rounds.jsonl``
line then has ``train_terms`` (each term's mean value over the round's batches, as it enters
the loss, and its gradient norm on the extractor and on the classifier, averaged over the
clients) and ``variants.ncm`` (nearest-class-mean accuracy of the extractor's normalised
features). Writes its table between its markers in ``docs/fedclassavg.md`` and
``docs/fedclassavg-diagnosis.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Mapping

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (ROOT, add_resource_options, resource_overrides,  # noqa: E402
                    run_experiment, run_parallel, write_generated)
from fedclassavg_fmnist import METHODS, PRESET, slug  # noqa: E402

OUT = ROOT / "results" / "fedclassavg-diagnosis"
DOC = ROOT / "docs" / "fedclassavg.md"
RUNS: dict[str, dict[str, Any]] = {
    "code SupCon (T = 100, unnormalised)": METHODS["FedClassAvg"],
    "normalised SupCon (T = 0.07)": METHODS["FedClassAvg, SupCon normalised T=0.07"],
    "no contrastive term (CA+PR)": {"fedclassavg.contrastive": False}}
TERMS = ("supcon", "ce", "proximal")


def terms(summary: Mapping[str, Any], key: str) -> list[float | None]:
    return [h.get("train_terms", {}).get(key) for h in summary["history"]]


def ncm(summary: Mapping[str, Any]) -> list[float | None]:
    return [h.get("variants", {}).get("ncm", {}).get("mean") for h in summary["history"]]


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.2e}"


def table(runs: Mapping[str, Mapping[str, Any]], at: list[int]) -> list[str]:
    lines = ["| SupCon / round | SupCon term | CE term | proximal term | ‖∇SupCon‖ / "
             "‖∇CE‖ on the extractor | ‖∇prox‖ / ‖∇CE‖ on the classifier | NCM accuracy of the "
             "extractor | accuracy (own classifier) |", "|---|---|---|---|---|---|---|---|"]
    for label, s in runs.items():
        history = {h["round"]: i for i, h in enumerate(s["history"])}
        for r in at:
            i = history[r]
            t = s["history"][i].get("train_terms", {})
            ratio = (t["supcon-grad-extractor"] / t["ce-grad-extractor"]
                     if "supcon-grad-extractor" in t else None)
            prox = (t["proximal-grad-classifier"] / t["ce-grad-classifier"]
                    if "proximal-grad-classifier" in t else None)
            lines.append(f"| {label}, round {r} | {fmt(t.get('supcon-loss'))} | "
                         f"{fmt(t.get('ce-loss'))} | {fmt(t.get('proximal-loss'))} | "
                         f"{fmt(ratio)} | {fmt(prox)} | {fmt(ncm(s)[i], 4)} | "
                         f"{fmt(s['history'][i]['accuracy_mean'], 4)} |")
    return lines


def plot(runs: Mapping[str, Mapping[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    for n, (label, s) in enumerate(runs.items()):
        rounds = [h["round"] for h in s["history"]]
        colour = f"C{n}"
        for term, style in zip(TERMS, ("-", "--", ":")):
            values = terms(s, f"{term}-loss")
            if any(v is not None for v in values):
                axes[0].plot(rounds, values, style, color=colour, label=f"{term}, {label}")
        for term, style in zip(("supcon", "ce"), ("-", "--")):
            values = terms(s, f"{term}-grad-extractor")
            if any(v is not None for v in values):
                axes[1].plot(rounds, values, style, color=colour, label=f"{term}, {label}")
        axes[2].plot(rounds, [h["accuracy_mean"] for h in s["history"]], "-", color=colour,
                     label=f"accuracy, {label}")
        axes[2].plot(rounds, ncm(s), "--", color=colour, label=f"NCM of the extractor, {label}")
    axes[0].set(yscale="log", xlabel="round", ylabel="term value (mean over batches, clients)",
                title="loss terms as they enter the loss")
    axes[1].set(yscale="log", xlabel="round", ylabel="gradient norm on the extractor",
                title="each term's pull on the extractor")
    axes[2].set(xlabel="round", ylabel="mean per-client local test accuracy",
                title="classifier vs nearest class mean")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    add_resource_options(parser)
    args = parser.parse_args()
    plan = {label: (PRESET, {"partition": "dirichlet", **overrides, "fedclassavg.diagnose": True,
                             "seed": args.seed, **resource_overrides(args)},
                    f"{slug(label)}-s{args.seed}") for label, overrides in RUNS.items()}
    run_parallel(list(plan.values()), OUT, args.jobs)
    runs = {label: run_experiment(*e, OUT) for label, e in plan.items()}
    last = runs[next(iter(runs))]["rounds"]
    command = ".venv/bin/python reproduce/fedclassavg_diagnosis.py" + (
        f" --seed {args.seed}" if args.seed else "")
    lines = [f"Produced by `{command}`. "
             f"Dir(0.5), 10 clients x 300 samples, {last} rounds, seed {args.seed}; each term "
             "averaged over the round's batches and the clients; gradient norms per batch.", "",
             *table(runs, sorted({1, last // 2, last})), "",
             "![diagnosis](fedclassavg-diagnosis.png)"]
    plot(runs, ROOT / "docs" / "fedclassavg-diagnosis.png")
    text = "\n".join(lines)
    write_generated(DOC, "reproduce/fedclassavg_diagnosis.py", text)
    print(text)


if __name__ == "__main__":
    main()
