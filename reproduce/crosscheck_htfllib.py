"""Our methods beside HtFLlib's on identical work: HtFLlib's data files, its models, its
hyperparameters, its accuracy — do we land where the peer lands, method by method?

The work (docs/crosscheck.md says how the peer's side was run):

- data: Fashion-MNIST split by PFLlib's generator (``generate_FashionMNIST.py noniid - dir``:
  Dirichlet 0.1, 20 clients, each client's samples 75/25 into train/test), read here with
  ``partition = "files"`` from the folder the generator wrote (``--data-dir``);
- models: HtFLlib's 1-channel CNN family HCNNs8 (``client_models/htfllib_cnns.py``), model k
  to client k mod 8, representation d = 512;
- training: HtFLlib's defaults — SGD without momentum, lr 0.01 (no state, so an optimizer per
  round or per run is the same), one epoch a round of batches of 10 in the data's own order
  (its loader neither shuffles nor keeps the short last batch), every client every round;
- accuracy: HtFLlib's (correct predictions over all clients' test samples, pooled) and ours
  (the mean of the clients' accuracies), after the last round and the best over rounds (the
  peer's "best accuracy"); where the peer measures something else than our headline (``VARIANT``)
  the peer's measurement is computed too.

    .venv/bin/python reproduce/crosscheck_htfllib.py --data-dir /data/pfllib/FashionMNIST

Finished runs are reused (results/crosscheck-htfllib/, else their records under
reproduce/records/crosscheck-htfllib/). Writes the table into docs/crosscheck.md, with the
peer's figures (``PEER``: taken from its logs) beside ours; with ``--methods``, those rows only,
into a part of the doc of their own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Mapping

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (DEFAULT_SEEDS, ROOT, finished, mean_std, provenance, record,  # noqa: E402
                    run_seeds, write_generated)

from client_models.htfllib_cnns import HTFLLIB_CNNS  # noqa: E402

SCRIPT = "reproduce/crosscheck_htfllib.py"
OUT = ROOT / "results" / "crosscheck-htfllib"
DOC = ROOT / "docs" / "crosscheck.md"
ROUNDS = 3

# HtFLlib's defaults (system/main.py's argparse; docs/crosscheck.md cites the lines).
WORK: dict[str, Any] = {
    "dataset": "federation", "partition": "files", "num-clients": 20,
    "arch-mix": ",".join(HTFLLIB_CNNS), "feature-dim": 512,
    "optimizer": "sgd", "lr": 0.01, "momentum": 0.0, "weight-decay": 0.0, "grad-clip": 0.0,
    "optimizer-state": "keep", "batch-size": 10, "local-epochs": 1, "local-steps": 0,
    "drop-last": True, "batch-order": "fixed", "fraction-fit": 1.0, "eval-every": 1,
}
# Each method's own hyperparameters at HtFLlib's defaults: FedProto's lamda 1 (ours too);
# FedGH's server trains the header for server_epochs = 100 epochs of SGD (lr 0.01) over one
# shuffled DataLoader of every client's (prototype, label) pairs in batches of batch_size = 10.
METHODS: dict[str, dict[str, Any]] = {
    "standalone": {},
    "lg-fedavg": {},
    "fedgh": {"fedgh.server-lr": 0.01, "fedgh.server-epochs": 100,
              "fedgh.server-batch-size": 10, "fedgh.client-order": "pooled"},
    "fedproto": {"fedproto.lambda": 1.0},
    # The same with HtFLlib's prototypes: the means of the representations its training steps
    # computed (clientproto.py), averaged over the clients unweighted (serverproto.py).
    "fedproto-during-training": {"method": "fedproto", "fedproto.lambda": 1.0,
                                 "fedproto.prototypes": "during-training",
                                 "fedproto.average": "uniform"},
    # FD (HtFLlib 728e52a's FedDistill): lamda 1; the soft target is the softmax of the
    # averaged logits (clientdistill.py:52); every sender's row is averaged, the client's own
    # included (serverdistill.py:88); a class without global logits targets the client's own.
    "fd": {"fd.lambda": 1.0, "fd.exclude-own": False, "fd.raw-target": False,
           "fd.self-target": True, "fd.history": "round"},
    # FedTGP: lamda 1, server_epochs 100, margin 100; the server's lr and batch are the
    # clients' -lr and -lbs (servertgp.py:28-31); prototypes of the model before the round's
    # training (clienttgp.py:60-61).
    "fedtgp": {"fedtgp.lambda": 1.0, "fedtgp.eval-rule": "nearest-prototype",
               "fedtgp.server-epochs": 100, "fedtgp.server-lr": 0.01,
               "fedtgp.server-batch-size": 10, "fedtgp.margin": 100.0,
               "fedtgp.pre-training-prototypes": True},
    # FML: the shared (meme) model is the family's first (BaseHeadSplit(args, 0)), averaged
    # uniformly; alpha = beta = 1 (no mutual term); each model clipped at 10 (clientfml.py).
    "fml": {"fml.shared-arch": "htfllib-cnn-c1", "fml.average": "uniform", "fml.alpha": 1.0,
            "fml.beta": 1.0, "fml.detach-partner": False, "fml.kl": "mean", "grad-clip": 10.0},
    # FedKD: T_start 0.95, T_end 0.98, mentee lr 0.01, the mentee's weights as SVD factors
    # each way with HtFLlib's rank search and loss, uniform average, clipping at 10.
    "fedkd": {"fedkd.shared-arch": "htfllib-cnn-c1", "fedkd.average": "uniform",
              "fedkd.energy-start": 0.95, "fedkd.energy-end": 0.98, "fedkd.mentee-lr": 0.01,
              "fedkd.compress": "weights", "fedkd.rank-rule": "htfllib",
              "fedkd.htfllib-loss": True, "fedkd.kl": "mean", "grad-clip": 10.0},
    # FedMRL: psi is the family's first model pooled to -sfd 128 (BaseHeadSplit(args, 0, 128)),
    # averaged uniformly; the projector is never saved; clients are tested with the server's psi.
    "fedmrl": {"fedmrl.shared-arch": "htfllib-cnn-c1", "fedmrl.shared-dim": 128,
               "fedmrl.shared-reduce": "pool", "fedmrl.average": "uniform",
               "fedmrl.keep-projector": False, "fedmrl.eval-shared": "global"},
    # FedGen: -nd 512, -hd 512, uniform noise, per-client sample weights, no diversity term, a
    # constant client-term weight 1; its server's trained generator is never kept
    # (servergen.py:112), so -glr 0.005 and -se 100 are written down but change nothing.
    "fedgen": {"fedgen.noise-dim": 512, "fedgen.hidden-dim": 512, "fedgen.noise": "uniform",
               "fedgen.teacher-weights": "samples", "fedgen.diversity": 0.0,
               "fedgen.client-weight": 1.0, "fedgen.client-weight-decay": 1.0,
               "fedgen.server-lr": 0.005, "fedgen.server-steps": 100,
               "fedgen.server-batch-size": 0, "fedgen.keep-generator": False},
    # FedL2G (HtFLlib e959261, -algo FedL2G-feat -wu 0: its warm-up of 50 rounds would take
    # the whole run): one study and one quiz batch, the quiz set the first 10 stored samples,
    # server step 0.01 (main.py's -slr), clipping at 100 (clientl2g_feat.py:53).
    "fedl2g": {"fedl2g.variant": "feat", "fedl2g.warmup-fraction": 0.0,
               "fedl2g.study-batches": 1, "fedl2g.quiz-batches": 1, "fedl2g.quiz-set": "first",
               "fedl2g.server-lr": 0.01, "grad-clip": 100.0},
}
# FedProto (HtFLlib's prototypes), FedTGP, FedGen, FedKD and FedL2G again with HtFLlib's initial
# weights: it re-seeds torch with the same seed in every client's constructor
# (clientbase.py:20), so the clients of an architecture start alike.
METHODS["fedproto-shared-init"] = {**METHODS["fedproto-during-training"],
                                   "model-init": "per-architecture"}
METHODS["fedtgp-shared-init"] = {"method": "fedtgp", **METHODS["fedtgp"],
                                 "model-init": "per-architecture"}
METHODS["fedgen-shared-init"] = {"method": "fedgen", **METHODS["fedgen"],
                                 "model-init": "per-architecture"}
METHODS["fedkd-shared-init"] = {"method": "fedkd", **METHODS["fedkd"],
                                "model-init": "per-architecture"}
METHODS["fedl2g-shared-init"] = {"method": "fedl2g", **METHODS["fedl2g"],
                                 "model-init": "per-architecture"}
# FedTGP again with HtFLlib's prototype pass as well: its collect_protos reads the training
# loader (drop_last=True), so each client's prototypes leave out the short last batch.
METHODS["fedtgp-htfllib-prototypes"] = {**METHODS["fedtgp-shared-init"],
                                        "class-means-drop-last": True}
# FedTGP with HtFLlib's server randomness as well: its TGP's start and its shuffles come from
# torch's global stream, which its last client re-seeds with 0 (clienttgp.py:13), so they are
# the same in every run of the peer, whatever its seed; only the clients' starts differ.
METHODS["fedtgp-one-server-seed"] = {**METHODS["fedtgp-shared-init"], "fedtgp.server-seed": 0}
# FedGen with HtFLlib's round 0: its server reads every client's labels at start-up, so its
# clients use the (untrained) generator from their first training on.
METHODS["fedgen-startup-labels"] = {"method": "fedgen", **METHODS["fedgen"],
                                    "fedgen.label-pool": "partition"}
# FedL2G from HtFLlib's guide: its server builds nn.Embedding after its last client re-seeds
# torch with 0, so every run of it starts from the same guiding vectors, those of guide-seed 0.
METHODS["fedl2g-htfllib-guide"] = {"method": "fedl2g", **METHODS["fedl2g"],
                                   "fedl2g.guide-seed": 0}
# FedKD with HtFLlib's factors: each 5x5 kernel of a convolution factored on its own (one rank
# per layer), factors sent even where larger than the tensor (clientkd.py's decomposition).
METHODS["fedkd-htfllib-codec"] = {"method": "fedkd", **METHODS["fedkd"], "fedkd.codec": "htfllib"}
# Local, FedKD and FedL2G from HtFLlib's whole start: its models are built right after the same
# torch seed, so HCNNs8's models that begin with the same layers begin with the same weights
# (every first convolution alike; c1's Linear 4608 -> 512 is the first rows of c1-1024's, ...)
# and FedKD's mentee (c1) equals the clients of c1 and begins as c1-512, c1-1024, c1-1024-512.
# Paired with the Local of the same start (``local_of``).
SHARED_START = ("standalone", "fedkd", "fedl2g")
for _method in SHARED_START:
    METHODS[f"{_method}-shared-start"] = {"method": _method, **METHODS[_method],
                                          "model-init": "shared"}
# Where HtFLlib measures something else than our headline, the variant that measures what it
# measures (our headline is kept in the last two columns).
VARIANT: dict[str, tuple[str, str]] = {
    "lg-fedavg": ("global-head", "HtFLlib tests each client with the averaged head installed "
                  "(set_parameters before evaluate)"),
    "fedgh": ("global-header", "HtFLlib tests each client with the global header installed"),
    "fedproto": ("nearest-prototype", "HtFLlib predicts the nearest global prototype"),
}
VARIANT["fedproto-during-training"] = VARIANT["fedproto-shared-init"] = VARIANT["fedproto"]

# The peer's side, from its logs (docs/crosscheck.md has its commit and commands): per method,
# HtFLlib's algorithm and, per run, its test accuracy (pooled; full precision from its
# results/*.h5) after the last round
# and its best over the evaluated rounds, and the first run's accuracy after each round
# (``rounds``). HtFLlib seeds torch with 0 in main.py and in every
# client, and its loaders do not shuffle, so a run repeats itself; FedGH's server takes the
# clients in an unseeded random order, so its runs differ (three were made). Where a gap
# asked for the peer's spread, more runs at torch seeds 1, 2 (FedL2G to 4; docs/crosscheck.md).
PEER: dict[str, dict[str, Any]] = {
    # Runs at torch seeds 0, 1, 2 (seeds 1-2 from the copy whose main.py:31 and
    # clientbase.py:20 read the seed from the environment; nothing else changed); Local also
    # at seeds 3, 4, so that FedL2G's runs there pair with it.
    "standalone": {"algorithm": "Local",
                   "last": [0.950077, 0.949849, 0.951162, 0.950420, 0.949049],
                   "best": [0.950077, 0.949849, 0.951162, 0.950420, 0.949049],
                   "rounds": [0.925573, 0.943337, 0.950077]},
    "lg-fedavg": {"algorithm": "LG-FedAvg", "last": [0.944536, 0.945393, 0.945907],
                  "best": [0.944536, 0.945393, 0.945907],
                  "rounds": [0.916890, 0.935397, 0.944536]},
    # Three runs at torch seed 0 (its server's order is unseeded, so they differ).
    "fedgh": {"algorithm": "FedGH", "seeds": [0, 0, 0], "last": [0.858000, 0.830811, 0.859885],
              "best": [0.858799, 0.868167, 0.870338],
              "rounds": [0.804764, 0.858799, 0.858000]},
    # Runs at torch seeds 0, 1, 2 (the seed edited in main.py:31 and clientbase.py:20).
    "fedproto": {"algorithm": "FedProto", "last": [0.842863, 0.846975, 0.815160],
                 "best": [0.842863, 0.846975, 0.815160],
                 "rounds": [0.628206, 0.786428, 0.842863]},
    "fd": {"algorithm": "FedDistill", "last": [0.952076], "best": [0.952076],
           "rounds": [0.925573, 0.943565, 0.952076]},
    # Runs at torch seeds 0, 1, 2: 0.409 / 0.465, 0.231 / 0.108 and 0.324 / 0.491 after
    # rounds 1 / 2; the first two both 0.900954 after round 3 (15,773 correct of 17,507, spread
    # differently: ``correct``, from the per-client accuracies its log prints, times each
    # client's test samples).
    "fedtgp": {"algorithm": "FedTGP", "last": [0.900954, 0.900954, 0.832467],
               "best": [0.900954, 0.900954, 0.832467],
               "rounds": [0.408979, 0.464786, 0.900954],
               "correct": [[15, 54, 196, 624, 351, 1369, 1024, 487, 1217, 751, 1509, 1588, 2038,
                            87, 312, 2, 648, 1186, 1233, 1082],
                           [12, 33, 195, 624, 352, 1369, 1070, 481, 1214, 780, 1515, 1586, 2032,
                            90, 319, 2, 609, 1187, 1235, 1068],
                           [9, 58, 193, 0, 328, 1369, 1020, 495, 1213, 761, 1505, 1582, 2046,
                            53, 273, 0, 622, 1186, 1170, 691]]},
    # Runs at torch seeds 0, 1, 2; ``correct`` from the per-client accuracies its log prints.
    "fedkd": {"algorithm": "FedKD", "last": [0.949106, 0.948421, 0.949220],
              "best": [0.949106, 0.948421, 0.949220],
              "rounds": [0.921574, 0.941966, 0.949106],
              "correct": [[17, 62, 204, 624, 350, 1369, 1081, 934, 1243, 842, 1516, 1653, 2049,
                           90, 322, 37, 668, 1187, 1248, 1120],
                          [17, 61, 204, 624, 350, 1369, 1081, 929, 1242, 839, 1515, 1655, 2046,
                           90, 324, 37, 668, 1187, 1249, 1117],
                          [17, 63, 204, 624, 350, 1369, 1084, 936, 1246, 840, 1519, 1653, 2047,
                           93, 324, 37, 669, 1187, 1247, 1109]]},
    # Runs at torch seeds 0, 1, 2.
    "fedmrl": {"algorithm": "FedMRL", "last": [0.921574, 0.942080, 0.940424],
               "best": [0.921574, 0.942080, 0.940424],
               "rounds": [0.888330, 0.886560, 0.921574]},
    "fml": {"algorithm": "FML", "last": [0.950306], "best": [0.950306],
            "rounds": [0.925630, 0.943337, 0.950306]},
    "fedgen": {"algorithm": "FedGen", "last": [0.946878, 0.946079, 0.948249],
               "best": [0.946878, 0.946079, 0.948249],
               "rounds": [0.918547, 0.936997, 0.946878]},
    # At e959261 with HCNNs8 put back (docs/crosscheck.md); the others at 728e52a.
    # Runs at torch seeds 0-4; ``correct`` as for FedKD.
    "fedl2g": {"algorithm": "FedL2G-feat",
               "last": [0.950191, 0.949335, 0.951334, 0.950420, 0.948021],
               "best": [0.950191, 0.949335, 0.951334, 0.950420, 0.948021],
               "rounds": [0.922888, 0.942652, 0.950191],
               "correct": [[17, 63, 202, 624, 347, 1369, 1086, 925, 1254, 840, 1516, 1653, 2049,
                            90, 320, 37, 674, 1187, 1248, 1134],
                           [17, 61, 203, 626, 345, 1369, 1086, 921, 1249, 842, 1515, 1653, 2050,
                            90, 323, 37, 672, 1187, 1246, 1128],
                           [17, 63, 202, 624, 350, 1369, 1086, 929, 1261, 843, 1515, 1655, 2048,
                            94, 323, 37, 672, 1187, 1246, 1134],
                           [17, 63, 203, 624, 349, 1369, 1086, 925, 1256, 844, 1515, 1655, 2046,
                            92, 322, 37, 671, 1187, 1246, 1132],
                           [17, 61, 203, 624, 350, 1369, 1085, 890, 1256, 836, 1516, 1651, 2043,
                            88, 323, 37, 669, 1187, 1249, 1143]]},
}
PEER["fedproto-during-training"] = PEER["fedproto-shared-init"] = PEER["fedproto"]
PEER["fedtgp-shared-init"] = PEER["fedtgp-htfllib-prototypes"] = PEER["fedtgp"]
PEER["fedtgp-one-server-seed"] = PEER["fedtgp"]
PEER["fedgen-shared-init"] = PEER["fedgen-startup-labels"] = PEER["fedgen"]
PEER["fedkd-htfllib-codec"] = PEER["fedkd-shared-init"] = PEER["fedkd"]
PEER["fedl2g-shared-init"] = PEER["fedl2g-htfllib-guide"] = PEER["fedl2g"]
for _method in SHARED_START:
    PEER[f"{_method}-shared-start"] = PEER[_method]


def local_of(method: str) -> str | None:
    """The Local row that starts as ``method``'s row does (the same ``model-init``), which its
    runs pair with; None if there is none."""
    init = METHODS[method].get("model-init")
    return next((name for name, overrides in METHODS.items()
                 if overrides.get("method", name) == "standalone"
                 and overrides.get("model-init") == init), None)


def test_sizes(data_dir: Path) -> dict[str, int]:
    """Each client's test samples in the generator's files (what pooled accuracy weighs by)."""
    from fedapp.data.files import load_file_dataset
    return {str(k): len(test) for k, (_, test) in
            enumerate(load_file_dataset("federation", str(data_dir)).clients)}


def pooled(per_client: Mapping[str, float], test_sizes: Mapping[str, int]) -> float:
    """Correct predictions over all clients' test samples (HtFLlib's test accuracy)."""
    correct = sum(acc * test_sizes[k] for k, acc in per_client.items())
    return correct / sum(test_sizes[k] for k in per_client)


def measures(out: Path, run_name: str, variant: str | None,
             sizes: Mapping[str, int]) -> dict[str, float]:
    """One run's accuracies (from its folder, else its record): pooled and per-client mean
    after the last round, best pooled over the evaluated rounds — of the headline, or of
    ``variant`` where given."""
    summary = json.loads(finished(out, run_name).read_text())

    def per_client(record: Mapping[str, Any]) -> Mapping[str, float]:
        return record["variants"][variant]["per_client"] if variant else record["per_client"]

    rounds = [h for h in summary["history"] if h["per_client"]]
    last = per_client(rounds[-1])
    curve = [pooled(per_client(h), sizes) for h in rounds]
    return {"pooled": curve[-1], "mean": float(np.mean(list(last.values()))),
            "best": max(curve), "rounds": curve, "last": last, "sizes": sizes}


def one_client(method: str, peer: Mapping[str, Any], as_peer: list[dict[str, Any]]) -> str:
    """Where the peer's per-client results are known: the client that moves the pooled
    difference most, both sides' accuracy of it, and both sides pooled without it."""
    sizes = as_peer[0]["sizes"]
    theirs = [{str(k): c / sizes[str(k)] for k, c in enumerate(run)} for run in peer["correct"]]
    ours = [m["last"] for m in as_peer]
    gap = {k: sizes[k] * abs(np.mean([o[k] for o in ours]) - np.mean([t[k] for t in theirs]))
           for k in sizes}
    worst = max(gap, key=gap.get)
    rest = {k: n for k, n in sizes.items() if k != worst}

    def without(runs: list[Mapping[str, float]]) -> str:
        return cell([pooled({k: r[k] for k in rest}, rest) for r in runs])

    return (f"| {method} | {worst} ({sizes[worst]}) | "
            + ", ".join(f"{t[worst]:.3f}" for t in theirs) + " | "
            + ", ".join(f"{o[worst]:.3f}" for o in ours)
            + f" | {without(theirs)} | {without(ours)} |")


