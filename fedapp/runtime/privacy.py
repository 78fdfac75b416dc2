"""Client-level differential privacy (``differential-privacy = true``), for every method it can
protect, from the method's card alone (docs/privacy.md says what each method keeps private and
what still leaks).

The unit is the client: a neighbouring federation has one client's data replaced by anything
(replace-one, the relation of the accountant for a fixed number of clients sampled without
replacement, as :meth:`FedStrategy.configure_fit` samples them). The mechanism:

1. **Clip the whole upload.** Every float array of a client's upload is taken as its change
   from the array it was sent under the same name and shape (the state it trained from), or as
   it is when it was sent no such array (prototypes, logits), and the concatenation of all of
   them is scaled down to L2 norm ``S = dp-clip-norm`` if longer. Any reference the server
   made public is allowed: it changes utility, not privacy.
2. **Add Gaussian noise** of standard deviation ``2 z S`` (``z = dp-noise-multiplier``): the
   replace-one sensitivity of a sum of clipped uploads is ``2 S`` (one client's clipped vector
   swapped for another), and dp-accounting's noise multiplier is the noise's std over that
   sensitivity. Where the noise goes comes from the card's ``payload_kinds``:

   - ``"server"`` mode — the server only *averages* whole models (kinds ``model`` and
     ``group-model``: FedAvg, LG-FedAvg, FML, FedPer, CompFL, ...). Every such average goes
     through :meth:`FedStrategy.average` / :meth:`FedStrategy.average_per_group`, which become
     the clipped uploads' unweighted mean plus ``N(0, (2 z S / m)^2)`` per coordinate, m the
     number of uploads in that average (each architecture's group is a separate release of
     disjoint clients, so a client is in one of them). Central DP: the server sees individual
     uploads and must be trusted (or run under secure aggregation, which hides them).
   - ``"client"`` mode — the server keeps per-class rows or trains on individual uploads
     (kinds ``class-rows``, ``server-training``, ``teachers``, ``group-teachers``,
     ``teacher-predictions``, ``server-distillation``): each client noises its own clipped upload
     with ``N(0, (2 z S)^2)`` before it leaves (local DP); whatever the server computes from
     noisy uploads is post-processing.

   Integer arrays (label lists, BatchNorm's step counter) and the names of the arrays travel as
   they are: what they say is not protected (docs/privacy.md lists it per method).
3. **Account.** Every round that samples m of the N clients composes one
   ``GaussianPrivacyEvent(z, m, N)`` in Flower's ``RdpAccountant`` (Google's dp-accounting,
   Renyi DP, sampling without replacement); epsilon at ``dp-delta`` goes into every round's
   record and the summary, the event ledger into the server's checkpoint, and with
   ``dp-target-epsilon`` set the run stops before a round that would spend more.

Noise is drawn from generators keyed by (seed, round, who: the group or the partition), as every
other random stream of the project: one seed, one result. Anyone who knows the seed can redraw
the noise, so a deployment that relies on the guarantee sets a secret in the environment
variable ``FEDAPP_DP_NOISE_KEY`` (on the server in server mode, on every SuperNode in client
mode), which joins the key.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any, Hashable, Mapping, Sequence

import numpy as np

from fedapp.config import ConfigError, RunConfig, sampled_per_round
from fedapp.seeding import derive_seed

NOISE_KEY_ENV = "FEDAPP_DP_NOISE_KEY"
# The payload kinds (fedapp.config.PAYLOAD_KINDS) whose server needs only an average of whole
# uploads: the noise can go on that average, once, on the server.
SERVER_KINDS = frozenset({"model", "group-model"})
STATE_KEY = "privacy-ledger"  # the accountant's events in the server's checkpoint


def mode_of(payload_kinds: Sequence[str]) -> str:
    """Where the noise goes for a method whose server combines ``payload_kinds``: "server"
    (only averages of whole models) or "client" (anything else it combines)."""
    return "server" if set(payload_kinds) <= SERVER_KINDS else "client"


def check_settings(cfg: RunConfig, method_name: str, payload_kinds: Sequence[str]) -> None:
    """The one check of the differential-privacy settings for every method, from its card:
    refuses (ConfigError naming the method and why) a method or a loop DP cannot protect,
    a combination that would void the calibration, and a budget too small for one round."""
    if not cfg.differential_privacy:
        return
    refuse = f"setting differential-privacy = true is invalid for method {method_name!r}"
    if not payload_kinds:
        raise ConfigError(f"{refuse}: its clients upload nothing the server combines, so "
                          "there is nothing to protect.")
    if cfg.server_loop != "rounds":
        raise ConfigError(
            f"{refuse} with server-loop = {cfg.server_loop!r}: the accountant counts rounds "
            "of clients sampled together from the federation, and this loop releases one "
            "client's upload (or model) at a time with no cohort; use server-loop = 'rounds'.")
    if mode_of(payload_kinds) == "server" and cfg.robust_aggregation != "none":
        raise ConfigError(
            f"{refuse} with robust-aggregation = {cfg.robust_aggregation!r}: its noise is "
            "calibrated to the mean of the clipped uploads, which a robust rule replaces "
            "(the clip itself already bounds what one client can move).")
    if cfg.dp_delta >= 1.0:
        raise ConfigError(f"setting dp-delta = {cfg.dp_delta} is invalid: delta must be "
                          "below 1 (typically below 1 / num-clients).")
    import importlib.util
    if importlib.util.find_spec("dp_accounting") is None:
        _flower_accounting()  # refuses, saying what to install
    m = sampled_per_round(cfg)
    # (Importing the accountant takes seconds: only a budget to check is worth it here.)
    if cfg.dp_target_epsilon and (accountant := Accountant.of(cfg)).would_exceed(m):
        raise ConfigError(
            f"setting dp-target-epsilon = {cfg.dp_target_epsilon} is invalid: a single round "
            f"(z = {cfg.dp_noise_multiplier}, {m} of {cfg.num_clients} clients) already spends "
            f"epsilon = {accountant.epsilon_after(m):.4g} at delta = {cfg.dp_delta}; raise the "
            "budget or dp-noise-multiplier.")


# -- the mechanism ---------------------------------------------------------------------------------

def clip(changes: Mapping[str, np.ndarray], bound: float) -> tuple[dict[str, np.ndarray], float]:
    """(``changes`` scaled together to L2 norm ``bound`` if their joint norm is larger, that
    norm): one client's whole upload is one vector, so no part of it escapes the bound."""
    norm = math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64)))
                         for v in changes.values()))
    scale = min(1.0, bound / norm) if norm > 0 else 1.0
    return {k: v.astype(np.float64) * scale for k, v in changes.items()}, norm


