"""Our HeteroFL beside Flower's baseline (adap/flower fdef7af, ``baselines/heterofl``) on
identical files: the same client shards, local test sets and pooled sets, the same global model
(HeteroFL's conv at the same widths) starting from the same weights, the same rates, recipe,
aggregation and sBN evaluation. docs/crosscheck.md ("HeteroFL") says how the peer's side is run
and what cannot be made the same.

Three steps, the middle one outside this repository:

    .venv/bin/python reproduce/crosscheck_heterofl.py --export /tmp/heterofl-work --seeds 0 1 2
    (the peer, once per seed, writes PEER/seed<s>/result.json; docs/crosscheck.md)
    .venv/bin/python reproduce/crosscheck_heterofl.py --data-dir /tmp/heterofl-work \\
        --peer-dir PEER --seeds 0 1 2

The export cuts ten clients' Fashion-MNIST shards (Dirichlet 0.5, at most 500 training samples
each, local test sets from the test split: ``SOURCE``) into crosscheck_files.py's folder, with
``global-init-seed<s>.npz``: our initial global model at seed s (the arrays of its state_dict in
order), which the peer loads in place of its own draw. The last step runs ours on that folder
(finished runs are reused from results/crosscheck-heterofl/) and writes the table into
docs/crosscheck.md: the paper's "Global" accuracy (the global model on the pooled test set,
its BatchNorm statistics from one pass over the pooled training set) after each round.
"""

from __future__ import annotations

import json
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, finished, run_seeds  # noqa: E402
from crosscheck_files import (cell, export_federation, federation_settings, main,  # noqa: E402
                              peer_result, source_config)

from fedapp.data import setup  # noqa: E402
from fedapp.seeding import isolated_rng  # noqa: E402

SCRIPT = "reproduce/crosscheck_heterofl.py"
OUT = ROOT / "results" / "crosscheck-heterofl"
DOC = ROOT / "docs" / "crosscheck.md"
ROUNDS = 20
SOURCE = {"dataset": "fmnist", "method": "heterofl", "num-clients": 10, "seed": 0,
          "partition": "dirichlet", "dirichlet-alpha": 0.5, "max-samples-per-client": 500}
# HeteroFL's code for the conv (and the baseline's conf/base.yaml with model.model_name =
# conv): levels a-e in fix mode, masked head, Scaler, static BN with the server's sBN pass;
# SGD 0.01, momentum 0.9, weight decay 5e-4, clip 1, 5 epochs of batch 10, a new optimizer
# each round; every client every round (the baseline's fraction_fit = 1 here) and no learning
# rate decay within these few rounds (the baseline's milestone put past the last round).
WORK: dict[str, Any] = {
    "method": "heterofl", "num-clients": 10, "model-width": 0.25,
    "heterofl.global-arch": "heterofl-conv", "heterofl.rates": "a1-b1-c1-d1-e1",
    "heterofl.rate-mode": "fix", "heterofl.mask": True, "heterofl.scaler": True,
    "heterofl.sbn": "server-pool", "fraction-fit": 1.0, "eval-every": 1,
    "global-test-samples": 0, "optimizer": "sgd", "lr": 0.01, "momentum": 0.9,
    "weight-decay": 5e-4, "grad-clip": 1.0, "optimizer-state": "fresh", "batch-size": 10,
    "local-epochs": 5, "local-steps": 0, "lr-decay-at": "", "drop-last": False,
}
HIDDEN = [16, 32, 64, 128]  # HeteroFL's 64-128-256-512 at model-width 0.25 (⌈0.25·w⌉)
# A pipeline check (--quick, e.g. with --rounds 2): 50 training samples per client; its table
# goes to results/crosscheck-heterofl/quick/, never to docs/.
QUICK_SOURCE = {"max-samples-per-client": 50}


def ours_config(data_dir: Path, rounds: int, seed: int):
    return source_config(None, {**WORK, **federation_settings(data_dir, public=False),
                                "num-server-rounds": rounds, "seed": seed})


def initial_global(cfg) -> list[np.ndarray]:
    """Our server's initial global model at the run's seed (HeteroFL's strategy draws it so)."""
    from strategies.heterofl.maths import width_model
    data = setup.dataset(cfg)
    with isolated_rng(setup.model_init_seed(cfg, cfg.settings.global_arch, "server")):
        model = width_model(cfg, Fraction(1), data.input_shape, data.num_classes)
    return [v.detach().numpy() for v in model.state_dict().values()]


