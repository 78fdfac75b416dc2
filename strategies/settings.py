"""Every method's own settings (``<method>.*``): one frozen dataclass per method, each field
with its default, help and rule (``fedapp.config.opt``), and the checks that tie it to the run.

They live here, apart from the methods' maths, because the command line reads them all without
running anything: ``fedapp settings``, ``fedapp methods`` and a refused setting answer in about
a second only if listing and checking the settings imports no torch (docs/benchmarks.md). So
this module imports none at its top; a check that has to build a model imports what it needs
when it runs (``strategies.load_config`` calls it after building the run's architectures).
Each method's module imports its dataclass from here; the comment above each names that module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedapp.config import ConfigError, RunConfig, opt


# -- FedClassAvg: strategies/fedclassavg.py -------------------------------------------------------

PROXIMAL_FORMS = ("l2", "squared", "code-mse")


@dataclass(frozen=True)
class FedClassAvgSettings:
    """``fedclassavg.*``."""

    contrastive: bool = opt(True, "add the supervised contrastive loss on two augmented views "
                            "(false = CE only: the ablation's CA and CA+PR rows)")
    proximal: bool = opt(True, "add rho * the proximal term to the global classifier (false = "
                         "the ablation's CA and CA+CL rows)")
    rho: float = opt(0.4662, "weight rho of the proximal term (paper Table 1: Fashion-MNIST "
                     "0.4662, CIFAR-10 and EMNIST 0.1)", low=0.0)
    proximal_form: str = opt(
        "l2", "proximal term: 'l2' = ||w - w_global||_2 (paper), 'squared' = "
        "1/2 ||w - w_global||_2^2 (FedProx), 'code-mse' = 1/2 * sum over the classifier's "
        "tensors of mean((w - w_global)^2) (reference code)", choices=PROXIMAL_FORMS)
    proximal_skip_first_batch: bool = opt(
        False, "leave the proximal term out on the first mini-batch of every epoch, as the "
        "reference code does (there w = w_global anyway, except for the l2 form's subgradient)")
    temperature: float = opt(0.07, "SupCon temperature T (0.07, the usual value on normalised "
                             "features; the reference code's 100 on unnormalised ones is "
                             "conf/fedclassavg-code.toml)",
                             low=0.0, low_open=True)
    base_temperature: float = opt(0.07, "SupCon base temperature: the loss is scaled by "
                                  "T / base (reference code 0.07; set it equal to T for no "
                                  "scaling)", low=0.0, low_open=True)
    normalize_features: bool = opt(True, "L2-normalise the features inside SupCon (reference "
                                   "code: false, the normalisation is commented out)")
    supcon_features: str = opt("pre-relu", "which features SupCon sees: the 512-d projection "
                               "before the classifier's ReLU ('pre-relu', reference code) or "
                               "after it ('post-relu')", choices=("pre-relu", "post-relu"))
    # The names of strategies/fedclassavg.py's VIEWS (which builds them with torch).
    views: str = opt("none", "the two views SupCon contrasts: 'simclr' (the reference "
                     "code's: random resized crop of scale (0.2, 1), horizontal flip, colour "
                     "jitter for 3 channels), 'mild' (crop of scale (0.8, 1), no flip, no "
                     "jitter) or 'none' (both views are the raw images)",
                     choices=("simclr", "mild", "none"))
    ce_view: str = opt("raw", "what the cross-entropy sees: the first 'augmented' view "
                       "(reference code) or the 'raw' image", choices=("augmented", "raw"))
    warmup: bool = opt(False, "train local-epochs epochs with SupCon + CE before the first "
                       "round, as the reference code does (the paper says no warm-up)")
    diagnose: bool = opt(False, "diagnostics (not in the paper; they cost an extra backward "
                         "pass per term and a pass over the training data per evaluation): each "
                         "term's gradient norm on the extractor and on the classifier "
                         "(term-*-grad-*), and accuracy-ncm = nearest-class-mean accuracy of "
                         "the extractor's normalised features, the class means taken on the "
                         "client's training data; the training itself is unchanged")


# -- FedGH: strategies/fedgh.py -------------------------------------------------------------------

@dataclass(frozen=True)
class FedGHSettings:
    """``fedgh.*``: the server's header training (paper: SGD, eta_g = 0.01, one pass)."""

    server_lr: float = opt(0.01, "server header learning rate eta_g", low=0.0, low_open=True)
    server_epochs: int = opt(1, "passes over the round's LARs per round", low=1)
    server_batch_size: int = opt(
        0, "LARs per server step (0 = all LARs of one client per step, as they arrive)", low=0)
    client_order: str = opt("shuffled", "order in which clients' LARs are consumed: 'shuffled' "
                            "(seeded, like arrival order), 'partition' (by partition id), or "
                            "'pooled': every client's LARs shuffled together into batches of "
                            "server-batch-size (HtFLlib's server DataLoader)",
                            choices=("shuffled", "partition", "pooled"))
    server_head_training: bool = opt(
        True, "train the global header (false = the released code's frozen random header)")

    def check(self, cfg: RunConfig) -> None:
        if cfg.feature_dim == 0:
            raise ConfigError("method 'fedgh' needs one representation dimension for every "
                              "client (the global header is Linear(d, C)): set feature-dim > 0 "
                              "(the paper uses 500).")