def standard_error(peer: list[float], ours: list[float]) -> float:
    """The standard error of the difference of the two sides' means (Welch's): 0 where a side
    has a single run, whose variation is unknown."""
    if len(peer) < 2 or len(ours) < 2:
        return 0.0
    return float(np.sqrt(np.var(peer, ddof=1) / len(peer) + np.var(ours, ddof=1) / len(ours)))


def peer_seeds(peer: Mapping[str, Any]) -> list[int]:
    """The torch seed of each of the peer's runs: 0, 1, ... in order unless it says."""
    return peer.get("seeds", list(range(len(peer["last"]))))


def paired(method: str, peer: Mapping[str, Any], as_peer: list[dict[str, float]],
           seeds: list[int], out: Path, sizes: Mapping[str, int]) -> str | None:
    """Each run minus Local at the same seed and start (``local_of``), on each side: a run and
    its Local share initial weights and batches, so the differences keep the method's effect
    and lose most of the initial weights' lottery. None where a side has no Local at its
    seeds."""
    local = PEER["standalone"]
    theirs = [last - local["last"][s] for last, s in zip(peer["last"], peer_seeds(peer))
              if s < len(local["last"])]
    ours = []
    for seed, m in zip(seeds, as_peer):
        run = f"{local_of(method)}-{ROUNDS}-rounds-seed{seed}"
        if finished(out, run):
            ours.append(m["pooled"] - measures(out, run, None, sizes)["pooled"])
    if not theirs or not ours:
        return None
    difference = float(np.mean(ours) - np.mean(theirs))
    error = standard_error(theirs, ours)
    return (f"| {method} | {signed_cell(theirs)} | {signed_cell(ours)} | {difference:+.4f} | "
            + (f"{difference / error:+.1f} |" if error else "— |"))


