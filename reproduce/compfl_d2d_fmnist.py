"""CompFL without a server (paper Appendix E, Figure 7) on Fashion-MNIST: server mode against
device to device, D/D (``server-loop = "walk"``) and M/M (``"gossip"``), on a fully connected
graph (Erdős–Rényi p = 1.0) and a sparse one (p = 0.6), at the same update budget.

The setting is reproduce/compfl_fmnist.py's N = 5, unified labels (conf/compfl-fmnist.toml;
``--clients 10`` by default: 5 small + 5 large experts), whose server-mode CompFL and Standalone
runs are reused when they exist (same run names, same results folder). Reports each mode's
mean local test accuracy, the relay's bytes (through the SuperLink) and the bytes that would
cross the peer-to-peer edges; writes the table into docs/compfl-d2d.md (between its generated
markers) and the curves into docs/compfl-d2d-fmnist.png.

    .venv/bin/python reproduce/compfl_d2d_fmnist.py                # 3 seeds
    .venv/bin/python reproduce/compfl_d2d_fmnist.py --seeds 0
    .venv/bin/python reproduce/compfl_d2d_fmnist.py --quick        # pipeline check only

Finished runs are reused (their summary.json), so an interrupted reproduction resumes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from common import (DEFAULT_SEEDS, ROOT, cell, mean_std, per_architecture, per_client_accuracies,
                    plot_panels, quick_folder, run_experiment, write_generated, seeds_option)

PRESET = "compfl-fmnist"
SCRIPT = "reproduce/compfl_d2d_fmnist.py"
GRAPHS = [("p = 1.0", {"topology": "full"}),
          ("p = 0.6", {"topology": "erdos-renyi", "topology-p": 0.6})]
MODES = [("D/D (walk)", "walk"), ("M/M (gossip)", "gossip")]


def accuracy(summary: dict) -> float:
    return float(np.mean(per_client_accuracies(summary)))


def row(label: str, graph: str, summaries: list[dict]) -> str:
    com = summaries[0]["communication"]
    relay = (com["bytes_up"] + com["bytes_down"] + com["framing_bytes_up"]
             + com["framing_bytes_down"]) / summaries[0]["num_clients"]
    peer = summaries[0].get("peer_traffic")
    peer_text = "—" if peer is None else (
        f"{peer['total_bytes'] / summaries[0]['num_clients'] / 2**20:.1f} MiB / "
        f"{peer['max_edge_bytes'] / 2**20:.1f} MiB")
    arch_text = per_architecture(summaries)
    return (f"| {label} | {graph} | {cell(accuracy(s) for s in summaries)} | {arch_text} | "
            f"{relay / 2**20:.1f} MiB | {peer_text} | "
            f"{mean_std(s['wall_seconds'] for s in summaries)[0]:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--clients", type=int, choices=(20, 10), default=10)
    parser.add_argument("--quick", action="store_true",
                        help="4 clients, 100 samples, 2 rounds, one seed; not for the docs")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "reproduce-compfl")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "compfl-d2d.md")
    args = parser.parse_args()

    extra = {"num-clients": args.clients, "classes-per-client": 5, "label-permutation": False}
    seeds = args.seeds
    if args.quick:
        extra.update({"num-clients": 4, "samples-per-client": 100, "num-server-rounds": 2})
        seeds = seeds[:1]
        args.out = quick_folder(args.out)
        args.doc = args.out / "compfl-d2d-quick.md"
    out = args.out.resolve()
    # The server-mode runs carry reproduce/compfl_fmnist.py's names, so they are shared.
    stem = f"{PRESET}-c{extra['num-clients']}-n5-unif"

    def runs(tag: str, overrides: dict) -> list[dict]:
        return [run_experiment(PRESET, {**overrides, **extra, "seed": seed},
                               f"{stem}-{tag}-seed{seed}", out) for seed in seeds]

    results = {("Standalone", "—"): runs("standalone", {"method": "standalone"}),
               ("CompFL, server", "—"): runs("compfl", {"method": "compfl"})}
    for graph, topology in GRAPHS:
        for label, loop in MODES:
            tag = f"d2d-{loop}-{graph.split()[-1]}"
            results[(f"CompFL, {label}", graph)] = runs(
                tag, {"method": "compfl", "server-loop": loop, **topology})

    updates = next(iter(results.values()))[0]["rounds"] * extra["num-clients"]
    table = [
        f"### Server vs device to device: N = 5, unified labels, {extra['num-clients']} "
        f"clients, {updates} client updates each",
        "",
        "| method | graph | local accuracy (mean over clients; ± std over seeds) | per "
        "architecture | relay bytes per client (up + down) | peer bytes per client / on the "
        "busiest edge | wall s |",
        "|---|---|---|---|---|---|---|",
        *(row(label, graph, s) for (label, graph), s in results.items())]
    server = np.mean([accuracy(s) for s in results[("CompFL, server", "—")]])
    verdicts = [f"- {label}, {graph}: {np.mean([accuracy(s) for s in runs_]) - server:+.4f} "
                "against the server mode" for (label, graph), runs_ in results.items()
                if graph != "—"]
    panels = {graph: {"Standalone": results[("Standalone", "—")],
                      "CompFL, server": results[("CompFL, server", "—")],
                      **{f"CompFL, {label}": results[(f"CompFL, {label}", graph)]
                         for label, _ in MODES}} for graph, _ in GRAPHS}
    plot = args.doc.parent / "compfl-d2d-fmnist.png"
    plot_panels(panels, plot)
    command = f".venv/bin/python {SCRIPT}" + (" --quick" if args.quick else "".join(
        [seeds_option(seeds),
         f" --clients {args.clients}" if args.clients != 10 else ""]))
    write_generated(args.doc, SCRIPT, "\n\n".join([
        f"Produced by `{command}` ({len(seeds)} seed(s): {', '.join(map(str, seeds))}). "
        "A device-to-device \"round\" in the plot is one evaluation, every num-clients "
        "updates.", "\n".join(table), "\n".join(verdicts),
        f"![accuracy per round, server vs device to device]({plot.name})"]))
    print(f"[reproduce] wrote {args.doc} and {plot}")


if __name__ == "__main__":
    main()
