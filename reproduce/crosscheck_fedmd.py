"""Our FedMD beside the authors' code (diogenes0319/FedMD_clean ab7a07b, TensorFlow/Keras) on
identical files: the same client shards, local test sets and public set, the same alignment
set A_t every round, FedMD's ten CNNs at the same widths, the same phases and hyperparameters.
docs/crosscheck.md ("FedMD") says how the peer's side is run and what cannot be made the same.

Three steps, the middle one outside this repository:

    .venv/bin/python reproduce/crosscheck_fedmd.py --export /tmp/fedmd-work --seeds 0 1 2
    (the peer, once per seed, writes PEER/seed<s>/result.json; docs/crosscheck.md)
    .venv/bin/python reproduce/crosscheck_fedmd.py --data-dir /tmp/fedmd-work --peer-dir PEER \\
        --seeds 0 1 2

The export cuts the work from ``fedhe-async-fmnist`` (ten clients, IID, at most 500 training
samples each, the local test sets drawn from the test split, 10 % of the training split held
out as the public set: the partition of reproduce/fedhe_fmnist.py at seed 0) and writes, with
crosscheck_files.py's folder, ``fedmd.json`` (the peer's settings: its model list and
hyperparameters, equal to ours) and ``alignment-seed<s>.npy`` (row r: A_{r+1} of our run at
seed s, which the peer's round r aligns on). The last step runs ours on that folder (finished
runs are reused from results/crosscheck-fedmd/) and writes the table into docs/crosscheck.md.

Rounds: the peer evaluates after its transfer learning (its round 0) and after each of
``--rounds`` collaborative rounds; ours evaluates after Flower round 1 (transfer learning and
the first scores) and after each later round (digest, revisit, scores), so the peer's round r
is our round r + 1 and ours runs ``--rounds`` + 1 Flower rounds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, finished, run_seeds  # noqa: E402
from crosscheck_files import (cell, export_federation, federation_settings, main,  # noqa: E402
                              peer_result, source_config)

from client_models.base import scale_channels  # noqa: E402
from client_models.paper_cnns import FEDHE_CNNS  # noqa: E402
from fedapp.data.public import round_subset  # noqa: E402

SCRIPT = "reproduce/crosscheck_fedmd.py"
OUT = ROOT / "results" / "crosscheck-fedmd"
DOC = ROOT / "docs" / "crosscheck.md"
ROUNDS = 10
SOURCE_PRESET = "fedhe-async-fmnist"
SOURCE = {"method": "fedmd", "server-loop": "rounds", "seed": 0,
          "public-source": "train-holdout", "public-fraction": 0.1}
ARCHS = [f"fedhe-cnn{k}" for k in range(10)]
WIDTH = 0.25
# The authors' conf (conf/EMNIST_balance_conf.json) and FedMD.py, ours at the same values; the
# two early-stopped pre-training phases run all their epochs on both sides (the peer's monitor
# the test set, ours a held-out share of training data: neither can be made the other).
WORK: dict[str, Any] = {
    "method": "fedmd", "num-clients": 10, "arch-mix": ",".join(ARCHS),
    "arch-assignment": "round-robin", "model-width": WIDTH, "feature-dim": 0,
    "server-loop": "rounds", "fraction-fit": 1.0, "eval-every": 1,
    "eval-global-test": True, "global-test-samples": 0,
    "optimizer": "adam", "lr": 0.001, "optimizer-state": "keep", "weight-decay": 0.0,
    "grad-clip": 0.0, "batch-size": 5, "local-epochs": 2, "local-steps": 0,
    "drop-last": False, "lr-decay-at": "",
    "fedmd.alignment-size": 500, "fedmd.digest-loss": "mae", "fedmd.digest-epochs": 1,
    "fedmd.digest-batch-size": 256, "fedmd.pretrain": "public+private",
    "fedmd.pretrain-public-epochs": 20, "fedmd.pretrain-public-batch-size": 128,
    "fedmd.pretrain-private-epochs": 25, "fedmd.pretrain-private-batch-size": 32,
    "fedmd.early-stopping-fraction": 0.0,
    # The peer's revisits continue its private pre-training's Adam (one compile()).
    "fedmd.revisit-optimizer": "private-pretraining",
}
# A pipeline check (--quick): 50 training samples per client, one public pre-training epoch,
# one collaborative round; its table goes to results/crosscheck-fedmd/quick/, never to docs/.
QUICK_SOURCE = {"max-samples-per-client": 50}
QUICK_WORK = {"fedmd.pretrain-public-epochs": 1}


def peer_models() -> list[dict[str, Any]]:
    """FedMD_clean's model list (its conf's "models") for our ten CNNs at ``WIDTH``."""
    models = []
    for arch in ARCHS:
        spec = FEDHE_CNNS[arch]
        filters = [scale_channels(f, WIDTH) for f in spec.filters]
        params = {f"n{i + 1}": n for i, n in enumerate(filters)}
        models.append({"model_type": f"{len(filters)}_layer_CNN",
                       "params": {**params, "dropout_rate": spec.dropout}})
    return models


def settings(quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(our work's settings, the export's source settings)."""
    return ({**WORK, **QUICK_WORK}, {**SOURCE, **QUICK_SOURCE}) if quick else (WORK, SOURCE)


