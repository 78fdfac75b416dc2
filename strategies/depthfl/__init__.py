"""DepthFL's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``; the page: docs/depthfl.md)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import ConfigError, RunConfig, opt
from strategies import Method

ASSIGNMENTS = ("round-robin", "blocks", "random")  # client_models.ASSIGNMENT_MODES (no torch)


@dataclass(frozen=True)
class DepthFLSettings:
    """``depthfl.*``: the global multi-exit model, each client's depth, the clients' loss
    (self-distillation between exits, FedDyn) and the reference code's choices."""

    model: str = opt(
        "resnet18", "the global model, of a family whose first d stages make the depth-d "
        "model, with an exit after each stage (client_models.depth_prefix): resnet18 "
        "(DepthFL's), resnet10/14/22/26, or cnn4 (HeteroFL's 4-block MNIST conv); widths x "
        "model-width")
    depths: str = opt(
        "1,2,3,4", "each client's depth, the number of stages it holds: comma-separated "
        "depths (or the paper's levels a, b, c, d = 1, 2, 3, 4) handed out to clients by "
        "depthfl.assignment, as arch-mix is (one entry per client: exactly that list); or "
        "'arch:depth' pairs, one per architecture of arch-mix, a depth per architecture group "
        "(e.g. 'cnn1:1,cnn2:2')")
    assignment: str = opt(
        "blocks", "how a depth list is handed out: 'blocks' (contiguous groups: the "
        "reference's client i gets depth i // (K/4) + 1), 'round-robin' or 'random' (as "
        "arch-assignment)", choices=ASSIGNMENTS)
    self_distillation: bool = opt(
        True, "add to each exit's CE the mean KL from every other exit's prediction (mutual "
        "self-distillation); false = the paper's DepthFL without KD")
    all_exits: bool = opt(
        True, "train every exit of the prefix (DepthFL); false = only the deepest "
        "(InclusiveFL, the reference's extended = false)")
    kd_ramp_rounds: int = opt(
        300, "rounds over which the distillation weight w_t = exp(-5 (1 - t/R)^2) ramps up "
        "to 1 (the reference's 300; t = round - 1); 0 = weight 1 from the start", low=0)
    kl_target_eps: float = opt(
        1e-7, "added to each distillation target's probabilities, not renormalised (the "
        "reference's KLLoss); 0 = the exact KL", low=0.0)
    feddyn: bool = opt(
        True, "FedDyn's dynamic regularisation (the reference's default): each client adds "
        "-<theta, h_k> + alpha/2 ||theta - theta_global||^2 and keeps h_k; the server keeps h "
        "and sets theta = mean - h/alpha; false = DepthFL(FedAvg)")
    feddyn_alpha: float = opt(0.1, "FedDyn's alpha (the reference's 0.1)", low=0.0,
                              low_open=True)
    lr_round_decay: float = opt(
        0.998, "the client learning rate is lr x this^(round - 1) (the reference's 0.998 per "
        "round; 1 = constant), times lr-decay-at's steps if any", low=0.0, high=1.0,
        low_open=True)
    download: str = opt(
        "prefix", "what a client is sent: 'prefix' (its depth's prefix of the global model, "
        "the paper's traffic) or 'global' (the whole global model, of which the client keeps "
        "its prefix: the reference code's messages)", choices=("prefix", "global"))

    def check(self, cfg: RunConfig) -> None:
        self.client_depths(cfg)  # raises ConfigError

    def build_own_models(self, cfg: RunConfig, input_shape: tuple[int, int, int],
                         num_classes: int) -> None:
        """The global model at its full depth, which the data set-up builds once so that an
        input too small for it is refused before training (a prefix down-samples less)."""
        from client_models.depth_prefix import build_depth_model, max_depth
        build_depth_model(self.model, max_depth(self.model), input_shape, num_classes,
                          width=cfg.model_width)

    def client_depths(self, cfg: RunConfig) -> list[int]:
        """The depth of every client, by partition id (raises ConfigError naming the bad
        value and what is allowed)."""
        from client_models import ModelConfigError  # the models import torch
        from client_models.depth_prefix import check_depth, max_depth
        from client_models.registry import assign
        from fedapp.data.setup import architectures
        try:
            top = max_depth(self.model)
        except ModelConfigError as exc:
            raise ConfigError(f"setting depthfl.model = {self.model!r} is invalid: {exc}"
                              ) from None
        items = [t.strip() for t in self.depths.split(",")]
        try:
            if not all(items):
                raise ModelConfigError("an entry is empty; give comma-separated depths, e.g. "
                                       "'1,2,3,4'")
            if any(":" in t for t in items):
                return self._depths_per_group(items, architectures(cfg), top)
            depths = [check_depth(self.model, _depth(t, top)) for t in items]
            return assign(depths, cfg.num_clients, self.assignment, cfg.seed)
        except ModelConfigError as exc:
            raise ConfigError(f"setting depthfl.depths = {self.depths!r} is invalid for "
                              f"depthfl.model = {self.model!r}: {exc}") from None

    def _depths_per_group(self, items: list[str], archs: list[str], top: int) -> list[int]:
        from client_models import ModelConfigError
        from client_models.depth_prefix import check_depth
        per_arch: dict[str, int] = {}
        for item in items:
            arch, sep, depth = (p.strip() for p in item.partition(":"))
            if not sep or not arch or arch in per_arch:
                raise ModelConfigError(f"{item!r} is not one 'arch:depth' pair per "
                                       "architecture")
            if arch not in archs:
                raise ModelConfigError(f"{arch!r} is not an architecture of arch-mix "
                                       f"({', '.join(sorted(set(archs)))})")
            per_arch[arch] = check_depth(self.model, _depth(depth, top))
        missing = sorted(set(archs) - set(per_arch))
        if missing:
            raise ModelConfigError(f"no depth for the architecture(s) {', '.join(missing)} of "
                                   "arch-mix")
        return [per_arch[a] for a in archs]


def _depth(token: str, top: int) -> object:
    """A depth as written: an integer, or a level letter (a = 1, b = 2, ...); anything else is
    returned as it is, for check_depth to refuse."""
    if token.lstrip("-").isdigit():
        return int(token)
    if len(token) == 1 and token.isalpha() and token.islower():
        return ord(token) - ord("a") + 1
    return token


# The reference (Flower's baselines/depthfl, by the paper's first author: conf/config.yaml,
# models.train): plain SGD lr 0.1 (x 0.998 per round: depthfl.lr-round-decay), no momentum,
# weight decay 1e-3, no clipping, a new optimizer every round, batch 50, 5 local epochs.
RECIPE = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "weight-decay": 1e-3,
          "grad-clip": 0.0, "optimizer-state": "fresh", "batch-size": 50, "local-epochs": 5,
          "local-steps": 0, "drop-last": False}

METHOD = Method("depth-scaled sub-models of one multi-exit global model: a client trains the "
                "first d stages and their exits with mutual self-distillation (and FedDyn); "
                "the server averages each entry over the clients whose prefix holds it",
                strategy_class="DepthFL", client_class="DepthFLClient",
                settings=DepthFLSettings, recipe=RECIPE, payload_kinds=("sub-model",),
                secure_aggregation="fixed-layout")
