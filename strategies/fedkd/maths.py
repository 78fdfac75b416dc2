"""FedKD (Wu et al., Nature Communications 2022): adaptive mutual distillation between a
private mentor and a small shared mentee, whose updates travel as truncated SVD factors.

Client i holds its private mentor theta_i (its own architecture, representation z, logits o),
a copy of the shared mentee phi (one architecture for everyone, ``fedapp.runtime.two_models``;
z', o') and a private W_h = Linear(d', d, no bias) mapping the mentee's representation onto the
mentor's. With p = softmax(o), q = softmax(o') and S = CE(o, y) + CE(o', y), each batch trains

    L = CE(o, y) + CE(o', y) + [KL(q || p) + KL(p || q) + MSE(z, W_h z')] / S

the distillation and hidden terms shrinking while the two models still fit poorly (the paper's
adaptive loss): each KL holds its partner's prediction constant, S weighs without being
trained, and the hidden term, shared by the mentor's and the mentee's losses, counts once.
The mentee steps at ``fedkd.mentee-lr`` (0 = the recipe's), the mentor and W_h at the recipe's.
The mentor alone predicts.

Communication (the paper, ``fedkd.compress = "update"``): a client uploads its mentee's update
Delta_i = phi_trained - phi_start, compressed; the server reconstructs the uploads, averages
them (by training-set size), compresses the average and adds exactly what it will send to its
global phi; the next round's clients add the same compressed average to the phi they kept.
A client whose copy is not the previous global phi (it missed a round, or its upload was
refused) gets the whole phi instead, once; each download carries the versions it goes from and
to, so a client out of step refuses it (and then gets the whole phi). Integer buffers travel as
values. ``"weights"`` is HtFLlib's form: the mentee's weights themselves, compressed both ways
(the server's average with the energy of the round that made it; nothing goes down in round 1,
when every client holds the run's initial mentee).

The codec (:func:`compress`, :func:`decompress`): each float tensor with at least 2 dimensions
and a first dimension above 1 (a 4-D convolution flattened to out x in*k*k, PFLlib #265, not
sliced per kernel position) becomes U_r, s_r, V_r with r the smallest rank whose leading
singular values hold more than the energy e of the total, sum_{j<r} s_j^2 > e sum s_j^2; a
matrix whose factors would not be smaller than itself (full rank always) travels as it is,
exactly. Other arrays travel as they are. e follows the paper's schedule from ``energy-start``
to ``energy-end``: e(t) = Ts + (t - 1)/R (Te - Ts) in round t of R. HtFLlib's rank search never
tries the full rank, so a matrix that needs all its singular values arrives as zeros:
``fedkd.rank-rule = "htfllib"`` reproduces that; ``fedkd.htfllib-loss = true`` its loss (no
partner held constant, S trained, the hidden term counted twice). ``fedkd.codec = "htfllib"``
its factors: ``np.linalg.svd`` of a 4-D convolution factors each k x k kernel on its own
(U [out, in, k, r], s [out, in, r], V [out, in, r, k]) with one rank for the layer, chosen
from the kernels' energies pooled index by index, and every factorised tensor travels as
factors, even where they are larger than the tensor.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord

from fedapp.runtime.client_base import load_arrays, state_arrays
from fedapp.runtime.payload import ArraySpec, Payload, PayloadError, validate
from fedapp.runtime.strategy_base import ClientInfo, Upload
from fedapp.runtime.two_models import SharedModelStrategy, TwoModelClient, kl_to
from strategies.fedkd import FedKDSettings

VERSION = "fedkd.version"   # a download's [from, to] versions of the global mentee (-1: whole)
FACTORS = (":U", ":s", ":V")
HELD_KEY = "fedkd.held"      # the version of the global mentee a client keeps


def energy(settings: FedKDSettings, server_round: int, num_rounds: int) -> float:
    """The energy threshold of ``server_round`` (1-based) of ``num_rounds``."""
    s = settings
    return s.energy_start + (server_round - 1) / num_rounds * (s.energy_end - s.energy_start)


# -- the codec ---------------------------------------------------------------------------------

def svd_rank(singular_values: np.ndarray, threshold: float, rule: str = "energy") -> int:
    """The rank kept: the smallest r with sum_{j<r} s_j^2 > threshold * sum s_j^2 (the full
    rank when rounding leaves none; 0 for a zero matrix). ``"htfllib"``: as HtFLlib, the full
    rank is never tried and gives 0."""
    energy_ = np.cumsum(np.square(singular_values.astype(np.float64)))
    if energy_.size == 0 or energy_[-1] == 0:
        return 0
    hits = np.flatnonzero(energy_ > threshold * energy_[-1])
    rank = int(hits[0]) + 1 if hits.size else len(energy_)
    return 0 if rule == "htfllib" and rank == len(energy_) else rank


def compressible(array: np.ndarray) -> bool:
    """Whether a tensor goes through the SVD: float, >= 2 dimensions, first dimension > 1."""
    return array.dtype.kind == "f" and array.ndim >= 2 and array.shape[0] > 1


def matrices(array: np.ndarray, codec: str) -> np.ndarray:
    """The matrices the codec factors: with ``"htfllib"`` a convolution's kernels
    [out, in, k, k], else out x the rest."""
    if codec == "htfllib" and array.ndim == 4:
        return array
    return array.reshape(array.shape[0], -1)


def compress(arrays: Payload, threshold: float, rule: str = "energy",
             codec: str = "compact") -> Payload:
    """Each compressible tensor as ``name:U`` [..., m, r], ``name:s`` [..., r], ``name:V``
    [..., r, n] (``"compact"``: or itself when its factors would not be smaller), the others
    as they are; float32."""
    out: Payload = {}
    for name, array in arrays.items():
        if not compressible(array):
            out[name] = array
            continue
        stack = matrices(array, codec).astype(np.float64)
        u, s, vt = np.linalg.svd(stack, full_matrices=False)
        # Per kernel: one rank for the layer, from the j-th singular values' energy summed
        # over its kernels (HtFLlib's search over the pooled sigma).
        pooled = np.sqrt(np.square(s).reshape(-1, s.shape[-1]).sum(axis=0))
        rank = svd_rank(pooled, threshold, rule)
        m, n = stack.shape[-2:]
        if codec == "compact" and rank and rank * (m + n + 1) >= m * n:
            out[name] = array.astype(np.float32)  # exact, and no larger than factors
            continue
        for suffix, factor in zip(FACTORS, (u[..., :rank], s[..., :rank], vt[..., :rank, :])):
            out[name + suffix] = np.ascontiguousarray(factor, dtype=np.float32)
    return out


def decompress(payload: Payload, like: Payload) -> Payload:
    """The tensors of ``like`` (names, shapes, dtypes) from a compressed payload."""
    out: Payload = {}
    for name, template in like.items():
        if name in payload:
            out[name] = payload[name].reshape(template.shape).astype(template.dtype)
            continue
        u, s, vt = (payload[name + suffix].astype(np.float64) for suffix in FACTORS)
        out[name] = ((u * s[..., None, :]) @ vt).reshape(template.shape).astype(template.dtype)
    return out


def codec_spec(like: Payload, payload: Payload,
               codec: str = "compact") -> dict[str, ArraySpec]:
    """What a compressed ``like`` must look like: every tensor either as itself or, when the
    payload names any of its factors, as its three factors of one rank."""
    specs: dict[str, ArraySpec] = {}
    for name, template in like.items():
        if compressible(template) and any(name + f in payload for f in FACTORS):
            *batch, m, n = matrices(template, codec).shape
            specs.update({name + ":U": ArraySpec((*batch, m, None)),
                          name + ":s": ArraySpec((*batch, None)),
                          name + ":V": ArraySpec((*batch, None, n))})
        else:
            specs[name] = ArraySpec(template.shape,
                                    "float" if template.dtype.kind == "f" else "int")
    return specs


def check_factors(payload: Payload, like: Payload, codec: str = "compact") -> None:
    """One rank per tensor's factors, at most the matrix's."""
    for name, template in like.items():
        if name + ":s" not in payload:
            continue
        u, s, vt = (payload[name + suffix] for suffix in FACTORS)
        full = min(matrices(template, codec).shape[-2:])
        if not u.shape[-1] == s.shape[-1] == vt.shape[-2] or s.shape[-1] > full:
            raise PayloadError(f"the factors of {name!r} have ranks {u.shape[-1]}, "
                               f"{s.shape[-1]}, {vt.shape[-2]}: expected one rank <= {full}")


def add_update(base: Payload, update: Payload) -> Payload:
    """base + update for float tensors (float32, as every client adds); integer buffers take
    the update's values."""
    return {k: (base[k] + update[k]).astype(np.float32) if base[k].dtype.kind == "f"
            else update[k] for k in base}