# -- FedProto: strategies/fedproto.py -------------------------------------------------------------

@dataclass(frozen=True)
class FedProtoSettings:
    """``fedproto.*``."""

    lam: float = opt(1.0, "weight lambda of the prototype distance", low=0.0, key="lambda")
    eval_rule: str = opt("head", "headline prediction: the model's own 'head' or the "
                         "'nearest-prototype' (both are reported)",
                         choices=("head", "nearest-prototype"))
    prototypes: str = opt(
        "after-training", "a client's prototype of class c: the exact mean of its trained "
        "model's representations ('after-training', the paper's equation) or the mean of those "
        "its training steps computed while the model changed ('during-training': FedProto's "
        "released code, HtFLlib)", choices=("after-training", "during-training"))
    average: str = opt("counts", "the global prototype of c: the clients' prototypes weighted "
                       "by their counts |D_kc| ('counts', the paper) or each client once "
                       "('uniform': FedProto's released code, HtFLlib)",
                       choices=("counts", "uniform"))


# -- FedHe: strategies/fedhe.py -------------------------------------------------------------------

@dataclass(frozen=True)
class FedHeSettings:
    """``fedhe.*``: the logit loss, the client's per-class averages and the server store."""

    alpha: float = opt(1.0, "weight of the logit loss (paper: 1)", low=0.0)
    logit_loss: str = opt("mse", "distance to the server's class logits: 'mse' (code) or "
                          "'kl' (softmax with temperature)", choices=("mse", "kl"))
    temperature: float = opt(1.0, "KL logit loss: softmax temperature", low=0.0, low_open=True)
    plus_one: bool = opt(True, "divide logit sums by count + 1 (paper Eq. 8; false = by count)")
    history: str = opt("all", "server store: 'all' (paper), 'running-mean' (code), "
                       "'latest-per-client'", choices=("all", "running-mean", "latest-per-client"))
    collapse_every: int = opt(0, "running-mean: uploads between collapses (0 = 10 x num-clients)",
                              low=0)


# -- FedRep: strategies/fedrep.py -----------------------------------------------------------------

@dataclass(frozen=True)
class FedRepSettings:
    """``fedrep.*``: the head phase before the extractor phase."""

    head_epochs: int = opt(10, "epochs of head training (extractor frozen) before the "
                           "extractor epochs (FedRep paper: 10)", low=1)


# -- CompFL: strategies/compfl.py -----------------------------------------------------------------

