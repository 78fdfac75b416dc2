"""The settings every width sub-model method has (HeteroFL, FedRolex, FjORD:
``fedapp/runtime/submodels.py``), and who gets which rate. No torch at the top: the methods'
cards import this (docs/submodels.md).

``<method>.rates`` says which width rate each client trains, in one of four forms:

- a **proportion string**, HeteroFL's ``a1-b1-c1-d1-e1`` (level letter, then its share), or
  with values for names, ``0.2:1-0.4:1-1:2`` (FjORD's tiers);
- **per architecture group**: ``cnn5=a,cnn4=b,cnn3=0.25``: the clients that ``arch-mix``
  gives each architecture (the run's device classes) train that level of the global model;
- **per client**: ``a,b,b,e`` (one value per client, by partition id);
- **one value** for everyone: ``b`` or ``0.5``.

A value is a level name or a number in (0, 1]. The level names are HeteroFL's (``LEVELS``:
a = 1, b = 1/2, c = 1/4, d = 1/8, e = 1/16, shrinkage 0.5). With ``<method>.rate-mode =
"dynamic"`` (a proportion string only) every client's level is drawn anew each round from the
proportions, keyed by (seed, "rates", round).

The grammar is :func:`parse_levels`, written for any per-client level table: a depth setting
(DepthFL's depths 1-4) takes the same four forms with its own table and value check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, ClassVar, Generic, Mapping, TypeVar

from fedapp.config import ConfigError, RunConfig, opt

# HeteroFL's model levels (utils.process_control: model_rate = 0.5 ** index of the letter).
LEVELS: dict[str, Fraction] = {name: Fraction(1, 2 ** i) for i, name in enumerate("abcde")}

V = TypeVar("V")
_PROPORTIONS = re.compile(r"^([a-z]+)(\d+)(-([a-z]+)(\d+))*$")
# The same with values for names: "0.2:1-0.4:1" (FjORD's tiers and their shares).
_VALUE_PROPORTIONS = re.compile(r"^[0-9./]+:\d+(-[0-9./]+:\d+)*$")


@dataclass(frozen=True)
class LevelPlan(Generic[V]):
    """Who gets which value: ``per_client`` (fixed), or ``levels`` with ``proportions``
    drawn anew each round (dynamic)."""

    per_client: tuple[V, ...] = ()
    levels: tuple[V, ...] = ()
    proportions: tuple[float, ...] = ()

    @property
    def dynamic(self) -> bool:
        return not self.per_client

    def values(self) -> tuple[V, ...]:
        """Every value a client can get."""
        return tuple(sorted(set(self.per_client or self.levels)))  # type: ignore[type-var]


def parse_levels(text: str, key: str, names: Mapping[str, V], value: Callable[[str], V],
                 architectures: list[str], mode: str = "fix") -> LevelPlan[V]:
    """``text`` (one of the four forms above) as a plan for ``len(architectures)`` clients.

    ``names``: the level names; ``value``: a non-name item as a value (raising ValueError with
    what is wrong); ``architectures``: every client's, by partition id (for the group form).
    ``mode`` "fix" assigns a proportion string's levels to consecutive partition ids as
    HeteroFL's code does; "dynamic" leaves the draw to each round (:func:`round_values`)."""
    num_clients = len(architectures)
    text = str(text).strip()

    def item(token: str) -> V:
        token = token.strip()
        if token in names:
            return names[token]
        try:
            return value(token)
        except ValueError as exc:
            raise ConfigError(f"setting {key} = {text!r} is invalid: {token!r} is neither a "
                              f"level ({', '.join(names)}) nor allowed: {exc}") from None

    if _PROPORTIONS.match(text) or _VALUE_PROPORTIONS.match(text):
        pairs = [re.match(r"([a-z]+)(\d+)$|(.+):(\d+)$", part).groups()
                 for part in text.split("-")]
        pairs = [(name, share) if name else (value_text, shares)
                 for name, share, value_text, shares in pairs]
        unknown = [name for name, _ in pairs if name.isalpha() and name not in names]
        if unknown:
            raise ConfigError(f"setting {key} = {text!r} is invalid: unknown level(s) "
                              f"{unknown}; the levels are {', '.join(names)}")
        levels = [item(name) for name, _ in pairs]
        shares = [int(share) for _, share in pairs]
        if sum(shares) <= 0:
            raise ConfigError(f"setting {key} = {text!r} is invalid: the shares add up to 0")
        if mode == "dynamic":
            return LevelPlan(levels=tuple(levels),
                             proportions=tuple(s / sum(shares) for s in shares))
        return LevelPlan(per_client=tuple(fixed_split(levels, shares, num_clients)))
    if mode == "dynamic":
        raise ConfigError(f"setting {key.rsplit('.', 1)[0]}.rate-mode = 'dynamic' draws each "
                          f"round's levels from a proportion string such as 'a1-b1-c1', but "
                          f"{key} = {text!r} is not one; use rate-mode = 'fix'")
    if "=" in text:
        groups: dict[str, V] = {}
        for part in text.split(","):
            arch, sep, level = part.partition("=")
            if not sep or not arch.strip():
                raise ConfigError(f"setting {key} = {text!r} is invalid: expected "
                                  "'architecture=level' pairs separated by commas")
            groups[arch.strip()] = item(level)
        missing = sorted(set(architectures) - set(groups))
        unused = sorted(set(groups) - set(architectures))
        if missing or unused:
            raise ConfigError(
                f"setting {key} = {text!r} is invalid: "
                + (f"the run's architectures {missing} have no level" if missing else "")
                + ("; " if missing and unused else "")
                + (f"{unused} are not in arch-mix" if unused else "")
                + f" (arch-mix gives the clients {sorted(set(architectures))})")
        return LevelPlan(per_client=tuple(groups[a] for a in architectures))
    if "," in text:
        items = [item(t) for t in text.split(",")]
        if len(items) != num_clients:
            raise ConfigError(f"setting {key} = {text!r} is invalid: it gives {len(items)} "
                              f"values, one per client, and num-clients = {num_clients}")
        return LevelPlan(per_client=tuple(items))
    return LevelPlan(per_client=(item(text),) * num_clients)


