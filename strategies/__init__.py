"""The methods: one module each, registered here by the name the run config uses.

Adding a method = its module (a ``FedClient`` and a ``FedStrategy`` subclass), a frozen dataclass
of its own settings in ``strategies/settings.py`` if it has any, one entry in ``METHODS`` (with
the method's recipe: how its authors train a client), the settings' defaults under
``[tool.flwr.app.config.<method>]`` in ``pyproject.toml`` and a preset in ``conf/``.

The registry names each method's module and imports it only when its strategy or client is
asked for: listing the methods and checking settings (``fedapp methods``, ``fedapp settings``, a
refused setting) import no torch, so the command line answers in about a second
(docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from fedapp.config import (RECIPE_KEYS, SHARED_KEYS, ConfigError, RunConfig, explicit_layers,
                           parse_run_config, parse_settings, resolve_layers, settings_keys,
                           toml_value)
from strategies.settings import (CompFLSettings, FDSettings, FedClassAvgSettings, FedGenSettings,
                                 FedGHSettings, FedHeSettings, FedKDSettings, FedL2GSettings,
                                 FedMRLSettings, FedProtoSettings, FedRESettings, FedRepSettings,
                                 FedTGPSettings, FeloSettings, FMLSettings, VeloSettings)

if TYPE_CHECKING:
    from fedapp.runtime.client_base import FedClient
    from fedapp.runtime.strategy_base import FedStrategy


@dataclass(frozen=True)
class Method:
    """A method's two halves and the constraints it puts on the federation."""

    summary: str
    module: str                     # the method's module, e.g. "strategies.fedgh", and the
    strategy_class: str             # names of its FedStrategy and FedClient subclasses there
    client_class: str
    homogeneous_only: bool = False  # every client must run the same architecture
    shared_dim: bool = False        # d-sized vectors (head, representations, prototypes) are
                                    # exchanged, so every extractor must output the same d
    settings: type | None = None    # frozen dataclass of the method's own ``<method>.*`` keys
    asynchronous: bool = False      # its server folds in one upload at a time, so it can run
                                    # without a round barrier (server-loop = "async")
    decentralised: bool = False     # its models can travel client to client with the server
                                    # only relaying (server-loop = "walk" or "gossip")
    # How the method's authors train a client: shared training settings (RECIPE_KEYS) that
    # replace the global defaults when the run leaves them unset (docs/recipes.md says where
    # each value comes from). Empty: the global defaults are the method's recipe.
    recipe: Mapping[str, Any] = field(default_factory=dict)

    # The two halves: the method's module (its maths, torch) is imported on first use.
    @property
    def strategy(self) -> type[FedStrategy]:
        return getattr(importlib.import_module(self.module), self.strategy_class)

    @property
    def client(self) -> type[FedClient]:
        return getattr(importlib.import_module(self.module), self.client_class)


# The recipes: how each method's authors train a client (docs/recipes.md cites the paper and
# the code line for every value, and says where we deviate and why).
# FedHe's code compiles one Keras Adam per client, kept for the whole run; 3 batches of 50.
_FEDHE = {"optimizer": "adam", "lr": 0.001, "weight-decay": 0.0, "grad-clip": 0.0,
          "optimizer-state": "keep", "batch-size": 50, "local-steps": 3}
# Felo/Velo's code: one Adam per client with a MultiStepLR (x0.1 at half the run on
# Fashion-MNIST) kept for the whole run; 10 batches of 50 per update.
_FELO = {"optimizer": "adam", "lr": 0.001, "weight-decay": 0.0, "grad-clip": 0.0,
         "lr-decay-at": "0.5", "lr-decay": 0.1, "optimizer-state": "keep", "batch-size": 50,
         "local-steps": 10}
# The FedAvg family as LG-FedAvg's and FedRep's authors train it: SGD with momentum 0.5, a
# new optimizer every round, no clipping.
_SGD_HALF = {"optimizer": "sgd", "lr": 0.01, "momentum": 0.5, "grad-clip": 0.0,
             "optimizer-state": "fresh"}
# HtFLlib's shared client recipe (FD, FedRE, FedTGP, FedGen, FedL2G, FML, FedMRL, FedKD): plain
# SGD 0.01 without momentum, weight decay or clipping, built in every round's train(); batch 10,
# one epoch, drop_last; d = 512. FedL2G clips at 100, FML and FedKD at 10.
_HTFLLIB = {"optimizer": "sgd", "lr": 0.01, "momentum": 0.0, "weight-decay": 0.0,
            "grad-clip": 0.0, "optimizer-state": "fresh", "batch-size": 10, "drop-last": True,
            "local-epochs": 1, "local-steps": 0, "feature-dim": 512}