@dataclass(frozen=True)
class CompFLSettings:
    """``compfl.*``: the three components, their weights and the open points of the paper."""

    align: bool = opt(True, "feature alignment L_align (Table 3 'Align')")
    greedy: bool = opt(True, "epsilon-greedy model selection (Table 3 'Greedy')")
    kd: bool = opt(True, "ensemble knowledge distillation L_kd (Table 3 'KD')")
    lam: float = opt(1.0, "weight lambda of L_align (paper: 1)", low=0.0, key="lambda")
    mu: float = opt(1.0, "weight mu of L_kd (paper: 1)", low=0.0)
    epsilon: float = opt(0.3, "probability of training a uniformly drawn smaller-or-equal "
                         "expert (paper: 0.3)", low=0.0, high=1.0)
    tau: float = opt(0.1, "temperature of the expert weights softmax(minmax(acc) / tau) "
                     "(paper: 0.1)", low=0.0, low_open=True)
    head_lr: float = opt(0.1, "learning rate eta_g of the head fine-tuning after the prototype "
                         "init (not in the paper; FedPAC: 0.1)", low=0.0, low_open=True)
    head_epochs: int = opt(1, "epochs of head fine-tuning after the prototype init (paper: 1)",
                           low=0)
    prototype_init: str = opt("normalised", "head rows of local classes := 'normalised' or "
                              "'raw' class prototypes", choices=("normalised", "raw"))
    align_form: str = opt("mse", "L_align: 'mse' (FedPAC: mean over samples and dimensions) or "
                          "'squared-norm' (paper: mean over samples of ||z - z~||^2)",
                          choices=("mse", "squared-norm"))
    kd_direction: str = opt("target-first", "L_kd: 'target-first' KL(t || local) (usual KD) or "
                            "'prediction-first' KL(local || t) (the paper's formula as printed)",
                            choices=("target-first", "prediction-first"))
    kd_teachers: str = opt("own-and-smaller", "distillation ensemble: the own adapted expert "
                           "and the smaller ones, or only 'smaller' ones (appendix)",
                           choices=("own-and-smaller", "smaller"))
    kd_warmup: float = opt(0.1, "fraction of num-server-rounds before KD starts", low=0.0,
                           high=1.0)
    upload: str = opt("delta", "upload the trained extractor as the 'delta' to the received one "
                      "(Algorithm 1) or as 'weights' (same server result)",
                      choices=("delta", "weights"))


# -- Felo: strategies/felo.py ---------------------------------------------------------------------

@dataclass(frozen=True)
class FeloSettings:
    """``felo.*``: the client loss, the local update, the server store and group averaging."""

    alpha: float = opt(0.5, "weight of the feature + logit distillation terms (code: 0.5; "
                       "the paper gives none)", low=0.0)
    logit_loss: str = opt("kl", "distance to the server's class logits: 'kl' (paper; server "
                          "softmax as the target) or 'mse' on raw logits (the authors' code)",
                          choices=("kl", "mse"))
    temperature: float = opt(1.0, "KL logit loss: softmax temperature T (loss scaled by T^2)",
                             low=0.0, low_open=True)
    warmup_fraction: float = opt(0.05, "first fraction of num-server-rounds trained with CE "
                                 "only, the server sending no tables (code: 5 % of the "
                                 "iterations)", low=0.0, high=1.0)
    group_avg: bool = opt(True, "FedAvg within each architecture group, weighted by n_k "
                          "(paper Sec. 3.1.2; false = the released code, which skips it)")
    history: str = opt("fifo", "server store per class: 'fifo' (the last history-size entries "
                       "ever received) or 'latest-round' (only those of the latest round that "
                       "brought the class)", choices=("fifo", "latest-round"))
    history_size: int = opt(50, "entries kept per class by the server store", low=1)
    eval_model: str = opt("own", "model evaluated: the client's 'own' (after its last local "
                          "training) or its architecture 'group' average (needs group-avg)",
                          choices=("own", "group"))

    def check(self, cfg: RunConfig) -> None:
        if self.eval_model == "group" and not self.group_avg:
            raise ConfigError(f"setting {cfg.method}.eval-model = 'group' needs "
                              f"{cfg.method}.group-avg = true: without group averaging there "
                              "is no group model to evaluate.")


# -- Velo: strategies/velo.py ---------------------------------------------------------------------

@dataclass(frozen=True)
class VeloSettings(FeloSettings):
    """``velo.*``: Felo's settings plus the server's CVAE."""

    cvae_hidden: int = opt(0, "CVAE hidden layer width h (0 = d, as the code)", low=0)
    cvae_latent: int = opt(0, "CVAE latent size (0 = d, as the code)", low=0)
    cvae_embedding: int = opt(32, "CVAE label embedding size e (code: 512; scaled down for "
                              "the small d of CPU runs)", low=1)
    cvae_decoder_relu: bool = opt(False, "a ReLU between the decoder's two layers (the code "
                                  "has none)")
    cvae_epochs: int = opt(10, "CVAE epochs over the stored features per training (code: 10)",
                           low=1)
    cvae_lr: float = opt(0.001, "CVAE Adam learning rate (code: 1e-3)", low=0.0, low_open=True)
    cvae_batch_size: int = opt(50, "CVAE mini-batch size (code: the client batch, 50)", low=2)
    cvae_kl_weight: float = opt(1.0, "weight of the KL term (code: 1, summed over the batch)",
                                low=0.0)
    retrain_every: int = opt(1, "train the CVAE every n rounds (paper Table 4: 1..10)", low=1)


