"""The settings every two-model method has (FML, FedMRL, FedKD: ``fedapp/runtime/two_models.py``).

``<method>.shared-arch`` and ``<method>.average``: each of those methods' settings dataclass
derives from :class:`SharedModelSettings`. No torch at the top of this module, so that the
methods' cards (``strategies/*/__init__.py``), which the command line reads, stay light; the
check that builds the shared model imports the models when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import ConfigError, RunConfig, opt


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