def noise_rng(cfg: RunConfig, *key: Hashable) -> np.random.Generator:
    """The generator of one release's noise: keyed by (seed, "dp-noise", the secret of
    ``FEDAPP_DP_NOISE_KEY`` if set, ``key``)."""
    return np.random.default_rng(derive_seed(cfg.seed, "dp-noise",
                                             os.environ.get(NOISE_KEY_ENV, ""), *key))


def _changes(upload: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray] | None,
             fixed: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """The float arrays of ``upload`` minus the same-named, same-shaped arrays of
    ``reference`` (0 where there is none); integer arrays and ``fixed`` ones left out."""
    reference = reference or {}
    out = {}
    for name, x in upload.items():
        if x.dtype.kind != "f" or name in fixed:
            continue
        r = reference.get(name)
        out[name] = x.astype(np.float64) - (r.astype(np.float64)
                                            if r is not None and r.shape == x.shape else 0.0)
    return out


def _restore(changes: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray] | None,
             like: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``reference + changes`` in the dtypes of ``like`` (inverse of :func:`_changes`)."""
    reference = reference or {}
    out = {}
    for name, change in changes.items():
        r = reference.get(name)
        base = r.astype(np.float64) if r is not None and r.shape == change.shape else 0.0
        out[name] = (base + change).astype(like[name].dtype)
    return out


def private_upload(upload: Mapping[str, np.ndarray], received: Mapping[str, np.ndarray],
                   cfg: RunConfig, partition_id: int, server_round: int) -> dict[str, np.ndarray]:
    """Client mode: ``upload`` clipped (its change from ``received``) and noised with
    ``N(0, (2 z S)^2)`` per float value, before it leaves the client. Integer arrays and the
    card's ``simplex`` arrays (probability vectors, which noise would take off the simplex:
    FedRE's mix weights, random, not data) go as they are; values
    stay within ``upload-max-abs`` (post-processing), so the server's checks pass."""
    fixed = cfg.upload_layout.simplex if cfg.upload_layout is not None else ()
    clipped, _ = clip(_changes(upload, received, fixed), cfg.dp_clip_norm)
    rng = noise_rng(cfg, "client", partition_id, server_round)
    std = 2.0 * cfg.dp_noise_multiplier * cfg.dp_clip_norm
    noisy = {k: v + std * rng.standard_normal(v.shape) for k, v in clipped.items()}
    bound = cfg.upload_max_abs
    out = {k: np.clip(v, -bound, bound).astype(v.dtype)
           for k, v in _restore(noisy, received, upload).items()}
    return {name: out.get(name, x) for name, x in upload.items()}