# -- FedGen: strategies/fedgen.py -----------------------------------------------------------------

# The authors' code never lets the client-term weight decay below this.
MIN_CLIENT_WEIGHT = 1e-4


@dataclass(frozen=True)
class FedGenSettings:
    """``fedgen.*``: the generator, its server training and the client's generator term."""

    noise_dim: int = opt(32, "generator noise size nd (HtFLlib's total.sh: 32; main.py 512)",
                         low=1)
    hidden_dim: int = opt(512, "generator hidden width hd", low=1)
    server_lr: float = opt(0.1, "generator Adam learning rate (HtFLlib's total.sh: 0.1; "
                           "main.py 0.005)", low=0.0, low_open=True)
    server_steps: int = opt(100, "generator Adam steps per round (HtFLlib's server_epochs)",
                            low=1)
    server_batch_size: int = opt(0, "labels per generator step (0 = the run's batch-size, as "
                                 "HtFLlib)", low=0)
    noise: str = opt("normal", "generator noise eps: 'normal' N(0, I) (paper) or 'uniform' "
                     "U[0, 1) (HtFLlib's code)", choices=("normal", "uniform"))
    teacher_weights: str = opt(
        "label", "weights of the heads in the teacher ensemble: 'label' = n_k^y / sum_j n_j^y "
        "per label y (paper), 'samples' = n_k / sum_j n_j per client (HtFLlib)",
        choices=("label", "samples"))
    diversity: float = opt(1.0, "weight of the generator's diversity regulariser (paper; "
                           "authors' code 1; HtFLlib 0)", low=0.0)
    client_weight: float = opt(10.0, "weight alpha_0 of the client's generator term (authors' "
                               "code 10; HtFLlib 1)", low=0.0)
    client_weight_decay: float = opt(
        0.98, "alpha_t = max(1e-4, alpha_0 * decay^(t - 1)) in round t (authors' code 0.98; "
        "HtFLlib 1 = constant)", low=0.0, high=1.0, low_open=True)
    keep_generator: bool = opt(
        True, "keep the generator the server trains (paper, authors' code); false = HtFLlib's "
        "code, whose server trains a copy of its initial generator each round and discards it, "
        "so that the clients always draw from the untrained G")
    label_pool: str = opt(
        "uploads", "where the server learns the clients' label histograms: 'uploads' = each "
        "client's first upload, so G is first sent in round 2 (a federation's only way); "
        "'partition' = computed by the server from the run's partition before round 1, so the "
        "clients use G from round 1 (HtFLlib's code, whose server reads every client's labels "
        "at start-up); a node training on its own data still uploads its histogram",
        choices=("uploads", "partition"))

    def client_term_weight(self, server_round: int) -> float:
        """alpha_t for round ``server_round`` (1-based; the authors count from 0)."""
        decayed = self.client_weight * self.client_weight_decay ** max(server_round - 1, 0)
        return max(min(self.client_weight, MIN_CLIENT_WEIGHT), decayed)


# -- FedL2G: strategies/fedl2g.py -----------------------------------------------------------------

# FedL2G's run_me.sh: the server's step size per variant.
SERVER_LR = {"feat": 100.0, "logit": 0.1}