METHODS: dict[str, Method] = {
    "standalone": Method("local training only; no communication (lower bound)",
                         "strategies.standalone", "Standalone", "StandaloneClient",
                         asynchronous=True,
                         # Local training has no message boundary: one optimizer throughout.
                         recipe={"optimizer-state": "keep"}),
    "fedavg": Method("average the whole model (homogeneous architectures only)",
                     "strategies.fedavg", "FedAvg", "FedAvgClient", homogeneous_only=True,
                     recipe={**_SGD_HALF, "weight-decay": 0.0, "batch-size": 50}),
    "lg-fedavg": Method("average only the shared head; extractors stay local",
                        "strategies.lg_fedavg", "LgFedAvg", "LgFedAvgClient", shared_dim=True,
                        recipe={**_SGD_HALF, "weight-decay": 0.0, "batch-size": 50}),
    "fedclassavg": Method("average the shared classifier; supervised contrastive loss (views "
                          "by setting) + CE + rho * proximal term to the global classifier",
                          "strategies.fedclassavg", "FedClassAvg", "FedClassAvgClient",
                          shared_dim=True, settings=FedClassAvgSettings,
                          # Paper Table 1 (Fashion-MNIST) and the code's Adam(0.5, 0.999),
                          # built anew each round, no decay, no clipping, drop_last.
                          recipe={"optimizer": "adam", "lr": 0.0006, "adam-beta1": 0.5,
                                  "adam-beta2": 0.999, "weight-decay": 0.0, "grad-clip": 0.0,
                                  "optimizer-state": "fresh", "batch-size": 64,
                                  "drop-last": True, "local-epochs": 1, "feature-dim": 512}),
    "fedgh": Method("server trains a global header on clients' per-class averaged "
                    "representations",
                    "strategies.fedgh", "FedGH", "FedGHClient", shared_dim=True,
                    settings=FedGHSettings,
                    # The heterogeneous script's SGD, new for every client and round; its
                    # 30 epochs of 512 (grid-searched in the paper) are left to presets.
                    recipe={"optimizer": "sgd", "lr": 0.01, "momentum": 0.9,
                            "weight-decay": 0.001, "grad-clip": 50.0,
                            "optimizer-state": "fresh"}),
    "fedproto": Method("per-class prototypes up, count-weighted global prototypes down; "
                       "CE + lambda * distance",
                       "strategies.fedproto", "FedProto", "FedProtoClient", shared_dim=True,
                       settings=FedProtoSettings,
                       # The authors' batch is 4; HtFLlib's 10 is the practical one.
                       recipe={**_SGD_HALF, "weight-decay": 0.0, "batch-size": 10,
                               "drop-last": True}),
    "fedhe": Method("per-class average logits up and down; CE + alpha * logit loss "
                    "(any architectures)",
                    "strategies.fedhe", "FedHe", "FedHeClient", settings=FedHeSettings,
                    asynchronous=True, recipe=_FEDHE),
    "fedper": Method("average the extractors within each architecture; heads stay private",
                     "strategies.fedper", "FedPer", "FedPerClient",
                     recipe={**_SGD_HALF, "weight-decay": 0.0001, "batch-size": 10}),
    "fedrep": Method("as fedper, trained head first (extractor frozen), then extractor (head "
                     "frozen)",
                     "strategies.fedrep", "FedRep", "FedRepClient", settings=FedRepSettings,
                     recipe={**_SGD_HALF, "weight-decay": 0.0001, "batch-size": 10}),
    "compfl": Method("experts ordered by size share per-architecture extractors; prototype "
                     "head adaptation, epsilon-greedy expert choice, CE + lambda * alignment + "
                     "mu * ensemble KD",
                     "strategies.compfl", "CompFL", "CompFLClient", settings=CompFLSettings,
                     decentralised=True,
                     # Paper App. B with FedPAC's learning rate (CompFL gives none).
                     recipe={**_SGD_HALF, "weight-decay": 0.0005, "batch-size": 50,
                             "local-epochs": 5}),
    "felo": Method("per-class mean features and logits up, their per-class averages down; "
                   "CE + alpha * (feature MSE + logit KL); same-architecture models averaged",
                   "strategies.felo", "Felo", "FeloClient", shared_dim=True,
                   settings=FeloSettings, recipe=_FELO),
    "velo": Method("Felo whose server trains a conditional VAE on the features and sends one "
                   "decoded feature per class",
                   "strategies.velo", "Velo", "VeloClient", shared_dim=True,
                   settings=VeloSettings, recipe=_FELO),
    "fedgen": Method("heads averaged; the server trains a feature generator on the ensemble of "
                     "the heads, and clients train their heads on its features too",
                     "strategies.fedgen", "FedGen", "FedGenClient", shared_dim=True,
                     settings=FedGenSettings, recipe=_HTFLLIB),
    "fedl2g": Method("learnable per-class guiding vectors (features or logits) the server updates "
                     "with the clients' meta-gradients of a held-out quiz loss; CE + MSE to them",
                     "strategies.fedl2g", "FedL2G", "FedL2GClient", settings=FedL2GSettings,
                     recipe={**_HTFLLIB, "grad-clip": 100.0}),  # clientl2g_feat.py:53
    "fml": Method("a private model and a shared meme model (one architecture, averaged) "
                  "trained by mutual learning: CE + KL to each other",
                  "strategies.fml", "FML", "FMLClient",
                  settings=FMLSettings, recipe={**_HTFLLIB, "grad-clip": 10.0}),
    "fedmrl": Method("a shared small model beside each private one; a private projector fuses "
                     "both features, the shared head reads its first s dimensions, the private "
                     "head all (Matryoshka); the shared model is averaged",
                     "strategies.fedmrl", "FedMRL", "FedMRLClient",
                     settings=FedMRLSettings, recipe=_HTFLLIB),
    "fedkd": Method("a private mentor and a shared mentee (averaged) by adaptive mutual "
                    "distillation (KL + hidden MSE, scaled by the task losses); the mentee's "
                    "updates travel as truncated SVD factors",
                    "strategies.fedkd", "FedKD", "FedKDClient",
                    settings=FedKDSettings, recipe={**_HTFLLIB, "grad-clip": 10.0}),
    "fd": Method("federated distillation: per-class average logits up, the other clients' "
                 "per-class averages down; CE + lambda * soft CE to them (any architectures)",
                 "strategies.fd", "FD", "FDClient",
                 settings=FDSettings, asynchronous=True, recipe=_HTFLLIB),
    "fedre": Method("one random convex mix of the class prototypes with its soft label up; the "
                    "server trains a global head on the mixes and sends it",
                    "strategies.fedre", "FedRE", "FedREClient", shared_dim=True,
                    settings=FedRESettings, asynchronous=True,
                    # The FedRE repository's defaults (main.py: -lr 0.03, -lbs 64).
                    recipe={**_HTFLLIB, "lr": 0.03, "batch-size": 64}),
    "fedtgp": Method("FedProto whose server trains the global prototypes (a class-embedding "
                     "network) with an adaptive margin; nearest-prototype inference",
                     "strategies.fedtgp", "FedTGP", "FedTGPClient", shared_dim=True,
                     settings=FedTGPSettings, recipe=_HTFLLIB),
}


