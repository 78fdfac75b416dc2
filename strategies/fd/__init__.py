"""FD's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import ConfigError, RunConfig, UploadLayout, opt
from fedapp.runtime.recipes import HTFLLIB
from strategies import Method


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

    def secure_aggregation_conflict(self, cfg: RunConfig) -> str | None:
        """Why these settings need individual uploads (None: exact from a round's sums)."""
        if self.resolved_history(cfg) == "latest-per-client":
            return ("fd.history = 'latest-per-client': the server sees only the sum of a "
                    "round's uploads, and this history replaces each client's rows with its "
                    "newest, while the server holds a client's older rows only inside a past "
                    "round's sum; use fd.history = 'round' (what 'auto', the default, takes "
                    "in rounds)")
        return None

    def resolved_history(self, cfg: RunConfig) -> str:
        if self.history != "auto":
            return self.history
        return "latest-per-client" if cfg.server_loop == "async" else "round"


METHOD = Method("federated distillation: per-class average logits up, the other clients' "
                "per-class averages down; CE + lambda * soft CE to them (any architectures)",
                strategy_class="FD", client_class="FDClient",
                settings=FDSettings, asynchronous=True, recipe=HTFLLIB,
                payload_kinds=("class-rows",),
                secure_aggregation="fixed-layout",
                upload_layout=UploadLayout(labels="labels", rows=("logits",), logits=("logits",)))