@dataclass(frozen=True)
class FedL2GSettings:
    """``fedl2g.*``."""

    variant: str = opt("feat", "what the guiding vectors guide: the features ('feat', m = d; "
                       "one d for every client) or the logits ('logit', m = C)",
                       choices=("feat", "logit"))
    warmup_fraction: float = opt(
        0.025, "first fraction of num-server-rounds (rounded down) with meta steps only, no "
        "local training and no evaluation (HtFLlib: 50 of its 2000 rounds)", low=0.0,
        high=1.0)
    study_batches: int = opt(1, "study batches in the look-ahead step (mdb)", low=1)
    quiz_batches: int = opt(1, "quiz batches (mqb); the quiz set is quiz-batches * batch-size "
                            "training samples, held out from training", low=1)
    quiz_set: str = opt(
        "random", "which training samples the quiz set holds: a seeded 'random' draw, or the "
        "'first' ones in the data's order, the study set keeping that order (HtFLlib, which "
        "slices its stored per-client file)", choices=("random", "first"))
    server_lr: float = opt(0.0, "server step size eta_s on the guiding vectors (0 = FedL2G's "
                           "run_me.sh: 100 for feat, 0.1 for logit; HtFLlib's main.py 0.01)",
                           low=0.0)
    guide_seed: int = opt(
        -1, "the guiding vectors' initial draw: -1 = keyed by the run's seed; s >= 0 = "
        "N(0, 1) from a torch generator seeded with s, for every run (HtFLlib builds its "
        "nn.Embedding after its last client re-seeds torch with 0: its guide is s = 0 in "
        "every run)", low=-1)

    def warmup_rounds(self, num_server_rounds: int) -> int:
        """wu: the warm-up's rounds, which count toward the run's rounds."""
        return math.floor(self.warmup_fraction * num_server_rounds)

    def check(self, cfg: RunConfig) -> None:
        if self.warmup_rounds(cfg.num_server_rounds) >= cfg.num_server_rounds:
            raise ConfigError(
                f"setting fedl2g.warmup-fraction = {self.warmup_fraction} is invalid with "
                f"num-server-rounds = {cfg.num_server_rounds}: the warm-up would take every "
                "round, so no client would ever train. Set a smaller fraction.")
        from fedapp.data.setup import architectures  # the models import torch
        if self.variant == "feat" and cfg.feature_dim == 0 \
                and len(set(architectures(cfg))) > 1:
            raise ConfigError(
                "setting fedl2g.variant = 'feat' guides the features, so every extractor must "
                "output the same dimension: set feature-dim > 0 or use variant 'logit'.")

    def eta_s(self) -> float:
        return self.server_lr or SERVER_LR[self.variant]


# -- the shared model of FML, FedMRL and FedKD: fedapp/runtime/two_models.py ----------------------

@dataclass(frozen=True)
class SharedModelSettings:
    """``<method>.shared-arch`` and ``<method>.average``: what every shared-model method has."""

    shared_arch: str = opt(
        "", "architecture of the shared model every client holds beside its own ('' = the "
        "smallest architecture of arch-mix by parameter count; HtFLlib uses the first)")
    average: str = opt(
        "samples", "how the server averages the uploaded shared models: 'samples' (weighted by "
        "training-set size, FedAvg's n_k) or 'uniform' (every uploader counts once: HtFLlib)",
        choices=("samples", "uniform"))

    def shared_feature_dim(self, cfg: RunConfig) -> int | None:
        """The shared model's representation size (None = its architecture's own)."""
        return cfg.feature_dim or None

    def shared_pool_dim(self, cfg: RunConfig) -> int | None:
        """s where the shared extractor is built with ``feature-dim`` and its output then
        average-pooled to s (None: built with :meth:`shared_feature_dim` directly)."""
        return None

    def check(self, cfg: RunConfig) -> None:
        # The models import torch (this check builds one).
        from client_models import ModelConfigError, parse_arch_mix
        from fedapp.data.local_data import DATASET_INPUTS, expected_input
        from fedapp.runtime.two_models import shared_architecture
        method = cfg.method
        if self.shared_arch:
            try:
                names = parse_arch_mix(self.shared_arch)
            except ModelConfigError as exc:
                raise ConfigError(f"setting {method}.shared-arch = {self.shared_arch!r} is "
                                  f"invalid: {exc}") from None
            if len(names) != 1:
                raise ConfigError(f"setting {method}.shared-arch = {self.shared_arch!r} is "
                                  "invalid: name one architecture")
        # The input is known without reading the data for the built-in data sets: build the
        # shared model now, so that one that cannot run on them is refused before training.
        if cfg.dataset == "synthetic" or cfg.dataset in DATASET_INPUTS:
            try:
                shared_architecture(cfg, *expected_input(cfg))
            except ModelConfigError as exc:
                raise ConfigError(f"the shared model of {method!r} cannot run on "
                                  f"{cfg.dataset}: {exc}") from None


# -- FML: strategies/fml.py -----------------------------------------------------------------------

@dataclass(frozen=True)
class FMLSettings(SharedModelSettings):
    """``fml.*``: the two models' loss weights and the KL's form."""

    alpha: float = opt(0.5, "weight of the private model's cross-entropy; 1 - alpha weighs its "
                       "KL to the meme model (1 = no mutual learning, HtFLlib's default)",
                       low=0.0, high=1.0)
    beta: float = opt(0.5, "weight of the meme model's cross-entropy; 1 - beta weighs its KL "
                      "to the private model", low=0.0, high=1.0)
    detach_partner: bool = opt(
        True, "each KL holds the partner's prediction constant (deep mutual learning); false "
        "= HtFLlib: both KL terms reach both models")
    kl: str = opt("batchmean", "KL reduction: 'batchmean' (the textbook batch mean) or 'mean' "
                  "(PyTorch's KLDivLoss default, HtFLlib: also divided by C)",
                  choices=("batchmean", "mean"))


