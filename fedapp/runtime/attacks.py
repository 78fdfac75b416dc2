"""Attacks on purpose, for robustness studies: what a malicious client does to its training
labels or to its upload, the same for every method (no torch, no Flower in here).

Which clients attack is drawn once per run from (seed, "malicious") (:func:`malicious_partitions`)
or named by ``malicious-clients``; what they do is the ``attack`` setting. Label flipping acts
on the client's training labels (:func:`flip_labels`, applied by the client base to its shard);
every other attack transforms the upload a method's client built (:func:`attack_upload`, applied
by the client base after ``upload()``), so a method needs no line of its own:

- on every float array ``x`` of the upload (integer arrays, labels and counts, are left as
  they are), with ``r`` the array of the same name and shape the client received this round
  (the global model it started from), else 0: ``sign-flip`` sends ``r - (x - r)`` (the update
  reversed), ``scale`` ``r + s (x - r)``, ``noise`` ``x + N(0, std^2)`` and ``collude``
  ``r + std N(0, 1)`` drawn from (seed, round, array name, class) only, so that every colluder
  sends the same values. An array a card lists as ``simplex`` (probability vectors along its
  last axis: FedRE's mix weights, DS-FL's and KT-pFL's predictions) is attacked the same way in
  log space, ``x`` and ``r`` replaced by their logarithms (``r`` = 0 where nothing of its name
  came down: the uniform vector's logits), and put back on the simplex by a softmax, so that it
  stays a probability vector the server accepts: ``scale`` sharpens it (``x^s`` renormalised),
  ``sign-flip`` turns it over (``1/x`` renormalised: the least likely class first);
- ``targeted`` acts on the rows the card's ``upload_layout`` declares per class: every class's
  feature row (prototype, representation) becomes the client's row of the target class, and
  every logit row has its own class's column swapped with the target's, so that the server
  learns "class c looks like / predicts the target" (Fang et al. 2020's and FedTGD's
  prototype and logit poisoning, in their simplest form).

An attacked upload is clipped to ``upload-max-abs``: it must stay well-formed and pass the
server's checks, which is what makes it a Byzantine attack rather than a refused upload.
Random draws come from generators keyed by (seed, purpose, partition, round), so one seed
gives one attack.
"""

from __future__ import annotations

import re
from typing import Mapping

import numpy as np

from fedapp.config import ConfigError, RunConfig, UploadLayout
from fedapp.runtime.payload import Payload
from fedapp.seeding import derive_seed


def malicious_partitions(cfg: RunConfig) -> frozenset[int]:
    """The partitions that attack in this run (none with ``attack = "none"``): those
    ``malicious-clients`` names, else ``num_malicious`` drawn once from (seed, "malicious"),
    the same on the server and on every client."""
    if cfg.attack == "none":
        return frozenset()
    if cfg.malicious_clients:
        return frozenset(cfg.malicious_ids)
    rng = np.random.default_rng(derive_seed(cfg.seed, "malicious"))
    return frozenset(int(p) for p in rng.choice(cfg.num_clients, cfg.num_malicious,
                                                replace=False))


