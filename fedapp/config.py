"""The typed run configuration and its validation.

Every setting of a run lives in ``[tool.flwr.app.config]`` of ``pyproject.toml`` with its
default; presets in ``conf/`` override a few of them. Flower hands the merged flat dict to the
ServerApp and ClientApp as ``context.run_config``; :func:`parse_run_config` turns it into a
frozen :class:`RunConfig` and refuses a bad value before any training, naming the key, the value
and what is allowed.

Method-specific settings are namespaced (``fedgh.server-lr``) and declared and validated by each
method's settings dataclass (in its folder's card, ``strategies/<method>/__init__.py``); this
module only knows the shared ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = PROJECT_ROOT / "conf"


# The run-config key that carries a user's method's own settings through Flower (RunConfig).
METHOD_SETTINGS_KEY = "method-settings"


class ConfigError(ValueError):
    """A run setting is missing, of the wrong type or outside what is allowed."""


def client_cache_budget() -> int:
    """Bytes each of a client process's two caches (built models, shards on the device) may
    hold: ``FEDAPP_CLIENT_CACHE_MIB`` MiB (default 1024). Both sit on the clients' device, and
    every actor keeps its own, so several simulated clients sharing a small GPU may need less.
    Read where the caches are made, and by ``fedapp run`` before it starts anything."""
    value = os.environ.get("FEDAPP_CLIENT_CACHE_MIB", "1024")
    try:
        mib = float(value)
    except ValueError:
        mib = -1.0
    if not (math.isfinite(mib) and mib >= 0):
        raise ConfigError(f"FEDAPP_CLIENT_CACHE_MIB must be a number of MiB >= 0; got {value!r}")
    return int(mib * 2**20)


def _opt(default: Any, help: str, *, choices: tuple | None = None, low: float | None = None,
         high: float | None = None, low_open: bool = False, key: str | None = None) -> Any:
    """A dataclass field with the validation rule kept beside it (``key``: the run-config
    name when it is not the field name with dashes, e.g. ``lambda``, a Python keyword)."""
    return field(default=default, metadata={
        "help": help, "choices": choices, "low": low, "high": high, "low_open": low_open,
        "key": key})


opt = _opt  # for the methods' own settings classes (see ``parse_settings``)


# Attacks a simulation can make its malicious clients run (fedapp.runtime.attacks).
ATTACKS = ("none", "label-flip", "sign-flip", "scale", "noise", "targeted", "collude")
# Robust aggregation rules, and which kinds of payload each applies to: a method's card names
# the kinds its server aggregates (``Method.payload_kinds``), and a rule that fits none of
# them is refused before the run (``strategies.load_config``).
ROBUST_RULES = ("none", "median", "trimmed-mean", "krum", "multi-krum", "geomed", "norm-bound")
MODEL_RULES = ROBUST_RULES[1:]
PAYLOAD_KINDS: dict[str, tuple[tuple[str, ...], str]] = {
    # kind: (the rules that apply, why the others do not)
    "model": (MODEL_RULES, ""),
    "group-model": (MODEL_RULES, ""),
    "class-rows": (("median", "trimmed-mean", "geomed"),
                   "per-class rows (prototypes, logits) are combined per class over the "
                   "clients that hold the class, a handful under label skew, so only "
                   "coordinate-wise and geometric medians apply; Krum and norm bounding need "
                   "whole uploads of one shape and a current state to measure them against"),
    # The server trains a model of its own on the individual (row, label) pairs: each rule
    # decides, per label, which rows it trains on (fedapp.runtime.aggregate.filter_pairs).
    "server-training": (MODEL_RULES, ""),
    # The server distils from each individual upload of one layout (FedGen's heads, FedDF's
    # models within each architecture) and averages them: each rule decides which uploads
    # it keeps (fedapp.runtime.aggregate.filter_uploads, through FedStrategy.teachers).
    "teachers": (MODEL_RULES, ""),
    "group-teachers": (MODEL_RULES, ""),
    # The same filter of soft predictions (KT-pFL's), which each client's target mixes.
    "teacher-predictions": (("median", "trimmed-mean", "krum", "multi-krum", "geomed"),
                            "the rule filters the uploaded soft predictions, and norm "
                            "bounding would move a table of probability vectors towards its "
                            "coordinate-wise median, whose rows do not sum to 1: every "
                            "client's target must stay a probability vector"),
    "server-distillation": ((), "the server trains on per-sample maps of each client's own "
                            "stem with that client's logits: maps of different clients lie in "
                            "spaces of their own and one client sends every sample it holds of "
                            "each label, so "
                            "there is no average to make robust and no upload or (row, label) "
                            "pair a distance could single out"),
    # Each coordinate of the global model is combined over the clients whose slice or prefix
    # holds it (fedapp.runtime.aggregate.held_coordinates).
    "sub-model": (("median", "trimmed-mean"),
                  "each entry of the global model is combined over the clients whose "
                  "sub-model (a width slice or a depth prefix) holds it, a different set of "
                  "clients per entry, so only coordinate-wise rules apply; Krum, the geometric "
                  "median and norm bounding need whole uploads of one shape"),
}


@dataclass(frozen=True)
class UploadLayout:
    """Where a method's upload holds one row per class, for what acts on every method's upload
    alike (the attacks of ``fedapp.runtime.attacks``). A card declares it
    (``Method.upload_layout``); the default says: no per-class rows, nothing tied."""

    labels: str = ""               # int array [S]: the class of each row of ``rows``
    rows: tuple[str, ...] = ()     # float arrays [S, ...] whose row i is of class labels[i]
    logits: tuple[str, ...] = ()   # those of ``rows`` whose columns are the classes
    class_in_name: str = ""        # or: one array per class, this regex's group 1 its class
    simplex: tuple[str, ...] = ()  # probability vectors along the last axis (FedRE's mix
                                   # weights, DS-FL's and KT-pFL's predictions): value attacks
                                   # act on their logarithm and put them back on the simplex

    @property
    def per_class(self) -> bool:
        return bool(self.rows or self.class_in_name)


@dataclass(frozen=True)
class RunConfig:
    """Shared settings of one run. Field ``foo_bar`` is the run-config key ``foo-bar``."""

    # -- what runs
    method: str = _opt("fedgh", "federated method (see `fedapp methods`), or a method folder "
                       "of your own by import path, e.g. 'mypkg.mymethod' (docs/usage.md)")
    method_packages: str = _opt(
        "", "packages of your own whose method folders join the built-in methods, "
        "comma-separated: `fedapp methods` lists them as 'package.folder' and their settings "
        "are checked with ours (a method named by import path needs no entry here)")
    method_settings: str = _opt(
        "", "the own settings of methods given by import path, as a JSON object "
        "{\"mypkg.mymethod.key\": value}: Flower's run config carries only the app's own keys, "
        "so `fedapp run` packs such settings (from presets and --set) here")
    num_server_rounds: int = _opt(20, "number of federated rounds", low=1)
    num_clients: int = _opt(10, "number of clients (simulation: SuperNodes)", low=1)
    fraction_fit: float = _opt(1.0, "fraction of clients sampled for training each round",
                               low=0.0, high=1.0, low_open=True)
    min_fit_clients: int = _opt(1, "lower bound on clients sampled per round", low=1)
    seed: int = _opt(0, "seed of every random stream (data split, models, batches)", low=0)
    # -- data
    dataset: str = _opt("fmnist", "dataset ('npz', 'imagefolder', 'federation': a user's own "
                        "files in data-dir, see docs/data.md)", choices=(
        "fmnist", "mnist", "cifar10", "cifar100", "emnist-letters", "synthetic", "npz",
        "imagefolder", "federation"))
    data_dir: str = _opt("", "directory holding the dataset files ('' = the default place)")
    image_size: int = _opt(0, "imagefolder: resize every image to this square size (0 = keep)",
                           low=0)
    download: bool = _opt(False, "let torchvision download a missing dataset (needs internet)")
    synthetic_shape: str = _opt("1,28,28", "synthetic input shape 'C,H,W'")
    synthetic_classes: int = _opt(10, "synthetic number of classes", low=2)
    synthetic_train: int = _opt(2000, "synthetic training samples", low=1)
    synthetic_test: int = _opt(500, "synthetic test samples", low=1)
    # -- a public set, for the methods that distil on shared data (FedMD): held by every party,
    #    messages name its samples by index (docs/data.md, "A public set")
    public_source: str = _opt(
        "none", "where the public set comes from: 'none'; 'train-holdout' (a seeded, "
        "stratified public-fraction of the training split, cut before partitioning, so no "
        "client trains or tests on it); 'digits' (scikit-learn's bundled 8x8 digits upsampled "
        "to 28x28, for 1x28x28 private data; needs scikit-learn); 'npz' (your own file, "
        "public-file)", choices=("none", "train-holdout", "digits", "npz"))
    public_fraction: float = _opt(
        0.1, "train-holdout: share of the training split that becomes the public set, in "
        "(0, 1) (the FedHe and Felo papers' FedMD: about 10%)", low=0.0, high=1.0,
        low_open=True)
    public_file: str = _opt(
        "", "npz: absolute path of an .npz file with x (N, C, H, W) or (N, H, W), float or "
        "uint8, and optionally y (N,) integer labels")
    public_labels: str = _opt(
        "method", "whether a method may read the public set's labels: 'method' = as its "
        "paper does (`fedapp methods` says which), 'labelled' or 'unlabelled'",
        choices=("method", "labelled", "unlabelled"))
    # -- partition
    partition: str = _opt("dirichlet", "how the training set is split over clients ('files': "
                          "as a federation's per-client files say)", choices=(
        "iid", "dirichlet", "pathological", "two-class", "fixed-size", "files"))
    dirichlet_alpha: float = _opt(0.5, "Dirichlet concentration (smaller = more skewed)",
                                  low=0.0, low_open=True)
    min_partition_size: int = _opt(10, "Dirichlet: minimum training samples per client", low=0)
    classes_per_client: int = _opt(2, "pathological / two-class / fixed-size: classes per client",
                                   low=1)
    samples_per_client: int = _opt(500, "fixed-size: training samples per client", low=1)
    two_class_with_replacement: bool = _opt(
        False, "two-class: sample with replacement as FedClassAvg's code does")
    max_samples_per_client: int = _opt(600, "cap on training samples per client (0 = none)", low=0)
    local_test: str = _opt("global", "where a client's test set comes from",
                           choices=("global", "split"))
    test_fraction: float = _opt(0.2, "local test size relative to the local training size",
                                low=0.0, high=1.0, low_open=True)
    val_fraction: float = _opt(0.0, "validation held out of the local training data",
                               low=0.0, high=0.9)
    label_permutation: bool = _opt(False, "give each client its own random label ids")
    # -- models
    arch_mix: str = _opt("cnn1,cnn2,cnn3,cnn4,cnn5", "comma-separated architectures")
    arch_assignment: str = _opt("round-robin", "how architectures are given to clients",
                                choices=("round-robin", "blocks", "random"))
    feature_dim: int = _opt(500, "shared representation dimension d (0 = each model's own)",
                            low=0)
    model_width: float = _opt(1.0, "channel width multiplier", low=0.0, low_open=True)
    model_init: str = _opt(
        "per-client", "the private models' initial weights: 'per-client' = a draw of each "
        "client's own, 'per-architecture' = one draw per architecture, shared by its clients "
        "and by a shared model of that architecture (FML's, FedKD's mentee), and one draw of "
        "each private module (FedKD's W_h, FedMRL's projector) shared by all; 'shared' = the "
        "same and one key for every architecture too, so architectures that begin with the "
        "same layers begin with the same weights (HtFLlib re-seeds torch with the same seed "
        "in every client's constructor and before building a shared model)",
        choices=("per-client", "per-architecture", "shared"))
    # -- local training (the recipe: a method's own values replace these defaults for every
    #    key the run does not set, see RECIPE_KEYS and docs/recipes.md)
    local_epochs: int = _opt(1, "local epochs per round (when local-steps = 0)", low=1)
    local_steps: int = _opt(
        0, "mini-batches per client update, drawn at random (FedHe's paper: 3); 0 = "
        "local-epochs full passes over the local data", low=0)
    batch_size: int = _opt(64, "local mini-batch size", low=1)
    optimizer: str = _opt("sgd", "local optimizer", choices=("sgd", "adam"))
    lr: float = _opt(0.01, "local learning rate", low=0.0, low_open=True)
    momentum: float = _opt(0.9, "SGD momentum", low=0.0, high=1.0)
    adam_beta1: float = _opt(0.9, "Adam beta1 (optimizer = 'adam')", low=0.0, high=1.0)
    adam_beta2: float = _opt(0.999, "Adam beta2 (optimizer = 'adam')", low=0.0, high=1.0)
    weight_decay: float = _opt(0.001, "L2 weight decay", low=0.0)
    grad_clip: float = _opt(50.0, "gradient-norm clipping (0 = off)", low=0.0)
    lr_decay_at: str = _opt(
        "", "fractions of num-server-rounds after which the learning rate is multiplied by "
        "lr-decay, comma-separated (Felo's code: '0.5' on Fashion-MNIST); '' = constant")
    lr_decay: float = _opt(0.1, "factor applied to the learning rate at each lr-decay-at",
                           low=0.0, high=1.0, low_open=True)
    drop_last: bool = _opt(False, "leave out the short last mini-batch of each pass (as "
                           "FedClassAvg's and FedProto's code do; a pass shorter than one "
                           "batch still trains on it)")
    class_means_drop_last: bool = _opt(
        False, "per-class means a client uploads (FedGH's representations; FedProto's, "
        "FedTGP's and FedRE's prototypes) leave out the short last mini-batch of the data's "
        "stored order, as HtFLlib's collect_protos reads its unshuffled drop_last training "
        "loader; false = over every sample, as the papers")
    batch_order: str = _opt(
        "shuffled", "order of the local data in each pass: 'shuffled' anew every pass, or "
        "'fixed' = the data's own order every pass (HtFLlib's and PFLlib's unshuffled loaders)",
        choices=("shuffled", "fixed"))
    optimizer_state: str = _opt(
        "fresh", "lifetime of a client's optimizer state (momentum buffers, Adam's moments): "
        "'fresh' = a new optimizer for every message, 'keep' = one optimizer for the "
        "client's whole life, its state kept with the private model (never sent)",
        choices=("fresh", "keep"))
    recipe: str = _opt(
        "method", "'method': the chosen method's recipe (its authors' optimizer, lr, steps, "
        "...; `fedapp settings` shows it) replaces the defaults of every training setting "
        "the run does not set; 'none': the defaults for every method", choices=("method", "none"))
    explicit_settings: str = _opt(
        "", "settings set on purpose, which a method's recipe never replaces, as "
        "'key=layer,...' (fedapp run and deploy fill it in; with plain `flwr run` a "
        "setting whose value differs from its default counts as set anyway, so name one here "
        "only to keep its default under a recipe that changes it, e.g. 'optimizer=config')")
    # -- evaluation
    eval_global_test: bool = _opt(False, "also evaluate every client on the global test set")
    global_test_samples: int = _opt(0, "global test subset size (0 = all)", low=0)
    eval_every: int = _opt(
        1, "rounds between evaluations; the last round is always evaluated (other rounds "
        "record training loss and traffic only)", low=1)
    fraction_evaluate: float = _opt(
        1.0, "share of the eligible clients evaluated on an evaluation round, drawn from "
        "(seed, round)", low=0.0, high=1.0, low_open=True)
    eval_clients: str = _opt(
        "all", "who is eligible for evaluation: every client, or only the clients sampled for "
        "training in that round", choices=("all", "participants"))
    # -- robustness against bad uploads
    upload_max_abs: float = _opt(
        1e4, "largest magnitude a float in an upload may have; larger is refused as out of "
        "scale (honest models, representations and logits stay far below it)",
        low=0.0, low_open=True)
    max_num_examples: int = _opt(
        0, "largest training-set size a client with its own data-dir may claim (its weight in "
        "averages); 0 = the size of the run's training set. Clients on the run's partition "
        "must claim exactly their partition's size", low=0)
    round_timeout: float = _opt(
        0.0, "seconds a round waits for its clients' replies; a client that has not answered "
        "by then counts as failed and the round goes on with the others (0 = wait forever)",
        low=0.0)
    max_empty_rounds: int = _opt(
        3, "rounds in a row without a usable update (every client failed or was refused) "
        "after which the run stops and fails; such a round keeps the method's state as it "
        "was and is recorded with empty_round = true (0 = never stop)", low=0)
    partition_nodes: str = _opt(
        "", "deployment: bind partitions to authenticated SuperNodes, 'partition=node-id,...' "
        "(node ids as `fedapp deploy register` prints them); a node may then answer only for "
        "its own partition ('' = partition ids are self-declared)")
    # -- checkpoints
    checkpoint_every: int = _opt(
        0, "rounds between checkpoints of the server's state (clients keep theirs every round "
        "they train); 0 = none. `fedapp run --resume RUN_DIR` continues from the last one",
        low=0)
    resume: bool = _opt(False, "continue the run in output-dir/run-name from its last "
                        "checkpoint (set by `fedapp run --resume`)")
    client_state: str = _opt(
        "memory", "where a client keeps its private model (and a method's other arrays) "
        "between its messages: 'memory' (Flower's context.state) or 'disk' (one file per "
        "client in the run folder's client-state/, read when the client gets a message: "
        "memory then stays flat however many clients a run has; same results)",
        choices=("memory", "disk"))
    # -- faults on purpose, for robustness studies and tests (seeded per client and round)
    fault_crash_fraction: float = _opt(
        0.0, "probability that a client raises instead of training, per client and round",
        low=0.0, high=1.0)
    fault_stall_fraction: float = _opt(
        0.0, "probability that a client stalls fault-stall-seconds before training, per "
        "client and round", low=0.0, high=1.0)
    fault_stall_seconds: float = _opt(60.0, "how long a stalled client stalls", low=0.0)
    # -- attacks on purpose, for robustness studies (simulation; fedapp.runtime.attacks): a
    #    fixed set of malicious clients, drawn from the seed, changes what it uploads
    attack: str = _opt(
        "none", "what the malicious clients do: 'none' (default); 'label-flip' trains on labels y -> C-1-y; "
        "'sign-flip' uploads r - (x - r) and 'scale' r + attack-scale (x - r) for every float "
        "array x of the upload, r being the array of that name the client received (else 0); "
        "'noise' adds N(0, attack-noise-std^2); 'targeted' makes every class's row of a "
        "per-class upload (prototypes, logits) point at class attack-target; 'collude': every "
        "malicious client sends the same crafted upload, r + attack-noise-std N(0, 1) drawn "
        "from (seed, round). Attacked values are clipped to upload-max-abs, so they pass the "
        "server's checks", choices=ATTACKS)
    malicious_fraction: float = _opt(
        0.0, "share of the clients that attack, drawn once from the seed (rounded to the "
        "nearest whole client)", low=0.0, high=1.0)
    malicious_clients: str = _opt(
        "", "the partition ids that attack, comma-separated (instead of malicious-fraction)")
    attack_scale: float = _opt(10.0, "attack = 'scale': the factor on each update", low=0.0)
    attack_noise_std: float = _opt(
        1.0, "attack = 'noise' / 'collude': standard deviation of the noise", low=0.0)
    attack_target: int = _opt(0, "attack = 'targeted': the class every row is pushed to",
                              low=0)
    # -- Byzantine-robust aggregation (fedapp.runtime.aggregate; which method takes which rule:
    #    docs/robustness.md)
    robust_aggregation: str = _opt(
        "none", "how the server combines uploads: 'none' = each method's own average; "
        "'median' / 'trimmed-mean' coordinate-wise (Yin et al. 2018), per class for per-class "
        "rows; 'krum' / 'multi-krum' (Blanchard et al. 2017); 'geomed' = geometric median "
        "(Pillutla et al. 2022); 'norm-bound' = each upload's distance to the current state "
        "clipped to robust-norm-bound before the average. Servers that train on (row, label) "
        "pairs (FedGH, FedRE, FedTGP, Velo) use the rule to filter each label's rows instead, "
        "and those that distil from individual uploads (FedGen, FedDF, KT-pFL) to filter the "
        "uploads",
        choices=ROBUST_RULES)
    robust_trim_fraction: float = _opt(
        0.1, "trimmed-mean: share of the values cut at each end of every coordinate (< 0.5)",
        low=0.0, high=0.5)
    robust_krum_f: int = _opt(
        1, "krum / multi-krum: how many malicious uploads to tolerate (f); Krum needs more "
        "than 2f + 2 uploads, multi-krum averages the n - f best", low=0)
    robust_norm_bound: float = _opt(
        0.0, "norm-bound: the largest L2 distance of an upload to the current state (> 0 "
        "with norm-bound)", low=0.0)
    robust_filter_mads: float = _opt(
        3.0, "median / geomed filtering of the pairs a server trains on (FedGH, FedRE, FedTGP, "
        "Velo) or the uploads it distils from (FedGen, FedDF, KT-pFL): a (row, label) pair or an "
        "upload is dropped when its distance to its label's or group's median exceeds the "
        "median distance by more than this many scaled MADs (Hampel's identifier)",
        low=0.0)
    # -- client-level differential privacy (fedapp.runtime.privacy; what each method protects
    #    and leaks: docs/privacy.md)
    differential_privacy: bool = _opt(
        False, "client-level differential privacy: each client's whole upload is clipped to "
        "L2 norm dp-clip-norm (its change from what it was sent, for arrays it was sent) and "
        "Gaussian noise is added, on the server to the sum for methods whose server only "
        "averages models, on each client for the others; the privacy spent (epsilon at "
        "dp-delta) is recorded every round")
    dp_clip_norm: float = _opt(
        1.0, "differential-privacy: the L2 norm S every client's upload is clipped to",
        low=0.0, low_open=True)
    dp_noise_multiplier: float = _opt(
        1.0, "differential-privacy: z, the noise's standard deviation over the upload's "
        "replace-one sensitivity 2 S (what the accountant's noise multiplier means)",
        low=0.0, low_open=True)
    dp_delta: float = _opt(1e-5, "differential-privacy: the delta epsilon is reported at",
                           low=0.0, high=1.0, low_open=True)
    dp_target_epsilon: float = _opt(
        0.0, "differential-privacy: the privacy budget; the run stops cleanly (summary "
        "written) before a round that would spend more than this epsilon (0 = no budget)",
        low=0.0)
    # -- secure aggregation (Flower's SecAgg+: fedapp.runtime.secure_aggregation; which method
    #    takes it: docs/privacy.md)
    secure_aggregation: bool = _opt(
        False, "uploads reach the server only as their sum, through Flower's SecAgg+ protocol "
        "(its server workflow and client mod): for the methods whose server needs only sums "
        "of the uploads (`fedapp methods`, docs/privacy.md); synchronous rounds only")
    secure_aggregation_shares: float = _opt(
        1.0, "secure-aggregation: share of the round's sampled clients among which each "
        "client's mask secrets are split (its SecAgg+ neighbours; 1 = all of them, the "
        "original SecAgg)", low=0.0, high=1.0, low_open=True)
    secure_aggregation_threshold: float = _opt(
        0.5, "secure-aggregation: share of a client's neighbours whose key shares rebuild its "
        "masks (at least 2). A round goes on while every sampled client keeps that many "
        "neighbours; below it the round ends empty, with a message", low=0.0, high=1.0,
        low_open=True)
    secure_aggregation_timeout: float = _opt(
        0.0, "secure-aggregation: seconds each of the protocol's four exchanges waits for its "
        "replies; a client that has not answered by then drops out (0 = round-timeout, and "
        "with that 0 too, wait forever)", low=0.0)
    # -- the server loop: synchronous rounds, no barrier at all (methods whose server takes
    #    one upload at a time), or device-to-device training that the server only relays (see
    #    `fedapp methods`). The async-* settings serve every loop but 'rounds'.
    server_loop: str = _opt(
        "rounds", "'rounds' (synchronous: every round waits for its clients), 'async' (each "
        "client is sent new work the moment its upload is folded in), 'walk' (device to "
        "device: each architecture's model walks from client to client over the topology) or "
        "'gossip' (device to device: architectures trained one after another, largest first, "
        "by local steps and averaging with neighbours)",
        choices=("rounds", "async", "walk", "gossip"))
    async_concurrency: int = _opt(
        0, "async: most clients training at once (0 = every client)", low=0)
    async_updates: int = _opt(
        0, "async, walk, gossip: client updates in the whole run (0 = num-server-rounds x "
        "num-clients, so that a round means num-clients updates)", low=0)
    async_eval_every: int = _opt(
        0, "async, walk, gossip: committed updates between evaluations of every client (0 = "
        "num-clients); the end of the run is always evaluated", low=0)
    async_retries: int = _opt(
        2, "async, walk, gossip: times a client whose update failed or timed out is sent new "
        "work before it is dropped from the run", low=0)
    async_ttl: float = _opt(
        3600.0, "async, walk, gossip: seconds a message may wait for its reply before it "
        "counts as failed", low=0.0, low_open=True)
    # -- device-to-device loops (walk, gossip): who may talk to whom (fedapp.loops.topology)
    topology: str = _opt(
        "full", "graph of the clients: 'full', 'erdos-renyi' (edge probability topology-p, "
        "re-drawn until connected), 'ring' or 'regular' (random topology-degree-regular)",
        choices=("full", "erdos-renyi", "ring", "regular"))
    topology_p: float = _opt(0.6, "edge probability of the Erdős–Rényi topology (CompFL's "
                             "sparse case: 0.6)", low=0.0, high=1.0, low_open=True)
    topology_degree: int = _opt(3, "degree of the 'regular' topology", low=1)
    walk_forward: float = _opt(
        0.0, "walk: probability that a holder able to train the arriving model forwards it "
        "untrained (a holder that cannot run it always forwards); below 1", low=0.0,
        high=1.0)
    # -- client speeds, to make stragglers visible (both loops)
    clock: str = _opt(
        "virtual", "'virtual': each update takes (speed factor x 1) virtual seconds and the "
        "async loop commits uploads in virtual finish order (reproducible); 'arrival': real "
        "time, a slow client sleeps (factor - 1) x its training time, uploads are taken as "
        "they arrive (what deployment does)", choices=("virtual", "arrival"))
    slow_fraction: float = _opt(
        0.0, "share of clients that are slow, drawn from the seed", low=0.0, high=1.0)
    slowdown: float = _opt(5.0, "how many times slower a slow client is", low=1.0)
    speed_jitter: float = _opt(
        0.0, "spread of each update's duration: log-normal sigma, drawn per (seed, client, "
        "update); 0 = every update of a client takes the same time", low=0.0)
    # -- runtime
    client_num_cpus: int = _opt(1, "simulation: CPUs reserved per virtual client", low=1)
    client_num_gpus: float = _opt(0.0, "simulation: GPU fraction per virtual client", low=0.0)
    deterministic: bool = _opt(
        True, "on a GPU, deterministic kernels, so that one seed gives one result there as on "
        "the CPU (slower); false lets cuDNN pick its fastest, run-to-run varying, kernels")
    wait_for_clients_seconds: int = _opt(
        300, "how long the server waits for num-clients nodes before round 1 (later rounds go "
        "on with those connected, except under differential-privacy)", low=1)
    output_dir: str = _opt("", "absolute results directory ('' = ./results with fedapp run, "
                           "~/fedapp-results with plain flwr run)")
    run_name: str = _opt("", "results sub-folder name ('' = method-dataset-time)")
    tensorboard: bool = _opt(
        False, "also write every round's metrics as TensorBoard scalars in the run folder's "
        "tensorboard/ (needs the tensorboard extra: pip install -e '.[tensorboard]')")
    # -- the chosen method's own settings (``<method>.<key>``), parsed by ``strategies``
    settings: Any = field(default=None, metadata={"internal": True})
    # -- the chosen method's upload layout (its card's ``upload_layout``), set by ``strategies``
    upload_layout: "UploadLayout" = field(default=None, metadata={"internal": True})
    # -- what the chosen method's server combines (its card's ``payload_kinds``), set by
    #    ``strategies``: where differential privacy's noise goes (fedapp.runtime.privacy)
    payload_kinds: tuple = field(default=(), metadata={"internal": True})

    # ----------------------------------------------------------------------------------------
    @property
    def architectures(self) -> list[str]:
        """The arch mix as a list (validated by :func:`parse_run_config`)."""
        return [a.strip() for a in self.arch_mix.split(",") if a.strip()]

    @property
    def lr_decay_fractions(self) -> list[float]:
        """``lr-decay-at`` as a list of fractions (validated by parse_run_config)."""
        return [float(f) for f in self.lr_decay_at.split(",") if f.strip()]

    def lr_factor(self, server_round: int) -> float:
        """What the learning rate is multiplied by in ``server_round``: ``lr-decay`` for each
        milestone of ``lr-decay-at`` the run has passed (Felo's MultiStepLR, driven by the
        round as the code drives it by the server's iterations)."""
        passed = sum(server_round > f * self.num_server_rounds for f in self.lr_decay_fractions)
        return self.lr_decay ** passed

    @property
    def partition_owners(self) -> dict[int, str]:
        """``partition-nodes`` as {partition id: node id} (validated by parse_run_config)."""
        owners = {}
        for item in filter(None, (t.strip() for t in self.partition_nodes.split(","))):
            pid, node = item.split("=")
            if int(pid) in owners:
                raise ValueError(f"partition {pid} bound twice")
            owners[int(pid)] = node.strip()
        return owners

    @property
    def malicious_ids(self) -> list[int]:
        """``malicious-clients`` as a list of partition ids (validated by parse_run_config)."""
        return [int(t) for t in self.malicious_clients.split(",") if t.strip()]

    @property
    def num_malicious(self) -> int:
        """How many clients attack: those named, or malicious-fraction of num-clients rounded
        half up (0.25 of 10 clients: 3)."""
        if self.malicious_clients:
            return len(self.malicious_ids)
        return math.floor(self.malicious_fraction * self.num_clients + 0.5)

    @property
    def shape(self) -> tuple[int, int, int]:
        """The synthetic input shape as a tuple."""
        return tuple(int(v) for v in self.synthetic_shape.split(","))  # type: ignore[return-value]

    def results_root(self) -> Path:
        """The absolute folder under which every run writes its own folder."""
        return Path(self.output_dir) if self.output_dir else Path.home() / "fedapp-results"

    def to_flat(self) -> dict[str, Any]:
        """The shared settings as run-config keys, e.g. for ``config.json``."""
        return {key: getattr(self, f.name) for key, f in SHARED_KEYS.items()}


def default_run_name(method: str, dataset: str) -> str:
    """The run folder's name when ``run-name`` is empty: ``lg-fedavg-fmnist-20261122-141501``."""
    return f"{method}-{dataset}-{time.strftime('%Y%m%d-%H%M%S')}"


def key_of(field_name: str) -> str:
    """Field name -> run-config key (``num_clients`` -> ``num-clients``)."""
    return field_name.replace("_", "-")


def settings_keys(cls: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Run-config key -> field of a settings dataclass (``prefix.key`` for a method's own)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        key = f.metadata.get("key") or key_of(f.name)
        out[f"{prefix}.{key}" if prefix else key] = f
    return out


SHARED_KEYS = settings_keys(RunConfig)

# -- recipes: a layer of defaults between the global defaults and what a run sets ------------
#
# Effective value of a setting = its global default < the chosen method's recipe < a preset <
# --set. A recipe (``strategies.Method.recipe``) may give only these shared keys: how a client
# trains, as its method's authors train it.
RECIPE_KEYS = ("optimizer", "lr", "momentum", "adam-beta1", "adam-beta2", "weight-decay",
               "grad-clip", "lr-decay-at", "lr-decay", "optimizer-state", "batch-size",
               "drop-last", "local-epochs", "local-steps", "feature-dim")


def idle_recipe_keys(values: Mapping[str, Any]) -> set[str]:
    """The recipe keys that the training ``values`` describe does not read: Adam's betas under
    SGD and momentum under Adam, the decay factor when the learning rate never decays, and
    the epochs and the short last batch when a fixed number of random mini-batches
    (``local-steps``) replaces them. Two runs that differ only there train alike."""
    idle = {"sgd": {"adam-beta1", "adam-beta2"}, "adam": {"momentum"}}.get(
        values.get("optimizer"), set())
    if not values.get("lr-decay-at"):
        idle |= {"lr-decay"}
    if values.get("local-steps"):
        idle |= {"local-epochs", "drop-last"}
    return idle


def training_settings(values: Mapping[str, Any],
                      keys: Sequence[str] = RECIPE_KEYS) -> dict[str, Any]:
    """How a client of a run with effective settings ``values`` trains: the ``keys`` (default
    every recipe key) that act, with their values, in ``keys``' order."""
    idle = idle_recipe_keys(values)
    return {k: values[k] for k in keys if k not in idle and k in values}
# Settings that became shared recipe keys: a preset that still names one is told where it went.
MOVED_KEYS = {f"{m}.local-batches": "local-steps" for m in ("fedhe", "felo", "velo")} | {
    "fedclassavg.adam-beta1": "adam-beta1", "fedclassavg.adam-beta2": "adam-beta2",
    "fedclassavg.feature-dim": "feature-dim", "fedclassavg.augment": "fedclassavg.views"}
# Where an explicitly set value came from (``explicit-settings``): a preset file, --set, or a
# plain run config (``flwr run --run-config``).
EXPLICIT_LAYERS = ("preset", "set", "config")


def explicit_layers(text: str) -> dict[str, str]:
    """``explicit-settings`` (``"lr=set,optimizer=preset"``) as {key: layer}; a bare key
    counts as ``config``."""
    layers = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, layer = item.partition("=")
        layer = layer.strip() or "config"
        if layer not in EXPLICIT_LAYERS:
            raise ConfigError(f"setting explicit-settings = {text!r} is invalid: {item!r} names "
                              f"layer {layer!r}; expected one of {', '.join(EXPLICIT_LAYERS)}.")
        layers[key.strip()] = layer
    return layers


def format_explicit(layers: Mapping[str, str]) -> str:
    """The inverse of :func:`explicit_layers`, sorted so that one run config has one text."""
    return ",".join(f"{k}={v}" for k, v in sorted(layers.items()))


def resolve_layers(flat: Mapping[str, Any], method: str, recipe: Mapping[str, Any]
                   ) -> tuple[dict[str, Any], dict[str, str]]:
    """(the effective flat settings, the layer each shared key's value came from).

    A recipe value replaces a training setting unless the run set it: named in
    ``explicit-settings``, or (a plain ``flwr run`` run config, where every key arrives with
    pyproject's value filled in) holding a value other than its global default. Layers:
    ``default``, ``recipe <method>``, ``preset``, ``set``, ``config``."""
    explicit = explicit_layers(str(flat.get("explicit-settings", "")))
    use_recipe = flat.get("recipe", "method") != "none"
    out, layers = dict(flat), {}
    for key, f in SHARED_KEYS.items():
        value = flat.get(key, f.default)
        if key in explicit:
            layers[key] = explicit[key]
        elif value != f.default:
            layers[key] = "config"
        elif use_recipe and key in recipe:
            out[key], layers[key] = recipe[key], f"recipe {method}"
        else:
            layers[key] = "default"
    return out, layers


def _describe(f: dataclasses.Field) -> str:
    m = f.metadata
    if m["choices"]:
        return "one of " + ", ".join(repr(c) for c in m["choices"])
    kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    text = kind[type(f.default)]
    if m["low"] is not None:
        text += f" {'>' if m['low_open'] else '>='} {m['low']}"
    if m["high"] is not None:
        text += f" and <= {m['high']}"
    return text


def _check_value(key: str, f: dataclasses.Field, value: Any) -> Any:
    """Return ``value`` converted to the field's type, or raise ConfigError."""
    want = type(f.default)
    bad = ConfigError(f"setting {key} = {value!r} is invalid: expected {_describe(f)}"
                      f" ({f.metadata['help']}).")
    if want is bool:
        if not isinstance(value, bool):
            raise bad
    elif want is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
    elif want is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise bad
    elif not isinstance(value, str):
        # A number where text is wanted stands for the text it was written as (up to TOML's
        # spelling), so that `--set heterofl.rates=0.5` needs no quotes around the rate.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        value = repr(value)
    m = f.metadata
    if m["choices"] and value not in m["choices"]:
        raise bad
    if m["low"] is not None and (value < m["low"] or (m["low_open"] and value == m["low"])):
        raise bad
    if m["high"] is not None and value > m["high"]:
        raise bad
    return value


def parse_run_config(flat: Mapping[str, Any], *, method_keys: Mapping[str, Any] = ()) -> RunConfig:
    """Validate a flat run config and return the shared part as a :class:`RunConfig`.

    ``method_keys`` are the namespaced keys that method modules declare; they are allowed here
    and checked by :func:`parse_settings` (see ``strategies.load_config``).
    """
    unknown = [k for k in flat if k not in SHARED_KEYS and k not in method_keys]
    moved = [k for k in unknown if k in MOVED_KEYS]
    if moved:
        raise ConfigError("setting(s) " + ", ".join(f"{k} (now {MOVED_KEYS[k]})" for k in moved)
                          + " moved: `fedapp settings` lists every setting, and a shared "
                          "training setting takes each method's value from its recipe.")
    if unknown:
        known = list(SHARED_KEYS) + list(method_keys)
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, known, n=1)
            hints.append(f"{k}" + (f" (did you mean {close[0]}?)" if close else ""))
        raise ConfigError("unknown setting(s): " + ", ".join(hints)
                          + ". Run `fedapp settings` to list every setting.")
    cfg = parse_settings(RunConfig, flat)
    _check_cross_field(cfg)
    return cfg


def parse_settings(cls: type, flat: Mapping[str, Any], prefix: str = "") -> Any:
    """An instance of the settings dataclass ``cls`` from the ``prefix.*`` keys of ``flat``
    (defaults for the missing ones), every value checked against its field's rule."""
    values = {}
    for key, f in settings_keys(cls, prefix).items():
        values[f.name] = _check_value(key, f, flat[key]) if key in flat else f.default
    return cls(**values)


def _check_cross_field(cfg: RunConfig) -> None:
    """Rules that tie several settings together."""
    try:
        shape = cfg.shape
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError
    except ValueError:
        raise ConfigError(f"setting synthetic-shape = {cfg.synthetic_shape!r} is invalid: "
                          "expected three positive integers 'C,H,W', e.g. '1,28,28'.") from None
    if (cfg.dataset == "federation") != (cfg.partition == "files"):
        raise ConfigError(f"settings dataset = {cfg.dataset!r} and partition = "
                          f"{cfg.partition!r} do not fit: a federation of per-client files "
                          "(dataset = 'federation') is partitioned by its files (partition = "
                          "'files'), and only it.")
    if cfg.public_fraction >= 1:
        raise ConfigError(f"setting public-fraction = {cfg.public_fraction} is invalid: "
                          "expected a share of the training split in (0, 1); the rest is "
                          "what the clients train on.")
    if (cfg.public_source == "npz") != bool(cfg.public_file):
        raise ConfigError(f"settings public-source = {cfg.public_source!r} and public-file = "
                          f"{cfg.public_file!r} do not fit: public-file names the public set's "
                          ".npz file, for public-source = 'npz' and only it.")
    if cfg.public_file and not Path(cfg.public_file).is_absolute():
        raise ConfigError(f"setting public-file = {cfg.public_file!r} is invalid: it must be "
                          "an absolute path (Flower runs the app from another directory).")
    if cfg.public_source == "train-holdout" and cfg.dataset == "federation":
        raise ConfigError("setting public-source = 'train-holdout' is invalid with dataset = "
                          "'federation': its per-client files are the partition already; "
                          "use public-source = 'npz' (or 'digits').")
    if cfg.dataset in ("npz", "imagefolder", "federation") and not cfg.data_dir:
        raise ConfigError(f"setting data-dir is empty: dataset = {cfg.dataset!r} reads a "
                          "folder of your files (layouts in docs/data.md).")
    if not cfg.architectures:
        raise ConfigError(f"setting arch-mix = {cfg.arch_mix!r} is invalid: name at least one "
                          "architecture.")
    if cfg.min_fit_clients > cfg.num_clients:
        raise ConfigError(f"setting min-fit-clients = {cfg.min_fit_clients} is invalid: it must "
                          f"be <= num-clients ({cfg.num_clients}).")
    try:
        owners = cfg.partition_owners
        if any(not 0 <= p < cfg.num_clients for p in owners) or \
                len(set(owners.values())) != len(owners) or not all(owners.values()):
            raise ValueError
    except ValueError:
        raise ConfigError(f"setting partition-nodes = {cfg.partition_nodes!r} is invalid: expected "
                          "'partition=node-id,...' with partitions in [0, num-clients) and "
                          "each node id once, e.g. '0=1234,1=5678'.") from None
    if cfg.server_loop != "rounds" and (cfg.checkpoint_every or cfg.resume):
        raise ConfigError(f"setting checkpoint-every / resume is invalid with server-loop = "
                          f"{cfg.server_loop!r}: only synchronous rounds keep checkpoints; use "
                          "server-loop = 'rounds' or checkpoint-every = 0.")
    if cfg.client_state == "disk" and (cfg.checkpoint_every or cfg.resume):
        raise ConfigError("setting client-state = 'disk' is invalid with checkpoint-every / "
                          "resume: a resumed client must start from its checkpoint, not from "
                          "its newer idle file; use client-state = 'memory' with checkpoints.")
    try:
        if any(not 0 < f < 1 for f in cfg.lr_decay_fractions):
            raise ValueError
    except ValueError:
        raise ConfigError(f"setting lr-decay-at = {cfg.lr_decay_at!r} is invalid: expected "
                          "fractions of the run between 0 and 1, comma-separated, e.g. "
                          "'0.5' or '0.4,0.7'.") from None
    if cfg.optimizer == "adam" and not (cfg.adam_beta1 < 1 and cfg.adam_beta2 < 1):
        raise ConfigError(f"settings adam-beta1 = {cfg.adam_beta1} and adam-beta2 = "
                          f"{cfg.adam_beta2} are invalid: Adam needs both betas < 1.")
    if cfg.walk_forward >= 1:
        raise ConfigError(f"setting walk-forward = {cfg.walk_forward} is invalid: a walk whose "
                          "holders never train would never finish; use a value below 1.")
    try:
        ids = cfg.malicious_ids
        if any(not 0 <= p < cfg.num_clients for p in ids) or len(set(ids)) != len(ids):
            raise ValueError
    except ValueError:
        raise ConfigError(f"setting malicious-clients = {cfg.malicious_clients!r} is invalid: "
                          "expected partition ids in [0, num-clients), each once, "
                          "comma-separated, e.g. '0,3'.") from None
    if cfg.malicious_clients and cfg.malicious_fraction:
        raise ConfigError("settings malicious-clients and malicious-fraction are both set: "
                          "name the attackers or draw a share of them, not both.")
    attackers = cfg.num_malicious > 0
    if cfg.attack != "none" and not attackers:
        raise ConfigError(f"setting attack = {cfg.attack!r} has no client to run it: set "
                          "malicious-fraction (at least half a client of num-clients) or "
                          "malicious-clients.")
    if cfg.attack == "none" and attackers:
        raise ConfigError("malicious clients are set but attack = 'none': choose an attack "
                          "(`fedapp settings` lists them) or leave the malicious clients out.")
    if cfg.robust_trim_fraction >= 0.5:
        raise ConfigError(f"setting robust-trim-fraction = {cfg.robust_trim_fraction} is "
                          "invalid: cutting half of the values at each end leaves none; use "
                          "a value below 0.5.")
    if cfg.robust_aggregation == "norm-bound" and cfg.robust_norm_bound <= 0:
        raise ConfigError("setting robust-aggregation = 'norm-bound' needs robust-norm-bound "
                          "> 0: the largest distance an upload may have to the current state.")
    if cfg.output_dir and not Path(cfg.output_dir).is_absolute():
        raise ConfigError(f"setting output-dir = {cfg.output_dir!r} is invalid: it must be an "
                          "absolute path (Flower runs the app from another directory).")
    if cfg.run_name and (cfg.run_name != Path(cfg.run_name).name or cfg.run_name in (".", "..")):
        raise ConfigError(f"setting run-name = {cfg.run_name!r} is invalid: use a plain folder "
                          "name without '/'.")


# -- reading the defaults and presets (used by the CLI, the tests and the benchmark) -----------

def pyproject_defaults(root: Path = PROJECT_ROOT) -> dict[str, Any]:
    """The flat ``[tool.flwr.app.config]`` table of ``pyproject.toml`` (nested tables dotted)."""
    with open(root / "pyproject.toml", "rb") as fh:
        table = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    return _flatten(table)


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in table.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resolve_preset(name_or_path: str) -> Path:
    """``smoke`` -> ``conf/smoke.toml``; a path is taken as it is."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = CONF_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        presets = sorted(p.stem for p in CONF_DIR.glob("*.toml"))
        raise ConfigError(f"preset {name_or_path!r} not found (looked for {path}). "
                          f"Presets: {', '.join(presets)}.")
    return path.resolve()


def read_preset(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A preset file's overrides, flattened to run-config keys. A preset may start from another
    (``extends = "name"``) and change a few of its settings."""
    with open(path, "rb") as fh:
        table = tomllib.load(fh)
    base = table.pop("extends", None)
    if base is None:
        return _flatten(table)
    base_path = resolve_preset(str(base))
    if base_path in _seen or base_path == Path(path).resolve():
        raise ConfigError(f"preset {path} extends {base!r}, which extends it again")
    return {**read_preset(base_path, (*_seen, Path(path).resolve())), **_flatten(table)}


def toml_value(value: Any) -> str:
    """A setting's value as TOML spells it (as ``--set`` and presets take it)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    return repr(value)


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` with a TOML value (strings quoted, as ``flwr run --run-config``)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r} is invalid: expected key=value, e.g. "
                          'method="fedavg" or num-server-rounds=5.')
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        # Be forgiving with unquoted strings on the command line: method=fedavg.
        value = raw.strip()
    return key, value


def sampled_per_round(cfg: RunConfig, available: int | None = None) -> int:
    """How many clients a round samples of ``available`` connected ones (default: all
    num-clients): what :meth:`FedStrategy.configure_fit` draws, so what the privacy accountant
    counts and what secure aggregation sums."""
    available = cfg.num_clients if available is None else available
    return min(available, max(cfg.min_fit_clients, math.ceil(cfg.fraction_fit * available)))
