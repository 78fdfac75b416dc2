"""FedClassAvg's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import opt
from strategies import Method


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


METHOD = Method("average the shared classifier; supervised contrastive loss (views "
                "by setting) + CE + rho * proximal term to the global classifier",
                strategy_class="FedClassAvg", client_class="FedClassAvgClient",
                shared_dim=True, settings=FedClassAvgSettings,
                # Paper Table 1 (Fashion-MNIST) and the code's Adam(0.5, 0.999),
                # built anew each round, no decay, no clipping, drop_last.
                recipe={"optimizer": "adam", "lr": 0.0006, "adam-beta1": 0.5,
                        "adam-beta2": 0.999, "weight-decay": 0.0, "grad-clip": 0.0,
                        "optimizer-state": "fresh", "batch-size": 64,
                        "drop-last": True, "local-epochs": 1, "feature-dim": 512},
                payload_kinds=("model",),
                secure_aggregation="as-is")