def method_keys() -> dict[str, dataclasses.Field]:
    """Every method's own settings: ``<method>.<key>`` -> its field (help, default, rule)."""
    keys = {}
    for name, method in METHODS.items():
        if method.settings is not None:
            keys.update(settings_keys(method.settings, name))
    return keys


def effective_settings(flat: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(the run config with the chosen method's recipe in its layer, the layer of every shared
    key): global defaults < recipe < preset < --set (``fedapp.config.resolve_layers``). Refuses
    an unknown method or a bad value before any recipe is looked up."""
    keys = method_keys()
    parsed = parse_run_config(flat, method_keys=keys)  # bad keys and values first
    unknown = [k for k in explicit_layers(parsed.explicit_settings)
               if k not in SHARED_KEYS and k not in keys]
    if unknown:
        raise ConfigError(f"setting explicit-settings = {parsed.explicit_settings!r} is "
                          f"invalid: {', '.join(unknown)} is not a setting.")
    method = METHODS.get(parsed.method)
    if method is None:
        raise ConfigError(f"setting method = {parsed.method!r} is invalid: expected one of "
                          + ", ".join(repr(m) for m in METHODS) + ".")
    return resolve_layers(flat, parsed.method, method.recipe)


def settings_report(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"settings": {key: effective value}, "layers": {key: layer}}`` for every shared key and
    the chosen method's own keys: what ``fedapp settings`` prints and ``config.json`` holds."""
    effective, layers = effective_settings(flat)
    method = effective.get("method", SHARED_KEYS["method"].default)
    explicit = explicit_layers(str(effective.get("explicit-settings", "")))
    values = {key: effective.get(key, f.default) for key, f in SHARED_KEYS.items()}
    if METHODS[method].settings is not None:
        for key, f in settings_keys(METHODS[method].settings, method).items():
            values[key] = effective.get(key, f.default)
            layers[key] = explicit.get(key) or ("config" if values[key] != f.default
                                                else "default")
    return {"settings": values, "layers": layers}


def recipe_line(report: Mapping[str, Mapping[str, Any]]) -> str:
    """The training recipe in force, in one line: every recipe key's effective value, and which
    of them the run set itself (the first line a run prints)."""
    values, layers = report["settings"], report["layers"]
    method = values["method"]
    used = "recipe" if values["recipe"] == "method" and METHODS[method].recipe else "defaults"
    # Only what the optimizer in force reads: no momentum for Adam, no betas for SGD.
    unused = {"sgd": ("adam-beta1", "adam-beta2"), "adam": ("momentum",)}[values["optimizer"]]
    keys = [k for k in RECIPE_KEYS if k not in unused]
    own = [f"{k} ({layers[k]})" for k in keys if layers[k] not in ("default", f"recipe {method}")]
    return (f"training recipe: {method}'s {used} (docs/recipes.md): "
            + ", ".join(f"{k} = {toml_value(values[k])}" for k in keys)
            + (f"; set by this run: {', '.join(own)}" if own else ""))


def load_config(flat: Mapping[str, Any]) -> RunConfig:
    """Validate a whole flat run config, method constraints included (before any training),
    with the chosen method's recipe applied to the training settings the run left unset.

    Every method's section is checked, not only the chosen one's, so that a typo in a setting
    of another method is caught too; the chosen method's settings land in ``cfg.settings``."""
    flat = effective_settings(flat)[0]
    cfg = parse_run_config(flat, method_keys=method_keys())
    sections = {name: parse_settings(m.settings, flat, name)
                for name, m in METHODS.items() if m.settings is not None}
    cfg = dataclasses.replace(cfg, settings=sections.get(cfg.method))
    method = METHODS[cfg.method]
    from fedapp.data.setup import architectures  # models import torch; keep this module light
    try:
        archs = architectures(cfg)
    except ValueError as exc:  # ModelConfigError: unknown architecture or assignment
        raise ConfigError(f"setting arch-mix = {cfg.arch_mix!r} is invalid: {exc}") from None
    if method.homogeneous_only and len(set(archs)) > 1:
        raise ConfigError(
            f"method {cfg.method!r} averages whole models, so every client needs the same "
            f"architecture, but arch-mix = {cfg.arch_mix!r} gives {sorted(set(archs))}. Use "
            "one architecture (e.g. --set arch-mix=\"cnn1\") or a heterogeneous method "
            "(lg-fedavg, standalone).")
    if method.shared_dim and cfg.feature_dim == 0 and len(set(archs)) > 1:
        raise ConfigError(
            f"method {cfg.method!r} exchanges d-dimensional vectors (heads, representations or "
            "prototypes), so every extractor must output the same dimension: set feature-dim "
            "> 0 (got 0 = each model's own) or use one architecture.")
    if cfg.server_loop == "async" and not method.asynchronous:
        raise ConfigError(
            f"setting server-loop = 'async' is invalid for method {cfg.method!r}: its server "
            "aggregates a whole round of uploads at once. Methods that take one upload at a "
            "time: " + ", ".join(n for n, m in METHODS.items() if m.asynchronous) + ".")
    if cfg.server_loop in ("walk", "gossip") and not method.decentralised:
        raise ConfigError(
            f"setting server-loop = {cfg.server_loop!r} is invalid for method {cfg.method!r}: "
            "device-to-device loops pass models from client to client, which only methods "
            "whose models are per-architecture experts can do: "
            + ", ".join(n for n, m in METHODS.items() if m.decentralised) + ".")
    check = getattr(cfg.settings, "check", None)
    if check is not None:
        check(cfg)  # the method's cross-setting rules; raises ConfigError
    return cfg