# -- FedMRL: strategies/fedmrl.py -----------------------------------------------------------------

HTFL_SHARED_DIM = 128  # HtFLlib's -sfd


@dataclass(frozen=True)
class FedMRLSettings(SharedModelSettings):
    """``fedmrl.*``: the shared representation's size, the projector's lifetime, evaluation."""

    shared_dim: int = opt(0, "s, the shared model's representation size and the Matryoshka "
                          "prefix its head reads (0 = HtFLlib's 128, or feature-dim when "
                          "smaller; the authors' code uses s = d)", low=0)
    keep_projector: bool = opt(
        True, "keep each client's projector across rounds (false = HtFLlib, which never saves "
        "it: it restarts from its initial weights every round)")
    eval_shared: str = opt(
        "local", "the shared extractor a client predicts with: 'local' (the one it trained "
        "last: the paper, the authors' code) or 'global' (the server's: HtFLlib)",
        choices=("local", "global"))
    shared_reduce: str = opt(
        "pool", "how the shared extractor's output becomes s long: 'pool' (the architecture "
        "built with its d, then averaged in s groups: HtFLlib's BaseHeadSplit, the spec) or "
        "'linear' (the architecture's last layer built s wide: fewer parameters, less "
        "traffic)", choices=("pool", "linear"))

    def shared_feature_dim(self, cfg: RunConfig) -> int:
        return self.shared_dim or min(HTFL_SHARED_DIM, cfg.feature_dim or HTFL_SHARED_DIM)

    def shared_pool_dim(self, cfg: RunConfig) -> int | None:
        return self.shared_feature_dim(cfg) if self.shared_reduce == "pool" else None

    def check(self, cfg: RunConfig) -> None:
        if cfg.feature_dim and self.shared_feature_dim(cfg) > cfg.feature_dim:
            raise ConfigError(f"setting fedmrl.shared-dim = {self.shared_dim} is invalid: the "
                              f"shared head reads a prefix of the d = feature-dim = "
                              f"{cfg.feature_dim} projected representation, so s <= d")
        super().check(cfg)  # builds the shared model


# -- FedKD: strategies/fedkd.py -------------------------------------------------------------------

@dataclass(frozen=True)
class FedKDSettings(SharedModelSettings):
    """``fedkd.*``: the SVD energy schedule, what is compressed, the mentee's rate."""

    energy_start: float = opt(0.95, "SVD energy threshold T_start of the first round",
                              low=0.0, high=1.0, low_open=True)
    energy_end: float = opt(0.98, "SVD energy threshold T_end reached after the last round",
                            low=0.0, high=1.0, low_open=True)
    mentee_lr: float = opt(0.0, "the mentee's learning rate (0 = the recipe's lr)", low=0.0)
    compress: str = opt(
        "update", "what travels as SVD factors: 'update' (the mentee's update each way: the "
        "paper) or 'weights' (the mentee's weights each way: HtFLlib)",
        choices=("update", "weights"))
    rank_rule: str = opt(
        "energy", "'energy': the smallest rank holding the energy threshold, the full rank "
        "included; 'htfllib': its search, which never tries the full rank and sends a matrix "
        "needing it as zeros", choices=("energy", "htfllib"))
    codec: str = opt(
        "compact", "'compact': a convolution factored as out x in*k*k, a tensor whose factors "
        "would not be smaller sent exactly; 'htfllib': each k x k kernel factored on its own "
        "with one rank per layer, and factors sent even where larger",
        choices=("compact", "htfllib"))
    htfllib_loss: bool = opt(
        False, "HtFLlib's loss: neither partner held constant, S trained, the hidden term "
        "counted in both models' losses")
    kl: str = opt("batchmean", "KL reduction: 'batchmean' or 'mean' (KLDivLoss's default, "
                  "HtFLlib: also divided by C)", choices=("batchmean", "mean"))

    def check(self, cfg: RunConfig) -> None:
        super().check(cfg)
        if self.energy_end < self.energy_start:
            raise ConfigError(f"setting fedkd.energy-end = {self.energy_end} is invalid: the "
                              f"threshold rises from fedkd.energy-start = {self.energy_start}")