def flip_labels(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Label flipping: y -> C - 1 - y (Fang et al. 2020; Tolpegin et al. 2020 flip one
    source class, this flips every class at once)."""
    return num_classes - 1 - labels


def attack_upload(upload: Mapping[str, np.ndarray], received: Mapping[str, np.ndarray],
                  cfg: RunConfig, partition_id: int, server_round: int,
                  num_classes: int) -> Payload:
    """``upload`` as a malicious client of ``cfg.attack`` sends it (see the module's text);
    ``received`` is what the client was sent this round. Returns a new dict; the upload's
    names, shapes and dtypes are kept."""
    attack = cfg.attack
    if attack in ("none", "label-flip"):
        return dict(upload)
    layout = cfg.upload_layout or UploadLayout()
    if attack == "targeted":
        out = targeted(upload, layout, cfg.attack_target, num_classes)
    else:
        out = {}
        for name, x in upload.items():
            if x.dtype.kind != "f":
                out[name] = x
                continue
            r = received.get(name)
            r = r.astype(np.float64) if r is not None and r.shape == x.shape else 0.0
            x64 = x.astype(np.float64)
            simplex = name in layout.simplex
            if simplex:  # the attack acts on the logits of a probability vector
                x64, r = log_probabilities(x64), log_probabilities(r) if np.ndim(r) else 0.0
            if attack == "sign-flip":
                y = r - (x64 - r)
            elif attack == "scale":
                y = r + cfg.attack_scale * (x64 - r)
            elif attack == "noise":
                rng = np.random.default_rng(derive_seed(cfg.seed, "attack-noise", partition_id,
                                                        server_round, name))
                y = x64 + cfg.attack_noise_std * rng.standard_normal(x.shape)
            elif attack == "collude":
                y = r + cfg.attack_noise_std * collusion_noise(
                    cfg.seed, server_round, name, x.shape, row_classes(name, upload, layout))
            else:
                raise ConfigError(f"setting attack = {attack!r} is not an attack")
            out[name] = (softmax(y) if simplex else y).astype(x.dtype)
    # Within the server's bound, so that validation lets it through.
    bound = cfg.upload_max_abs
    return {name: np.clip(x, -bound, bound).astype(x.dtype) if x.dtype.kind == "f" else x
            for name, x in out.items()}


# The smallest probability whose logarithm an attack uses: an honest zero (a class a mix leaves
# out) becomes a logit of about -28, far below every other, and stays near zero after a scale.
TINY = 1e-12


def log_probabilities(p: np.ndarray) -> np.ndarray:
    return np.log(np.clip(p, TINY, None))


def softmax(z: np.ndarray) -> np.ndarray:
    """Along the last axis, in float64: rows that sum to 1 within float32's rounding."""
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def row_classes(name: str, upload: Mapping[str, np.ndarray],
                layout: UploadLayout) -> np.ndarray | int | None:
    """The class of each row of array ``name`` (an array of labels), of the whole array (an
    int: the class is in its name), or None where the array is not per class."""
    if name in layout.rows and layout.labels in upload:
        return np.asarray(upload[layout.labels]).astype(np.int64)
    if layout.class_in_name:
        match = re.match(layout.class_in_name, name)
        if match is not None:
            return int(match.group(1))
    return None


def collusion_noise(seed: int, server_round: int, name: str, shape: tuple[int, ...],
                    classes: np.ndarray | int | None) -> np.ndarray:
    """N(0, 1) of ``shape``, the same for every colluder: keyed by (seed, round, array name)
    and, for a per-class row, by its class instead of its position, so that colluders holding
    different classes still agree on every class they share."""
    if classes is None:
        return np.random.default_rng(derive_seed(seed, "attack-collude", server_round, name)
                                     ).standard_normal(shape)
    if isinstance(classes, int):  # one array per class: key by the class, not by the name
        return np.random.default_rng(derive_seed(seed, "attack-collude", server_round,
                                                 f"class-{classes}")).standard_normal(shape)
    rows = [np.random.default_rng(derive_seed(seed, "attack-collude", server_round, name,
                                              int(c))).standard_normal(shape[1:])
            for c in classes]
    return np.stack(rows) if rows else np.zeros(shape)


def targeted(upload: Mapping[str, np.ndarray], layout: UploadLayout, target: int,
             num_classes: int) -> Payload:
    """Every class's row made to point at class ``target``: feature rows replaced by the
    client's own row of the target class (left as they are when it has none), logit rows with
    their class's column swapped with the target's."""
    if not layout.per_class:
        raise ConfigError("attack = 'targeted' needs a method whose upload holds per-class "
                          "rows (its card's upload_layout)")
    if not 0 <= target < num_classes:
        raise ConfigError(f"setting attack-target = {target} is invalid: expected a class in "
                          f"[0, {num_classes})")
    out = dict(upload)
    if layout.class_in_name:
        classes = {name: row_classes(name, upload, layout) for name in upload}
        source = next((n for n, c in classes.items() if c == target), None)
        if source is not None:
            for name, c in classes.items():
                if c is not None and c != target:
                    out[name] = upload[source].copy()
        return out
    labels = np.asarray(upload[layout.labels]).astype(np.int64)
    at = np.flatnonzero(labels == target)
    for name in layout.rows:
        rows = upload[name].copy()
        for i, c in enumerate(labels):
            if c == target:
                continue
            if name in layout.logits:
                rows[i, [c, target]] = rows[i, [target, c]]
            elif len(at):
                rows[i] = upload[name][at[0]]
        out[name] = rows
    return out
