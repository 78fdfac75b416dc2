"""The methods: one folder each under ``strategies/``, found by the registry.

A method's folder holds two modules (docs/architecture.md):

- ``__init__.py``, its *card*, imports no torch: the method's own settings (a frozen dataclass,
  ``<method>.*``), its recipe (how its authors train a client) and ``METHOD``, a
  :class:`Method` naming its two halves and the constraints it puts on the federation;
- ``maths.py``, the method itself: its ``FedClient`` and ``FedStrategy``, read top to bottom.

The folder's name is the method's name (``lg_fedavg/`` is ``method = "lg-fedavg"``): adding a
method is its folder, the defaults of its settings under ``[tool.flwr.app.config.<method>]``
in ``pyproject.toml``, its tests and its page; no list here names it. A method of a user's own
package runs by import path (``method = "mypkg.mymethod"``), and ``method-packages`` adds a
package's method folders to ``fedapp methods``.

Listing the methods and checking settings (``fedapp methods``, ``fedapp settings``, a refused
setting) read the cards only, so the command line answers in about a second without torch;
a method's maths is imported when its strategy or client is built (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from fedapp.config import (METHOD_SETTINGS_KEY, PAYLOAD_KINDS, SHARED_KEYS,
                           ConfigError, RunConfig, UploadLayout, explicit_layers,
                           parse_run_config, parse_settings, resolve_layers, settings_keys,
                           sampled_per_round, toml_value, training_settings)

if TYPE_CHECKING:
    from fedapp.runtime.client_base import FedClient
    from fedapp.runtime.strategy_base import FedStrategy


@dataclass(frozen=True)
class Method:
    """A method's card: its two halves and the constraints it puts on the federation."""

    summary: str
    strategy_class: str             # names of its FedStrategy and FedClient subclasses in the
    client_class: str               # folder's maths.py
    homogeneous_only: bool = False  # every client must run the same architecture
    shared_dim: bool = False        # d-sized vectors (head, representations, prototypes) are
                                    # exchanged, so every extractor must output the same d
    server_d: str = ""              # why the server builds d-sized things of its own (e.g.
                                    # "the global header is Linear(d, C)"): d must be set,
                                    # feature-dim > 0, even with one architecture
    settings: type | None = None    # frozen dataclass of the method's own ``<method>.*`` keys
    asynchronous: bool = False      # its server folds in one upload at a time, so it can run
                                    # without a round barrier (server-loop = "async")
    decentralised: bool = False     # its models can travel client to client with the server
                                    # only relaying (server-loop = "walk" or "gossip")
    # How the method's authors train a client: shared training settings (RECIPE_KEYS) that
    # replace the global defaults when the run leaves them unset (docs/recipes.md says where
    # each value comes from). Empty: the global defaults are the method's recipe.
    recipe: Mapping[str, Any] = field(default_factory=dict)
    # A public set every party holds (``public-source``): whether the method cannot run
    # without one, and whether its paper reads the public labels (what ``public-labels =
    # "method"`` gives it). A settings class may add ``public_per_round(cfg)``, the samples
    # it draws from the set per round, which the data set-up checks the set against.
    needs_public: bool = False
    public_labels: bool = False
    # What its server combines across clients, by kind (fedapp.config.PAYLOAD_KINDS: "model",
    # "group-model", "class-rows", "server-training", "teachers", "group-teachers",
    # "teacher-predictions", "server-distillation", "sub-model"): which robust-aggregation
    # rules apply.
    payload_kinds: tuple[str, ...] = ()
    # Where its upload holds per-class rows (and which arrays a constraint ties): what the
    # attacks, the same for every method, need to know of its upload.
    upload_layout: UploadLayout = UploadLayout()
    # With secure-aggregation (Flower's SecAgg+: the server sees only the sum of the uploads,
    # docs/privacy.md): "as-is" = its server only averages uploads of one layout; "fixed-layout"
    # = its server's maths are exact from the sums of a fixed-layout variant of the upload (its
    # client's secure_upload, its strategy's secure_layout and aggregate_sums); any other text
    # = why its server cannot work from sums (it is refused, with that reason). Settings of its
    # own that make its server need individual uploads: its settings class's
    # ``secure_aggregation_conflict(cfg)`` says why (None where the sums suffice).
    secure_aggregation: str = ""
    package: str = ""               # the card's package (set by the registry)

    # The two halves: the method's maths (torch) is imported on first use.
    @property
    def strategy(self) -> type[FedStrategy]:
        return getattr(importlib.import_module(f"{self.package}.maths"), self.strategy_class)

    @property
    def client(self) -> type[FedClient]:
        return getattr(importlib.import_module(f"{self.package}.maths"), self.client_class)