# -- the loss ----------------------------------------------------------------------------------

def fedkd_loss(o: torch.Tensor, z: torch.Tensor, o_m: torch.Tensor, z_m: torch.Tensor,
               w_h: torch.nn.Module, y: torch.Tensor, settings: FedKDSettings) -> torch.Tensor:
    """The mentor's and the mentee's adaptive losses, summed (see the module docstring)."""
    task, task_m = F.cross_entropy(o, y), F.cross_entropy(o_m, y)
    scale = task + task_m
    hidden = F.mse_loss(z, w_h(z_m))
    if settings.htfllib_loss:
        distill = kl_to(o_m, o, settings.kl) + kl_to(o, o_m, settings.kl)
        return task + task_m + (distill + 2 * hidden) / scale
    distill = kl_to(o_m.detach(), o, settings.kl) + kl_to(o.detach(), o_m, settings.kl)
    return task + task_m + (distill + hidden) / scale.detach()


class FedKDClient(TwoModelClient):
    """Applies the downloaded (compressed) mentee, trains mentor, mentee and W_h on the
    adaptive loss, uploads the mentee's compressed update (or weights)."""

    def private_modules(self) -> dict[str, Callable[[], torch.nn.Module]]:
        d_m, d = self.shared.feature_dim, self.model.feature_dim
        return {"hidden": lambda: torch.nn.Linear(d_m, d, bias=False)}

    def module_lr(self, name: str) -> float | None:
        return (self.cfg.settings.mentee_lr or None) if name == "shared" else None

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z, z_m = self.model.features(x), self.shared.features(x)
        return fedkd_loss(self.model.head(z), z, self.shared.head(z_m), z_m,
                          self.modules["hidden"], y, self.cfg.settings)

    def receive(self, payload: Payload, server_round: int) -> None:
        s = self.cfg.settings
        self.threshold = energy(s, server_round, self.cfg.num_server_rounds)
        mine = state_arrays(self.shared)
        if s.compress == "weights":
            if payload:  # else round 1: the run's initial mentee, which every client holds
                load_arrays(self.shared, decompress(payload, mine))
            return
        held = int(self.context.state[HELD_KEY]["version"]) if HELD_KEY in self.context.state \
            else 0  # a client starts from the run's initial mentee, version 0
        start, self.version = (int(v) for v in payload[VERSION])
        body = {k: v for k, v in payload.items() if k != VERSION}
        if start == -1:  # the whole mentee
            load_arrays(self.shared, body)
        elif start != held:
            raise PayloadError(f"the server sent the update from version {start} of the "
                               f"mentee, but this client holds version {held}")
        elif body:
            load_arrays(self.shared, add_update(mine, decompress(body, mine)))
        self.start = state_arrays(self.shared)

    def upload(self) -> Payload:
        s = self.cfg.settings
        trained = state_arrays(self.shared)
        if s.compress == "weights":
            return compress(trained, self.threshold, s.rank_rule, s.codec)
        update = {k: v - self.start[k] if v.dtype.kind == "f" else v for k, v in trained.items()}
        # Kept: the global mentee this round started from, to which the next update applies.
        load_arrays(self.shared, self.start)
        return compress(update, self.threshold, s.rank_rule, s.codec)

    def save_state(self, server_round: int) -> None:
        if self.cfg.settings.compress == "update":
            self.context.state[HELD_KEY] = ConfigRecord({"version": self.version})
        super().save_state(server_round)