def signed_cell(values: list[float]) -> str:
    mean, std = mean_std(values)
    return (f"{mean:+.4f} ± {std:.4f} ({len(values)})" if len(values) > 1
            else f"{mean:+.4f} (one run)")


def cell(values: list[float]) -> str:
    mean, std = mean_std(values)
    return f"{mean:.4f} ± {std:.4f}" if len(values) > 1 else f"{mean:.4f} (one run)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True,
                        help="the folder PFLlib's generator wrote (config.json, train/, test/)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                        help="these rows only, written as a part of docs/crosscheck.md of its "
                        "own (the table of every row is left as it is)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"rounds (default {ROUNDS}, the peer's run; another count "
                        "leaves its columns out)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--existing", action="store_true",
                        help="run nothing: tabulate the runs already made, each method at those "
                        "of --seeds it has (a method with none is left out of the table)")
    args = parser.parse_args()
    data_dir = args.data_dir.resolve()
    if not (data_dir / "config.json").exists():
        raise SystemExit(f"{data_dir} has no config.json: give the folder PFLlib's generator "
                         "wrote (docs/crosscheck.md says how to make it)")

    sizes, out = test_sizes(data_dir), args.out.resolve()
    rows, curves, clients, pairs, left_out = [], [], [], [], []
    for method in args.methods:
        name = f"{method}-{args.rounds}-rounds"
        seeds = args.seeds
        if args.existing:
            seeds = [s for s in seeds if finished(out, f"{name}-seed{s}")]
            if not seeds:
                left_out.append(method)
                continue
            for s in seeds:  # where they were made, for the table's provenance line
                record(out, f"{name}-seed{s}", provenance(made_here=False))
        else:
            run_seeds(None, {**WORK, "num-server-rounds": args.rounds,
                             "data-dir": str(data_dir), "method": method, **METHODS[method]},
                      name, seeds, out)
        runs = [f"{name}-seed{s}" for s in seeds]
        ours = [measures(out, r, None, sizes) for r in runs]
        variant, why = VARIANT.get(method, (None, ""))
        as_peer = [measures(out, r, variant, sizes) for r in runs] if variant else ours
        peer = PEER.get(method) if args.rounds == ROUNDS else None
        peer_last = peer["last"] if peer else []
        p_mean, p_std = mean_std(peer_last) if peer_last else (float("nan"), float("nan"))
        o_mean, o_std = mean_std([m["pooled"] for m in as_peer])
        spread = (f"{max(p_std, o_std):.4f}" if len(peer_last) > 1 or len(seeds) > 1
                  else "—")
        error = standard_error(peer_last, [m["pooled"] for m in as_peer])
        in_errors = f"{(o_mean - p_mean) / error:+.1f}" if peer and error else "—"
        rows.append(
            f"| {method} | {' '.join(map(str, seeds))} | {cell(peer_last) if peer else '—'} "
            f"| {cell([m['pooled'] for m in as_peer])}{' (' + variant + ')' if variant else ''} "
            f"| {f'{o_mean - p_mean:+.4f}' if peer else '—'} | {spread} | {in_errors} "
            f"| {cell(peer['best']) if peer else '—'} | {cell([m['best'] for m in as_peer])} "
            f"| {cell([m['pooled'] for m in ours])} | {cell([m['mean'] for m in ours])} |")
        ours_curve = np.mean([m["rounds"] for m in as_peer], axis=0)
        curves.append(f"| {method} | " + " | ".join(
            (f"{p:.4f}" if peer else "—") + f" / {o:.4f}"
            for p, o in zip(peer["rounds"] if peer else ours_curve, ours_curve)) + " |")
        if peer and "correct" in peer:
            clients.append(one_client(method, peer, as_peer))
        # A row pairs with the Local that starts as it does, where there is one.
        if peer and local_of(method) not in (None, method) \
                and (row := paired(method, peer, as_peer, seeds, out, sizes)):
            pairs.append(row)
        if why:
            print(f"[crosscheck] {method}: compared as the peer measures it: {why}")

    seeds = " ".join(map(str, args.seeds))
    # In METHODS' order, so that the same rows always write the same part of the doc.
    rows_only = ("" if set(args.methods) == set(METHODS)
                 else " --methods " + " ".join(m for m in METHODS if m in args.methods))
    lines = [
        f"Produced by `.venv/bin/python {SCRIPT} --data-dir <the generator's folder>"
        + rows_only + ("" if args.seeds == [0, 1, 2] else f" --seeds {seeds}")
        + ("" if args.rounds == ROUNDS else f" --rounds {args.rounds}")
        + (" --existing" if args.existing else "")
        + f"` (ours at the seeds of the column \"our seeds\"); the peer's columns are taken "
        "from HtFLlib's logs "
        "(below). Test accuracy after the last of "
        f"{args.rounds} rounds, mean ± std over our seeds and over the peer's runs (one per "
        "method where a run repeats itself: see below); pooled = correct over all clients' test "
        "samples, as HtFLlib computes it; in brackets the variant of ours measured as HtFLlib "
        "measures.", "",
        "| method | our seeds | HtFLlib, last round | ours, as HtFLlib measures | difference | "
        "larger seed std | difference in standard errors | HtFLlib, best round | "
        "ours, best round | ours, headline pooled | ours, per-client mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|", *rows, "",
        "The standard error of a difference is sqrt(s_1^2 / n_1 + s_2^2 / n_2), s the sample "
        "std (n − 1) of each side's runs: a difference within about two of them is what the "
        "runs' own variation gives at these numbers of runs; \"—\" where a side has one run.",
        "",
        *([f"Not run here yet: {', '.join(left_out)}.", ""] if left_out else []),
        *(["Paired with Local: each run's accuracy (as HtFLlib measures) minus Local's at the "
           "same seed on the same side, whose run shares its initial weights and its batches; "
           "mean ± std over the runs (how many in brackets) and the difference of the two "
           "sides in standard errors. The peer's Local ran at torch seeds 0-4, so its runs "
           "at those seeds pair.", "",
           "| method | HtFLlib: method − Local | ours: method − Local | difference | "
           "in standard errors |", "|---|---|---|---|---|", *pairs, ""] if pairs else []),
        "After each round, HtFLlib (its first run) / ours (mean over our seeds), measured as "
        "HtFLlib measures:", "",
        "| method | " + " | ".join(f"round {r}" for r in range(1, args.rounds + 1)) + " |",
        "|---|" + "---|" * args.rounds, *curves,
        *(["", "Where HtFLlib's log gives each client's accuracy: the client that moves the "
            "difference most (its test samples in brackets), its accuracy in each run, and the "
            "pooled accuracy of the other clients:", "",
            "| method | client | HtFLlib's runs | our seeds | HtFLlib without it | "
            "ours without it |", "|---|---|---|---|---|---|", *clients] if clients else [])]
    # Some rows only: their own part of the doc, so that the table of every row stays whole.
    write_generated(DOC, SCRIPT + rows_only, "\n".join(lines))
    print(f"[reproduce] wrote {DOC}" + (f" (the part of{rows_only})" if rows_only else ""))


if __name__ == "__main__":
    main()
