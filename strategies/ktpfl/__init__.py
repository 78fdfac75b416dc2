"""KT-pFL's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``; the page: docs/ktpfl.md)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import RunConfig, UploadLayout, opt
from strategies import Method

KD_REDUCTIONS = ("mean", "batchmean", "batchmean-t2")


@dataclass(frozen=True)
class KTpFLSettings:
    """``ktpfl.*``: the alignment set, the soft predictions, the knowledge-coefficient update
    and the clients' distillation and local epochs. Defaults: the authors' code
    (cugzj/KT-pFL @a08a01f, ``src/engine_kt_pfl.py`` with
    ``conf/EMNIST_imbalance_10models_T10_10local_p1.0.json``), but for ``alignment-replacement``
    (the code draws A_t with replacement; docs/ktpfl.md says why not here)."""

    alignment_size: int = opt(
        5000, "public samples A_t every client scores and distils on per round, redrawn "
        "every round (the code's N_alignment: 5000; FedClassAvg's comparison: 3000)", low=1)
    alignment_replacement: bool = opt(
        False, "draw A_t with replacement, so that a sample may repeat, as the code's "
        "np.random.choice does; false (ours) draws distinct samples")
    temperature: float = opt(
        10.0, "T of the soft predictions softmax(o / T) the clients upload and distil toward "
        "(the code's Temp: 10)", low=0.0, low_open=True)
    penalty: float = opt(
        1.0, "weight rho of the regulariser pulling each row of the knowledge-coefficient "
        "matrix toward uniform, mean((c_i - 1/N)^2) (the code's penalty_ratio: 1)", low=0.0)
    coefficient_lr: float = opt(
        0.0, "step size of the coefficients' gradient step; 0 = the code's rule, which "
        "rescales each row's step by powers of 5 until the row's mean |gradient| times it "
        "lies in about [0.01, 0.05)", low=0.0)
    softmax_scale: float = opt(
        5.0, "after the step the code re-normalises each coefficient row as softmax(scale * "
        "row); the scale (code: 5)", low=0.0, low_open=True)
    kd_epochs: int = opt(1, "distillation passes over A_t toward the personalised target "
                         "(the code's N_logits_matching_round: 1)", low=1)
    kd_batch_size: int = opt(256, "distillation mini-batch (code: 256)", low=1)
    kd_lr: float = opt(0.02, "distillation learning rate, the recipe's optimizer, new every "
                       "round (code: SGD 0.02)", low=0.0, low_open=True)
    kd_reduction: str = opt(
        "mean", "scale of the distillation loss KL(target || softmax(o / T)): 'mean' (the "
        "code's F.kl_div reduction='mean': averaged over batch AND classes, 1/C of the batch "
        "mean), 'batchmean' (summed over classes, averaged over the batch) or 'batchmean-t2' "
        "(that times T^2, Hinton's scaling)", choices=KD_REDUCTIONS)
    init_epochs: int = opt(
        1, "private epochs of round 1, the code's model initialisation before its first "
        "predictions (model_init_params epochs: 1)", low=1)
    epoch_ramp: bool = opt(
        True, "the code's schedule of private epochs: round t >= 2 trains min(t - 1, "
        "local-epochs) epochs, ramping up from 1; false: local-epochs every round")

    def public_per_round(self, cfg: RunConfig) -> int:
        """What the data set-up checks the public set against: A_t must fit in it (with
        replacement too: the set is refused if it is smaller, as for FedMD)."""
        return self.alignment_size


# The authors' code (engine_kt_pfl.py, KT_pFL.collaborative_training): a new SGD(lr=0.02)
# (no momentum or weight decay, no clipping) for the private training of every round, batches
# of private_training_batchsize 16, N_private_training_round 10 epochs (the p1.0 conf; the
# schedule ramps up to it: ktpfl.epoch-ramp). FedClassAvg ran it with 20 local epochs.
RECIPE = {"optimizer": "sgd", "lr": 0.02, "momentum": 0.0, "weight-decay": 0.0,
          "grad-clip": 0.0, "optimizer-state": "fresh", "batch-size": 16, "local-epochs": 10,
          "local-steps": 0, "drop-last": False}

METHOD = Method("parameterized knowledge transfer for personalised FL: soft predictions on a "
                "public subset up; down each client's own target, the mix of everyone's by "
                "its row of an N x N knowledge-coefficient matrix the server learns (any "
                "architectures)",
                strategy_class="KTpFL", client_class="KTpFLClient", settings=KTpFLSettings,
                recipe=RECIPE, needs_public=True, public_labels=False,
                # The server learns coefficients from the individual uploads and mixes them per
                # client: a robust rule filters the uploads first, and a dropped one counts as
                # not sent (FedStrategy.teachers).
                payload_kinds=("teacher-predictions",),
                secure_aggregation=("its server learns each client's knowledge coefficients "
                                    "from the individual soft predictions and mixes them per "
                                    "client"),
                # Every row is a probability vector, which the server checks: value attacks
                # act on its logarithm and keep it one (as DS-FL's).
                upload_layout=UploadLayout(simplex=("probabilities",)))