def fixed_split(levels: list[V], shares: list[int], num_clients: int) -> list[V]:
    """HeteroFL's ``fix`` mode: consecutive partition ids get the levels in order, level i
    ⌊K/Σs⌋·s_i clients. The code gives the K mod Σs clients left over the last level (all of
    them when K < Σs: 3 clients of 'a1-b1-c1-d1-e1' would all be 'e'); here they go one each
    to the levels in order, as arch-assignment 'blocks' does. The two agree whenever K is a
    multiple of Σs (100 clients of a1-...-e1: 20 each)."""
    base = num_clients // sum(shares)
    counts = [base * s for s in shares]
    for i in range(num_clients - sum(counts)):
        counts[i % len(counts)] += 1
    return [level for level, count in zip(levels, counts) for _ in range(count)]


def round_values(plan: LevelPlan[V], seed: int, server_round: int,
                 num_clients: int) -> tuple[V, ...]:
    """Every client's value in ``server_round``: the fixed ones, or (dynamic) the round's draw
    of each client's level from the proportions, as HeteroFL's ``make_model_rate`` draws
    ``multinomial(proportion, num_users, replacement=True)`` each round."""
    if not plan.dynamic:
        return plan.per_client
    import numpy as np  # numpy only: the cards stay light

    from fedapp.seeding import derive_seed
    rng = np.random.default_rng(derive_seed(seed, "rates", server_round))
    picks = rng.choice(len(plan.levels), size=num_clients, p=list(plan.proportions))
    return tuple(plan.levels[i] for i in picks)


def width_rate(token: str) -> Fraction:
    """A number in (0, 1] as an exact fraction (ValueError otherwise)."""
    try:
        rate = Fraction(token)
    except (ValueError, ZeroDivisionError):
        raise ValueError("expected a number in (0, 1]") from None
    if not 0 < rate <= 1:
        raise ValueError(f"a width rate must be in (0, 1] (1 = the global model), not {token}")
    return rate