def _card(package: str) -> Method:
    """The ``METHOD`` card of the method folder ``package`` (imported, torch-free)."""
    module = importlib.import_module(package)
    card = getattr(module, "METHOD", None)
    if not isinstance(card, Method):
        raise ConfigError(f"{package!r} is not a method folder: its __init__.py defines no "
                          "METHOD = strategies.Method(...) (docs/architecture.md)")
    return dataclasses.replace(card, package=package)


def _folders(package: str, path: Iterable[str]) -> dict[str, Method]:
    """Every method folder directly inside ``package``, by folder name."""
    return {info.name: _card(f"{package}.{info.name}")
            for info in sorted(pkgutil.iter_modules(list(path)), key=lambda i: i.name)
            if info.ispkg}


def public_labels(cfg: RunConfig) -> bool:
    """Whether the run's method may read the public set's labels: ``public-labels``, where
    ``"method"`` is what the method's paper does (its card's ``public_labels``)."""
    if cfg.public_labels != "method":
        return cfg.public_labels == "labelled"
    return get_method(cfg.method).public_labels


# The built-in methods, by name (the folder's, ``-`` for ``_``).
METHODS: dict[str, Method] = {name.replace("_", "-"): card
                              for name, card in _folders(__name__, __path__).items()}


def is_method_path(name: str) -> bool:
    """``mypkg.mymethod``: a method folder of a user's package rather than a built-in name."""
    parts = name.split(".")
    return len(parts) > 1 and all(part.isidentifier() for part in parts)


def get_method(name: str) -> Method:
    """The method ``method = name`` runs: a built-in, or a method folder by import path.
    Raises ConfigError naming what is allowed."""
    if name in METHODS:
        return METHODS[name]
    if is_method_path(name):
        try:
            return _card(name)
        except ImportError as exc:
            raise ConfigError(f"setting method = {name!r} is invalid: cannot import {name!r} "
                              f"({exc}); install its package or put its folder on PYTHONPATH "
                              "(an absolute path: Flower starts the apps in other folders)"
                              ) from None
    raise ConfigError(f"setting method = {name!r} is invalid: expected one of "
                      + ", ".join(repr(m) for m in METHODS)
                      + ", or a method folder of your own by import path, e.g. "
                      "'mypkg.mymethod' (docs/usage.md).")


def package_names(flat: Mapping[str, Any]) -> list[str]:
    """The packages ``method-packages`` names."""
    text = str(flat.get("method-packages", SHARED_KEYS["method-packages"].default))
    return [p.strip() for p in text.split(",") if p.strip()]


def known_methods(flat: Mapping[str, Any] = {}) -> dict[str, Method]:
    """Every method a run config can see: the built-ins, the method folders of the packages
    ``method-packages`` names (``package.folder``) and the one ``method`` names by import
    path."""
    known = dict(METHODS)
    for package in package_names(flat):
        try:
            path = importlib.import_module(package).__path__
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"setting method-packages = {flat.get('method-packages')!r} is "
                              f"invalid: {package!r} is not an importable package ({exc})"
                              ) from None
        known.update((f"{package}.{name}", card) for name, card in _folders(package, path).items())
    method = str(flat.get("method", SHARED_KEYS["method"].default))
    if method not in known and is_method_path(method):
        known[method] = get_method(method)
    return known