# -- FD: strategies/fd.py -------------------------------------------------------------------------

@dataclass(frozen=True)
class FDSettings:
    """``fd.*``: the distillation term and the server's table."""

    lam: float = opt(1.0, "weight lambda of the distillation term", low=0.0, key="lambda")
    exclude_own: bool = opt(True, "send each client the average of the other clients' logits "
                            "(the paper's F^(i)); false = include its own (HtFLlib)")
    raw_target: bool = opt(False, "HtFLlib parity: the raw averaged logits as the soft target "
                           "(default: their softmax, distillation at temperature 1)")
    self_target: bool = opt(False, "HtFLlib parity: a sample whose class has no global logits "
                            "targets its own detached logits (default: it adds nothing)")
    history: str = opt("auto", "uploads the server averages: 'round' (the last round's "
                       "senders, HtFLlib), 'latest-per-client' (each client's newest) or "
                       "'auto' (round in synchronous rounds; latest-per-client with "
                       "server-loop = 'async', which has no rounds)",
                       choices=("auto", "round", "latest-per-client"))

    def check(self, cfg: RunConfig) -> None:
        if cfg.server_loop == "async" and self.history == "round":
            raise ConfigError(
                "setting fd.history = 'round' is invalid with server-loop = 'async': without "
                "rounds the server keeps each client's latest logits; set fd.history = "
                "\"latest-per-client\" (or leave it at \"auto\").")

    def resolved_history(self, cfg: RunConfig) -> str:
        if self.history != "auto":
            return self.history
        return "latest-per-client" if cfg.server_loop == "async" else "round"


# -- FedRE: strategies/fedre.py -------------------------------------------------------------------

@dataclass(frozen=True)
class FedRESettings:
    """``fedre.*``: the server's head training (the code's -slr 0.01, -hbs 32, one epoch)."""

    server_lr: float = opt(0.01, "server head learning rate (-slr)", low=0.0, low_open=True)
    server_batch_size: int = opt(32, "entangled representations per server step (-hbs)", low=1)
    send_head: bool = opt(True, "send the server's head to the clients (false = the HtFLlib "
                          "variant of the release, which never sends it)")
    eval_head: str = opt("global", "headline prediction: the local extractor with the server's "
                         "'global' head, or the client's 'own' head (both are reported)",
                         choices=("global", "own"))

    def check(self, cfg: RunConfig) -> None:
        if cfg.feature_dim == 0:
            raise ConfigError("method 'fedre' needs one representation dimension for every "
                              "client (the server's head is Linear(d, C)): set feature-dim > 0 "
                              "(HtFLlib uses 512).")


# -- FedTGP: strategies/fedtgp.py -----------------------------------------------------------------

@dataclass(frozen=True)
class FedTGPSettings:
    """``fedtgp.*`` (HtFLlib's -lam 1, -se 100, -mart 100; the server lr and batch are the
    clients' -lr and -lbs there)."""

    lam: float = opt(1.0, "weight lambda of the prototype MSE (the scripts use 10)", low=0.0,
                     key="lambda")
    eval_rule: str = opt("nearest-prototype", "headline prediction: the 'nearest-prototype' "
                         "(paper) or the model's own 'head' (both are reported)",
                         choices=("nearest-prototype", "head"))
    server_epochs: int = opt(100, "TGP training epochs per round (-se)", low=1)
    server_lr: float = opt(0.01, "TGP learning rate", low=0.0, low_open=True)
    server_batch_size: int = opt(10, "(prototype, label) pairs per TGP step", low=1)
    margin: float = opt(100.0, "upper bound tau of the adaptive margin (-mart)", low=0.0)
    pre_training_prototypes: bool = opt(
        False, "code parity: upload the prototypes of the model before the round's training")
    server_seed: int = opt(
        -1, "the seed of the server's randomness (the TGP's initial weights, its shuffles); "
        "-1 = the run's seed. HtFLlib parity: one for every run (its server draws the same in "
        "every run, whatever the seed)", low=-1)

    def check(self, cfg: RunConfig) -> None:
        if cfg.feature_dim == 0:
            raise ConfigError("method 'fedtgp' needs one prototype dimension for every client "
                              "(the global prototypes are d-dimensional): set feature-dim > 0 "
                              "(HtFLlib uses 512).")