def peer_command(data_dir: Path, peer_dir: Path, seed: int, rounds: int) -> str:
    """The baseline's command line for one seed (docs/crosscheck.md has its environment)."""
    return (f"HETEROFL_FRESH_SBN=1 HETEROFL_FEDERATION_DIR={data_dir} "
            f"HETEROFL_INIT={data_dir}/global-init-seed{seed}.npz python -m heterofl.main "
            f"num_clients={WORK['num-clients']} num_epochs={WORK['local-epochs']} "
            f"num_rounds={rounds} seed={seed} "
            "client_resources.num_gpus=0 control.model_split_mode=fix "
            f"control.model_mode={WORK['heterofl.rates']} dataset.dataset_name=MNIST "
            "dataset.iid=true model.model_name=conv "
            f"'model.hidden_layers=[{','.join(map(str, HIDDEN))}]' "
            f"optim_scheduler.lr={WORK['lr']} 'optim_scheduler.milestones=[{rounds + 1}]' "
            f"strategy.fraction_fit=1.0 strategy.fraction_evaluate=1.0 "
            f"strategy.min_fit_clients={WORK['num-clients']} "
            f"strategy.min_evaluate_clients={WORK['num-clients']} "
            f"hydra.run.dir={peer_dir}/seed{seed}")


def export(out: Path, seeds: list[int], rounds: int, quick: bool) -> None:
    source = {**SOURCE, **QUICK_SOURCE} if quick else SOURCE
    config = export_federation(source_config(None, {**source, "num-server-rounds": rounds}),
                               out, source)
    for seed in seeds:
        arrays = initial_global(ours_config(out, rounds, seed))
        np.savez(out / f"global-init-seed{seed}.npz", **{f"a{i}": a for i, a in enumerate(arrays)})
    print(f"[crosscheck] wrote {out}: {config['num_clients']} clients, "
          f"{sum(s['train'] for s in config['sizes'])} training and "
          f"{sum(s['test'] for s in config['sizes'])} test samples; initial global models for "
          f"seeds {seeds}. The peer, from the baseline's folder, for each seed:")
    for seed in seeds:
        print("  " + peer_command(out, Path("PEER"), seed, rounds))


def ours(out: Path, run: str) -> list[float]:
    """The global model's accuracy on the pooled test set after each evaluated round."""
    summary = json.loads(finished(out, run).read_text())
    return [h["server_accuracy"]["global"] for h in summary["history"]
            if "server_accuracy" in h]


def peer(peer_dir: Path, seed: int) -> dict[str, list[float]] | None:
    """The baseline's centralised metrics per round (round 0: before any training); its
    ``local_accuracy`` is a sum over the clients (a bug of the baseline), divided here."""
    result = peer_result(peer_dir, seed)
    if result is None:
        return None
    metrics = result["metrics_centralized"]
    return {"global": [v for _, v in sorted(metrics["global_accuracy"])],
            "local": [v / result["num_clients"] for _, v in sorted(metrics["local_accuracy"])]}


def table(data_dir: Path, peer_dir: Path, seeds: list[int], rounds: int, out: Path,
          quick: bool) -> str:
    name = f"heterofl-{rounds}-rounds"
    run_seeds(None, {**WORK, **federation_settings(data_dir, public=False),
                     "num-server-rounds": rounds}, name, seeds, out)
    mine = [ours(out, f"{name}-seed{s}") for s in seeds]
    theirs = {s: p for s in seeds if (p := peer(peer_dir, s)) is not None}
    lines = [
        f"Produced by `.venv/bin/python {SCRIPT} --data-dir <the exported folder> --peer-dir "
        f"<the peer's results> --seeds {' '.join(map(str, seeds))}"
        + ("" if rounds == ROUNDS else f" --rounds {rounds}") + (" --quick" if quick else "")
        + "`. The global model (full width) on the pooled test set after each round, its "
        "static BatchNorms' statistics from one pass over the pooled training set (the paper's "
        "\"Global\"); mean ± std over seeds (the peer's torch seeds "
        f"{' '.join(map(str, sorted(theirs))) or '—'}, ours at seeds "
        f"{' '.join(map(str, seeds))}), both sides starting from our initial global model of "
        "that seed.", "",
        "| round | Flower's baseline | ours | difference |", "|---|---|---|---|"]
    for r in range(1, rounds + 1):
        p = [t["global"][r] for t in theirs.values() if len(t["global"]) > r]
        o = [m[r - 1] for m in mine if len(m) >= r]
        diff = f"{np.mean(o) - np.mean(p):+.4f}" if p and o else "—"
        lines.append(f"| {r} | {cell(p)} | {cell(o)} | {diff} |")
    if not theirs:
        lines += ["", f"The peer's side is not run yet: no result.json under {peer_dir.name}/."]
    return "\n".join(lines)


if __name__ == "__main__":
    main(__doc__.split("\n")[0], ROUNDS, OUT, DOC, SCRIPT, export, table)