def unpack_method_settings(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The run config with ``method-settings`` (a JSON object of a user's method's own
    settings, which Flower's run config cannot carry as keys: it accepts only the app's own)
    spread into flat keys; settings given as keys win."""
    text = str(flat.get(METHOD_SETTINGS_KEY, "") or "")
    if not text:
        return dict(flat)
    try:
        packed = json.loads(text)
        if not isinstance(packed, dict):
            raise ValueError
    except ValueError:
        raise ConfigError(f"setting {METHOD_SETTINGS_KEY} = {text!r} is invalid: expected a "
                          'JSON object of settings, e.g. {"mypkg.mymethod.alpha": 0.5}') from None
    return {**packed, **flat, METHOD_SETTINGS_KEY: ""}


def method_keys(flat: Mapping[str, Any] = {}) -> dict[str, dataclasses.Field]:
    """Every method's own settings: ``<method>.<key>`` -> its field (help, default, rule), for
    every method ``flat`` can see (``known_methods``)."""
    keys = {}
    for name, method in known_methods(flat).items():
        if method.settings is not None:
            keys.update(settings_keys(method.settings, name))
    return keys


def effective_settings(flat: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(the run config with the chosen method's recipe in its layer, the layer of every shared
    key): global defaults < recipe < preset < --set (``fedapp.config.resolve_layers``). Refuses
    an unknown method or a bad value before any recipe is looked up."""
    flat = unpack_method_settings(flat)
    keys = method_keys(flat)
    parsed = parse_run_config(flat, method_keys=keys)  # bad keys and values first
    unknown = [k for k in explicit_layers(parsed.explicit_settings)
               if k not in SHARED_KEYS and k not in keys]
    if unknown:
        raise ConfigError(f"setting explicit-settings = {parsed.explicit_settings!r} is "
                          f"invalid: {', '.join(unknown)} is not a setting.")
    return resolve_layers(flat, parsed.method, get_method(parsed.method).recipe)


def settings_report(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"settings": {key: effective value}, "layers": {key: layer}}`` for every shared key and
    the chosen method's own keys: what ``fedapp settings`` prints and ``config.json`` holds."""
    effective, layers = effective_settings(flat)
    method = effective.get("method", SHARED_KEYS["method"].default)
    explicit = explicit_layers(str(effective.get("explicit-settings", "")))
    values = {key: effective.get(key, f.default) for key, f in SHARED_KEYS.items()}
    own = get_method(method).settings
    if own is not None:
        parse_settings(own, effective, method)  # a bad value of its own is refused here too
        for key, f in settings_keys(own, method).items():
            values[key] = effective.get(key, f.default)
            layers[key] = explicit.get(key) or ("config" if values[key] != f.default
                                                else "default")
    return {"settings": values, "layers": layers}


def recipe_line(report: Mapping[str, Mapping[str, Any]]) -> str:
    """The training recipe in force, in one line: every recipe key's effective value, and which
    of them the run set itself (the first line a run prints)."""
    values, layers = report["settings"], report["layers"]
    method = values["method"]
    used = "recipe" if values["recipe"] == "method" and get_method(method).recipe else "defaults"
    # Only what acts: no momentum for Adam, no betas for SGD, no decay factor without decay.
    keys = list(training_settings(values))
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
    known = known_methods(flat)
    cfg = parse_run_config(flat, method_keys=method_keys(flat))
    sections = {name: parse_settings(m.settings, flat, name)
                for name, m in known.items() if m.settings is not None}
    method = known[cfg.method]
    cfg = dataclasses.replace(cfg, settings=sections.get(cfg.method),
                              upload_layout=method.upload_layout,
                              payload_kinds=tuple(method.payload_kinds))
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
    if method.server_d and cfg.feature_dim == 0:
        hint = method.recipe.get("feature-dim", SHARED_KEYS["feature-dim"].default)
        raise ConfigError(
            f"method {cfg.method!r} needs one representation dimension d for every client "
            f"({method.server_d}): set feature-dim > 0 (e.g. {hint}).")
    if cfg.server_loop == "async" and not method.asynchronous:
        raise ConfigError(
            f"setting server-loop = 'async' is invalid for method {cfg.method!r}: its server "
            "aggregates a whole round of uploads at once. Methods that take one upload at a "
            "time: " + ", ".join(n for n, m in known.items() if m.asynchronous) + ".")
    if cfg.server_loop in ("walk", "gossip") and not method.decentralised:
        raise ConfigError(
            f"setting server-loop = {cfg.server_loop!r} is invalid for method {cfg.method!r}: "
            "device-to-device loops pass models from client to client, which only methods "
            "whose models are per-architecture experts can do: "
            + ", ".join(n for n, m in known.items() if m.decentralised) + ".")
    if method.needs_public and cfg.public_source == "none":
        raise ConfigError(
            f"method {cfg.method!r} needs a public set that every party holds, but "
            "public-source = 'none': set public-source = 'train-holdout' (a share of the "
            "training split, cut before partitioning), 'digits' or 'npz' (docs/data.md, "
            "\"A public set\").")
    check_attack_and_rule(cfg, method, archs)
    if cfg.differential_privacy:  # the accountant's import is kept off the common path
        from fedapp.runtime.privacy import check_settings
        check_settings(cfg, cfg.method, method.payload_kinds)
    check_secure_aggregation(cfg, method)
    check = getattr(cfg.settings, "check", None)
    if check is not None:
        check(cfg)  # the method's cross-setting rules; raises ConfigError
    return cfg


# The values of Method.secure_aggregation of the methods that take it.
SECURE_FORMS = ("as-is", "fixed-layout")


def check_secure_aggregation(cfg: RunConfig, method: Method) -> None:
    """One rule for every method, from its card: ``secure-aggregation`` needs a server that
    works from sums of the uploads (``Method.secure_aggregation``), a synchronous round of at
    least two clients to sum, and no rule that must see individual uploads. Raises
    ConfigError naming the method and the reason."""
    if not cfg.secure_aggregation:
        return
    if cfg.server_loop != "rounds":
        raise ConfigError(
            f"setting secure-aggregation = true is invalid with server-loop = "
            f"{cfg.server_loop!r} (method {cfg.method!r}): SecAgg+ sums the uploads of a "
            "synchronous round, and this loop "
            + ("folds in one upload at a time, so there is no cohort to sum."
               if cfg.server_loop == "async" else
               "relays models from device to device, so the server sums nothing.")
            + " Use server-loop = 'rounds'.")
    if method.secure_aggregation not in SECURE_FORMS:
        why = method.secure_aggregation or (
            "its card does not declare that its server works from sums of the uploads "
            "(Method.secure_aggregation)")
        raise ConfigError(
            f"setting secure-aggregation = true is invalid for method {cfg.method!r}: {why}. "
            "Methods that take it: " + ", ".join(
                n for n, m in known_methods().items() if m.secure_aggregation in SECURE_FORMS)
            + " (docs/privacy.md).")
    # A method's own settings may make its server need individual uploads (a history of
    # them, say): its settings class says why (``secure_aggregation_conflict``).
    conflict = getattr(cfg.settings, "secure_aggregation_conflict", None)
    why = conflict(cfg) if conflict is not None else None
    if why:
        raise ConfigError(
            f"setting secure-aggregation = true is invalid for method {cfg.method!r} with "
            f"{why} (docs/privacy.md).")
    if cfg.differential_privacy:
        raise ConfigError(
            "setting differential-privacy = true is invalid with secure-aggregation = true "
            f"(method {cfg.method!r}): the noise is calibrated to each client's upload "
            "clipped on the server, which secure aggregation hides from it; noise added by "
            "the clients inside the masked sum is not built (docs/privacy.md).")
    if cfg.robust_aggregation != "none":
        raise ConfigError(
            f"setting robust-aggregation = {cfg.robust_aggregation!r} is invalid with "
            "secure-aggregation = true: a robust rule combines the individual uploads, which "
            "secure aggregation hides from the server.")
    from fedapp.runtime.secure_aggregation import MAX_CLIENTS
    sampled = sampled_per_round(cfg)
    if sampled < 2:
        raise ConfigError(
            f"setting secure-aggregation = true is invalid with {sampled} client per round "
            "(num-clients, fraction-fit, min-fit-clients): the sum of one upload is that "
            "upload, and SecAgg+ cancels such a round.")
    if cfg.num_clients > MAX_CLIENTS:
        raise ConfigError(
            f"setting secure-aggregation = true is invalid with num-clients = "
            f"{cfg.num_clients}: one sum holds at most {MAX_CLIENTS} clients without wrapping "
            "modulo SecAgg+'s modulus.")


def check_attack_and_rule(cfg: RunConfig, method: Method, archs: list[str]) -> None:
    """One rule for every method, from its card: the robust rule must apply to every kind of
    payload its server combines (``payload_kinds``), and a targeted attack needs per-class
    rows (``upload_layout``). Raises ConfigError naming the method and the reason."""
    if cfg.attack == "targeted" and not method.upload_layout.per_class:
        raise ConfigError(
            f"setting attack = 'targeted' is invalid for method {cfg.method!r}: it poisons "
            "per-class rows (prototypes, logits), and this method's upload has none. Methods "
            "whose uploads do: " + ", ".join(n for n, m in known_methods().items()
                                              if m.upload_layout.per_class) + ".")
    rule = cfg.robust_aggregation
    if rule == "none":
        return
    if cfg.server_loop in ("walk", "gossip"):
        raise ConfigError(f"setting robust-aggregation = {rule!r} is invalid with server-loop "
                          f"= {cfg.server_loop!r}: the server only relays models from device "
                          "to device and combines nothing.")
    if not method.payload_kinds:
        raise ConfigError(f"setting robust-aggregation = {rule!r} is invalid for method "
                          f"{cfg.method!r}: its server combines no uploads.")
    for kind in method.payload_kinds:
        rules, why = PAYLOAD_KINDS[kind]
        if rule not in rules:
            raise ConfigError(
                f"setting robust-aggregation = {rule!r} is invalid for method {cfg.method!r}: "
                f"its server combines {kind} payloads, and {why or 'the rule does not apply'}"
                + (f" (rules that do: {', '.join(rules)})." if rules else "."))
    if "server-training" in method.payload_kinds and cfg.server_loop == "async":
        raise ConfigError(
            f"setting robust-aggregation = {rule!r} is invalid for method {cfg.method!r} with "
            "server-loop = 'async': the rule filters, per label, the pairs of a round's "
            "uploads before the server trains on them, and the asynchronous loop trains on "
            "one upload at a time (no rows to compare it with); use server-loop = 'rounds'.")
    if rule in ("krum", "multi-krum"):
        # Blanchard et al.'s condition n > 2f + 2, on the clients that can meet in one average:
        # all of them, or those of one architecture where each has its own model.
        need = 2 * cfg.robust_krum_f + 2
        groups = ({a: archs.count(a) for a in sorted(set(archs))}
                  if {"group-model", "group-teachers"} & set(method.payload_kinds)
                  else {"all": len(archs)})
        small = {g: n for g, n in groups.items() if n <= need}
        if small:
            raise ConfigError(
                f"setting robust-aggregation = {rule!r} is invalid for method {cfg.method!r} "
                f"with robust-krum-f = {cfg.robust_krum_f}: Krum needs more than {need} "
                "uploads in each average, and "
                + ", ".join(f"{g} has {n} clients" for g, n in small.items())
                + "; use fewer tolerated attackers, more clients, or 'median' / "
                "'trimmed-mean', which need no minimum.")