class FedKD(SharedModelStrategy):
    """Keeps the global mentee; averages the reconstructed uploads (each reconstructed once,
    when it is accepted, and bounded as reconstructed); sends the compressed average update to
    clients that hold the previous global mentee, the whole one to others."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.version = 0                    # aggregations so far
        self.holds: dict[int, int] = {}     # partition id -> version it keeps (default 0)
        self.last_update: Payload = {}      # the compressed update from version - 1
        self._sent: dict[tuple, Payload] = {}

    def threshold(self, server_round: int) -> float:
        return energy(self.cfg.settings, server_round, self.cfg.num_server_rounds)

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        if client is None:
            return {}
        s = self.cfg.settings
        if s.compress == "weights":
            # The average compressed when it was made; nothing before the first one: every
            # client already holds the run's initial mentee, as HtFLlib's clients copy it.
            return self.last_update
        # One dict per distinct download and round: encoded once, whoever it goes to.
        held = self.holds.get(client.partition_id, 0)
        start = held if held in (self.version, self.version - 1) else -1  # -1: the whole phi
        key = (start, self.version)
        if key not in self._sent:
            body = ({} if start == self.version else self.last_update if start >= 0
                    else self.shared_model)
            self._sent = {k: v for k, v in self._sent.items() if k[-1] == self.version}
            self._sent[key] = {**body, VERSION: np.array(key, np.int64)}
        return self._sent[key]

    def validate_upload(self, payload: Payload, client: ClientInfo) -> None:
        # Which tensors came as factors is in the names: the spec follows them.
        codec = self.cfg.settings.codec
        validate(payload, codec_spec(self.shared_model, payload, codec))
        check_factors(payload, self.shared_model, codec)

    def decode_upload(self, payload: Payload, client: ClientInfo) -> Payload:
        # The server averages U s V^T, not the factors: the base bounds these, and factors
        # within upload-max-abs can multiply to far beyond it (r * 1e12 at 1e4 each).
        return decompress(payload, self.shared_model)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        s = self.cfg.settings
        received = [u.payload for u in uploads]  # reconstructed once, by decode_upload
        # An update is measured from no change, weights from the current mentee.
        reference = self.shared_model if s.compress == "weights" else \
            {k: np.zeros_like(v) for k, v in received[0].items()}
        average = self.average(received, self.average_weights(uploads), reference=reference)
        # Compressed with this round's energy, as the clients' uploads were.
        self.last_update = compress(average, self.threshold(server_round), s.rank_rule,
                                    s.codec)
        if s.compress == "weights":
            self.shared_model = decompress(self.last_update, self.shared_model)
            return
        # The global mentee moves by exactly what its holders will add.
        self.shared_model = add_update(self.shared_model,
                                       decompress(self.last_update, self.shared_model))
        for upload in uploads:
            self.holds[upload.client.partition_id] = self.version
        self.version += 1