def private_mean(payloads: Sequence[Mapping[str, np.ndarray]],
                 reference: Mapping[str, np.ndarray] | None, bound: float, std_sum: float,
                 rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Server mode: ``reference + (sum of the clipped changes + N(0, std_sum^2)) / m`` for the
    float arrays; integer arrays (counters) as their plain rounded mean. Uniform weights: with
    n_k weights one client's share of the mean, hence the sensitivity, would depend on data."""
    if not payloads:
        raise ValueError("nothing to average")
    m = len(payloads)
    first = payloads[0]
    total: dict[str, np.ndarray] = {}
    for payload in payloads:
        clipped, _ = clip(_changes(payload, reference), bound)
        for name, change in clipped.items():
            total[name] = total.get(name, 0.0) + change
    noisy = {name: (s + std_sum * rng.standard_normal(s.shape)) / m for name, s in total.items()}
    out = {k: v.astype(np.float32) for k, v in _restore(noisy, reference, first).items()}
    for name, x in first.items():
        if name not in out:  # integer arrays
            out[name] = np.rint(np.mean([p[name].astype(np.float64) for p in payloads],
                                        axis=0)).astype(np.int64)
    return {name: out[name] for name in first}


# -- the accountant --------------------------------------------------------------------------------

def _flower_accounting():
    """Flower's accountant types (its RdpAccountant wraps dp-accounting); ConfigError when
    dp-accounting is not installed."""
    try:
        import dp_accounting  # noqa: F401  (Flower imports it lazily, with a vaguer message)
    except ImportError:
        raise ConfigError("differential-privacy = true needs the dp-accounting package, which "
                          "is not installed in this environment: reinstall the project "
                          "(`pip install -e .`, it is a dependency) or `pip install "
                          "'dp-accounting>=0.6,<0.7'`.") from None
    from flwr.serverapp import RdpAccountant
    from flwr.supercore.privacy_accounting import (GaussianPrivacyEvent, NeighboringRelation,
                                                   PrivacyConfig, SamplingMethod)
    return RdpAccountant, GaussianPrivacyEvent, NeighboringRelation, PrivacyConfig, \
        SamplingMethod


@dataclass
class Accountant:
    """The privacy spent by a run: one sampled-Gaussian event per round, composed in Flower's
    ``RdpAccountant`` (sampling without replacement, replace-one neighbours). Its ledger of
    events (``events``: (z, m) per round) is what a checkpoint keeps: the accountant is rebuilt
    from it on resume, never restarted."""

    noise_multiplier: float
    population: int
    delta: float
    budget: float = 0.0  # 0: none
    events: list[tuple[float, int]] = field(default_factory=list)

    @classmethod
    def of(cls, cfg: RunConfig) -> Accountant:
        accountant = cls(cfg.dp_noise_multiplier, cfg.num_clients, cfg.dp_delta,
                         cfg.dp_target_epsilon)
        accountant._backend()  # refuses a missing dp-accounting now, not at the first round
        return accountant

    def _backend(self, events: Sequence[tuple[float, int]] | None = None):
        rdp, event, relation, config, sampling = _flower_accounting()
        backend = rdp(config(target_delta=self.delta, population_size=self.population,
                             neighboring_relation=relation.REPLACE_ONE,
                             sampling_method=sampling.WITHOUT_REPLACEMENT))
        # Identical rounds composed at once: the RDP of a sampled Gaussian is computed once
        # per distinct (z, m), not once per round.
        counts: dict[tuple[float, int], int] = {}
        for key in self.events if events is None else events:
            counts[key] = counts.get(key, 0) + 1
        for (z, m), count in counts.items():
            backend.compose(event(z, m, self.population), count)
        return backend

    def spend(self, sampled: int) -> None:
        """One round's release: ``sampled`` clients of the population."""
        self.events.append((self.noise_multiplier, int(sampled)))

    def epsilon(self) -> float:
        """Epsilon at ``delta`` spent so far (0 before any release)."""
        return self.epsilon_of(self.events)

    def epsilon_of(self, events: Sequence[tuple[float, int]]) -> float:
        return float(self._backend(events).get_epsilon(self.delta)) if events else 0.0

    def epsilon_after(self, sampled: int) -> float:
        """Epsilon if one more round of ``sampled`` clients were released."""
        return self.epsilon_of([*self.events, (self.noise_multiplier, int(sampled))])

    def would_exceed(self, sampled: int) -> bool:
        """Whether one more round of ``sampled`` clients would pass the budget."""
        return bool(self.budget) and self.epsilon_after(sampled) > self.budget

    def record(self, mode: str, clip_norm: float) -> dict[str, Any]:
        """The ``privacy`` entry of a round record (rounds.jsonl, summary.json, TensorBoard's
        ``privacy/*`` scalars)."""
        last = self.events[-1][1] if self.events else 0
        return {"epsilon": self.epsilon(), "delta": self.delta, "releases": len(self.events),
                "noise_multiplier": self.noise_multiplier, "clip_norm": clip_norm,
                "sampling_rate": last / self.population, "mode": mode,
                **({"target_epsilon": self.budget} if self.budget else {})}


class PrivacyBudgetSpent(RuntimeError):
    """The next round would spend more than ``dp-target-epsilon``: the run stops cleanly."""


class ServerPrivacy:
    """What the strategy base does for differential privacy (``FedStrategy.privacy``; None
    when it is off): the accountant, and in server mode the noisy averages, one per group
    and round."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.mode = mode_of(cfg.payload_kinds)
        self.accountant = Accountant.of(cfg)
        self.round = 0
        self._released: set[Hashable] = set()
        if not os.environ.get(NOISE_KEY_ENV) and self.mode == "server":
            from flwr.common.logger import log
            log(WARNING, "differential-privacy: %s is not set, so the noise is drawn from the "
                "run's seed and anyone who knows the seed can remove it (fine for experiments; "
                "set it on a deployed server)", NOISE_KEY_ENV)

    def start_round(self, server_round: int, sampled: int) -> None:
        """Before a round samples ``sampled`` clients: stop if it would pass the budget."""
        if self.accountant.would_exceed(sampled):
            raise PrivacyBudgetSpent(
                f"round {server_round} would spend epsilon = "
                f"{self.accountant.epsilon_after(sampled):.4g} > dp-target-epsilon = "
                f"{self.accountant.budget} (spent so far: {self.accountant.epsilon():.4g} at "
                f"delta = {self.accountant.delta}); the run stops here")

    def released(self, server_round: int, sampled: int) -> None:
        """The round's uploads left their clients: one event, and server-mode averages open."""
        self.round = server_round
        self._released = set()
        if sampled:
            self.accountant.spend(sampled)

    def mean(self, payloads: Sequence[Mapping[str, np.ndarray]],
             reference: Mapping[str, np.ndarray] | None, group: Hashable = "all"
             ) -> dict[str, np.ndarray]:
        """Server mode: the noisy mean of one group's uploads (at most once per group and
        round: a second average of the same uploads would be a release not accounted for)."""
        if group in self._released:
            raise RuntimeError(f"differential-privacy: the uploads of group {group!r} were "
                               f"averaged twice in round {self.round}; the accountant counts "
                               "one release per round")
        self._released.add(group)
        std = 2.0 * self.cfg.dp_noise_multiplier * self.cfg.dp_clip_norm
        return private_mean(payloads, reference, self.cfg.dp_clip_norm, std,
                            noise_rng(self.cfg, "server", self.round, str(group)))

    def record(self) -> dict[str, Any]:
        return self.accountant.record(self.mode, self.cfg.dp_clip_norm)

    def state(self) -> list[tuple[float, int]]:
        return list(self.accountant.events)

    def load(self, events: Sequence[tuple[float, int]]) -> None:
        self.accountant.events = [(float(z), int(m)) for z, m in events]