def export(out: Path, seeds: list[int], rounds: int, quick: bool) -> None:
    work, source = settings(quick)
    cfg = source_config(SOURCE_PRESET, {**source, "num-server-rounds": rounds + 1})
    config = export_federation(cfg, out, {"preset": SOURCE_PRESET, **source})
    peer = {"models": peer_models(), "N_alignment": work["fedmd.alignment-size"],
            "N_rounds": rounds, "N_logits_matching_round": work["fedmd.digest-epochs"],
            "logits_matching_batchsize": work["fedmd.digest-batch-size"],
            "N_private_training_round": work["local-epochs"],
            "private_training_batchsize": work["batch-size"],
            "pretrain_public": {"epochs": work["fedmd.pretrain-public-epochs"],
                                "batch_size": work["fedmd.pretrain-public-batch-size"],
                                "patience": 3},
            "pretrain_private": {"epochs": work["fedmd.pretrain-private-epochs"],
                                 "batch_size": work["fedmd.pretrain-private-batch-size"]}}
    (out / "fedmd.json").write_text(json.dumps(peer, indent=1) + "\n")
    for seed in seeds:  # our A_1 .. A_{rounds+1} at this seed (fedmd.maths.alignment_set)
        rows = [round_subset(seed, "fedmd-alignment", t, config["public_size"],
                             work["fedmd.alignment-size"]) for t in range(1, rounds + 2)]
        np.save(out / f"alignment-seed{seed}.npy", np.stack(rows))
    print(f"[crosscheck] wrote {out}: {config['num_clients']} clients, "
          f"{sum(s['train'] for s in config['sizes'])} training and "
          f"{sum(s['test'] for s in config['sizes'])} test samples, "
          f"{config['public_size']} public; alignment sets for seeds {seeds}")


def ours(out: Path, run: str) -> dict[str, list[float]]:
    """Per evaluated round: the mean over clients of the own-test and pooled-test accuracy."""
    summary = json.loads(finished(out, run).read_text())
    rounds = [h for h in summary["history"] if h["per_client"]]
    return {"own": [float(np.mean(list(h["per_client"].values()))) for h in rounds],
            "pooled": [float(np.mean(list(h["global_per_client"].values()))) for h in rounds]}


def peer(peer_dir: Path, seed: int) -> dict[str, list[float]] | None:
    """The driver's result.json: each party's accuracy per evaluation, averaged here."""
    result = peer_result(peer_dir, seed)
    if result is None:
        return None
    return {"own": [float(np.mean(r)) for r in result["own_test"]],
            "pooled": [float(np.mean(r)) for r in result["pooled_test"]]}


def table(data_dir: Path, peer_dir: Path, seeds: list[int], rounds: int, out: Path,
          quick: bool) -> str:
    work = settings(quick)[0]
    name = f"fedmd-{rounds + 1}-rounds"
    run_seeds(None, {**work, **federation_settings(data_dir, public=True),
                     "num-server-rounds": rounds + 1}, name, seeds, out)
    mine = [ours(out, f"{name}-seed{s}") for s in seeds]
    theirs = {s: p for s in seeds if (p := peer(peer_dir, s)) is not None}
    lines = [
        f"Produced by `.venv/bin/python {SCRIPT} --data-dir <the exported folder> --peer-dir "
        f"<the peer's results> --seeds {' '.join(map(str, seeds))}"
        + ("" if rounds == ROUNDS else f" --rounds {rounds}") + (" --quick" if quick else "")
        + "`. Mean over the ten "
        "clients of each client's accuracy, then mean ± std over seeds (the peer's at TF seeds "
        f"{' '.join(map(str, sorted(theirs))) or '—'}, ours at seeds "
        f"{' '.join(map(str, seeds))}); own test = each client's local test set (our "
        "headline), pooled test = every client's test samples together (the peer's own "
        "measure). The peer's round r is our round r + 1; round 0 is after the transfer "
        "learning.", "",
        "| round | own test: FedMD_clean | own test: ours | difference | pooled test: "
        "FedMD_clean | pooled test: ours | difference |", "|---|---|---|---|---|---|---|"]
    for r in range(rounds + 1):
        row = [f"| {r} "]
        for key in ("own", "pooled"):
            p = [t[key][r] for t in theirs.values() if len(t[key]) > r]
            o = [m[key][r] for m in mine if len(m[key]) > r]
            diff = f"{np.mean(o) - np.mean(p):+.4f}" if p and o else "—"
            row.append(f"| {cell(p)} | {cell(o)} | {diff} ")
        lines.append("".join(row) + "|")
    if not theirs:
        lines += ["", f"The peer's side is not run yet: no result.json under {peer_dir.name}/."]
    return "\n".join(lines)


if __name__ == "__main__":
    main(__doc__.split("\n")[0], ROUNDS, OUT, DOC, SCRIPT, export, table)