@dataclass(frozen=True)
class SubmodelSettings:
    """``<method>.*`` keys every width sub-model method has."""

    # Which channels a slice keeps along a sliced dimension (fedapp.runtime.submodels.window):
    # the method's, not a setting (FedRolex: "rolling").
    index_scheme: ClassVar[str] = "leading"

    global_arch: str = opt(
        "heterofl-conv", "the global model, one width-sliceable architecture (`fedapp models` "
        "lists them: heterofl-conv, heterofl-resnet10..26); arch-mix only names the clients' "
        "device groups for the group form of rates")
    rates: str = opt(
        "a1-b1-c1-d1-e1", "each client's width rate: a proportion string 'a1-b1-c1-d1-e1' "
        "(HeteroFL's levels a=1, b=1/2, c=1/4, d=1/8, e=1/16 and their shares), per "
        "architecture group 'cnn5=a,cnn4=c', per client 'a,b,e' (one per client) or one "
        "value 'b' / '0.5' (docs/submodels.md)")
    rate_mode: str = opt(
        "fix", "'fix': each client keeps its rate (a proportion string fills consecutive "
        "partition ids); 'dynamic': every round each client's level is drawn anew from the "
        "proportion string (HeteroFL's dynamic mode)", choices=("fix", "dynamic"))

    def plan(self, cfg: RunConfig) -> LevelPlan[Fraction]:
        from fedapp.data.setup import architectures  # builds nothing; assigns names
        return parse_levels(self.rates, f"{cfg.method}.rates", LEVELS, width_rate,
                            architectures(cfg), self.rate_mode)

    def client_rates(self, cfg: RunConfig, server_round: int) -> tuple[Fraction, ...]:
        """Every client's width rate in ``server_round``, by partition id."""
        return round_values(self.plan(cfg), cfg.seed, server_round, cfg.num_clients)

    def model_options(self, rate: Fraction) -> dict:
        """How the method builds a model of ``rate`` (``client_models.width.build_width_model``'s
        norm, scaler, ordered-dropout widths)."""
        return {"norm": "static", "scaler": True}

    def width_model(self, cfg: RunConfig, rate: Fraction, input_shape: tuple[int, int, int],
                    num_classes: int):
        """The run's global architecture at ``rate``, sliced from a global model of
        ``model-width``, with the method's normalisation (HeteroFL: static BN and the Scaler
        as the settings say; FjORD: per-width BN)."""
        from client_models.width import build_width_model  # the models import torch
        return build_width_model(self.global_arch, input_shape, num_classes, rate,
                                 width=cfg.model_width, **self.model_options(rate))

    def build_own_models(self, cfg: RunConfig, input_shape: tuple[int, int, int],
                         num_classes: int) -> None:
        """The global model, which the data set-up builds once so that an input too small for
        it is refused before training (a slice down-samples as the whole model does)."""
        self.width_model(cfg, Fraction(1), input_shape, num_classes)

    def check(self, cfg: RunConfig) -> None:
        from client_models.width import WIDTH_FAMILIES
        if self.global_arch not in WIDTH_FAMILIES:
            raise ConfigError(
                f"setting {cfg.method}.global-arch = {self.global_arch!r} is invalid: that "
                f"model cannot be sliced by width; the sub-model methods need one of "
                f"{', '.join(WIDTH_FAMILIES)}")
        self.plan(cfg)
        # A kept optimizer's state (momentum, Adam's moments) belongs to the coordinates it
        # was built over; a slice that changes between messages would restore it onto other
        # shapes (a new level) or other channels (a window that rolls).
        moving = ("a dynamic rate draws each client's level anew every round"
                  if self.rate_mode == "dynamic" else
                  "the rolling window moves over the channels every round"
                  if self.index_scheme == "rolling" else "")
        if moving and cfg.optimizer_state == "keep":
            raise ConfigError(
                f"setting optimizer-state = 'keep' is invalid for method {cfg.method!r}: "
                f"{moving}, so a client's slice of the global model changes between messages "
                "and a kept optimizer's state would belong to other coordinates; the method's "
                "code builds a new optimizer every round: set optimizer-state = 'fresh'")
