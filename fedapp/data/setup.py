"""What a run config means for one experiment: its data, partition and client models.

Server and clients derive everything from the run config and the partition id alone, so a
client needs nothing from the server to know its shard and its architecture, and the server
can check the whole federation (data present, architectures compatible) before any training.
"""

from __future__ import annotations

import functools

import torch

from client_models import HeteroModel, assign_architectures, build_model
from fedapp.config import RunConfig
from fedapp.data.datasets import TensorData, load_dataset
from fedapp.data.files import FILE_DATASETS, load_file_dataset
from fedapp.data.partitions import Partition, PartitionError, PartitionSpec, get_partition
from fedapp.data.public import (PublicSet, PublicSetError, check_public, digits_public,
                                holdout_public, npz_public, private_part)
from fedapp.seeding import derive_seed, isolated_rng


def dataset(cfg: RunConfig) -> TensorData:
    """The run's private dataset, loaded once per process (both loaders cache): with
    ``public-source = "train-holdout"`` the training split without the public rows, so that
    every partition is cut from what remains (``fedapp.data.public``)."""
    data = loaded_dataset(cfg)
    if cfg.public_source == "train-holdout":
        return private_part(data, cfg.public_fraction, cfg.seed)
    return data


def loaded_dataset(cfg: RunConfig) -> TensorData:
    """The dataset as loaded, before any public set is cut from it."""
    if cfg.dataset in FILE_DATASETS:  # a user's own files (fedapp.data.files)
        return load_file_dataset(cfg.dataset, cfg.data_dir, cfg.image_size)
    return load_dataset(cfg.dataset, cfg.data_dir, cfg.download, seed=cfg.seed,
                        synthetic_shape=cfg.shape, synthetic_classes=cfg.synthetic_classes,
                        synthetic_train=cfg.synthetic_train, synthetic_test=cfg.synthetic_test)


@functools.lru_cache(maxsize=4)
def public_on(cfg: RunConfig, device: str, labels: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the public images, their labels or None) on a client's device, loaded once per
    process for all its clients: the public-data methods' clients (FedMD, DS-FL, KT-pFL)."""
    public = public_set(cfg, labels=labels)
    return public.x.to(device), None if public.y is None else public.y.to(device)


def public_set(cfg: RunConfig, labels: bool = True) -> PublicSet:
    """The run's public set (``public-source``), the same in every process that loads it;
    ``labels = False`` leaves its labels out (a method that may not read them, see
    ``strategies.public_labels``)."""
    if cfg.public_source == "none":
        raise PublicSetError("this run has no public set: set public-source (docs/data.md, "
                             "\"A public set\")")
    if cfg.public_source == "train-holdout":
        public = holdout_public(loaded_dataset(cfg), cfg.public_fraction, cfg.seed)
    elif cfg.public_source == "digits":
        public = digits_public()
    else:
        public = npz_public(cfg.public_file)
    return public if labels else _unlabelled(public)


@functools.lru_cache(maxsize=4)
def _unlabelled(public: PublicSet) -> PublicSet:
    return public.without_labels()  # one object per public set, as the labelled one


@functools.lru_cache(maxsize=2)
def global_test(cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The global test subset (on the CPU): ``global-test-samples`` of the dataset's test
    split (0 = all) in an order drawn from ``(seed, "global-test")``, the same in every
    process, so that the clients' ``eval-global-test`` and the server's own models are
    scored on the same images. Loaded once per process."""
    data = dataset(cfg)
    n = len(data.test_y)
    take = n if cfg.global_test_samples == 0 else min(n, cfg.global_test_samples)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(
        derive_seed(cfg.seed, "global-test")))[:take]
    return data.test_x[order], data.test_y[order]


def partition_spec(cfg: RunConfig) -> PartitionSpec:
    """The partition settings of the run config as a :class:`PartitionSpec`."""
    return PartitionSpec(
        scheme=cfg.partition, num_clients=cfg.num_clients, seed=cfg.seed,
        alpha=cfg.dirichlet_alpha, min_partition_size=cfg.min_partition_size,
        classes_per_client=cfg.classes_per_client, samples_per_client=cfg.samples_per_client,
        two_class_with_replacement=cfg.two_class_with_replacement,
        max_samples_per_client=cfg.max_samples_per_client, local_test=cfg.local_test,
        test_fraction=cfg.test_fraction, val_fraction=cfg.val_fraction,
        label_permutation=cfg.label_permutation)


def partition(cfg: RunConfig) -> Partition:
    """The run's partition of its dataset (cached per process by ``get_partition``)."""
    return get_partition(dataset(cfg), partition_spec(cfg))


def architectures(cfg: RunConfig) -> list[str]:
    """The architecture of every client, indexed by partition id."""
    return assign_architectures(cfg.architectures, cfg.num_clients, cfg.arch_assignment, cfg.seed)


def model_init_seed(cfg: RunConfig, arch: str, *seed_parts: int | str) -> int:
    """The key of a model's initial weights: ``(seed, arch, *seed_parts)``; with ``model-init =
    "shared"`` without the architecture, so that every model draws its layers from one stream
    in the order it builds them, as HtFLlib's models do after its constructors re-seed torch:
    two architectures that begin with the same layer shapes begin with the same weights."""
    own_arch = () if cfg.model_init == "shared" else (arch,)
    return derive_seed(cfg.seed, "model-init", *own_arch, *seed_parts)


def own_key(cfg: RunConfig, partition_id: int) -> tuple[int, ...]:
    """The part of a client's initial-weights key that is its own: its partition id under
    ``model-init = "per-client"``, nothing under ``"per-architecture"`` and ``"shared"`` (its
    weights are then those of every client of its architecture)."""
    return (partition_id,) if cfg.model_init == "per-client" else ()


def new_model(cfg: RunConfig, arch: str, input_shape: tuple[int, int, int], num_classes: int,
              *seed_parts: int | str) -> HeteroModel:
    """A freshly initialised model; its weights depend only on ``(seed, arch, *seed_parts)``
    (:func:`model_init_seed`)."""
    with isolated_rng(model_init_seed(cfg, arch, *seed_parts)):
        return build_model(arch, input_shape, num_classes,
                           feature_dim=cfg.feature_dim or None, width=cfg.model_width)


def prepare(cfg: RunConfig) -> tuple[TensorData, Partition]:
    """Load the data, partition it and build every architecture once, and the models a method
    builds of its own (:func:`check_own_models`), so that a missing dataset, an impossible
    partition or an input too small for a model is refused before any training (by ``fedapp
    run`` before it starts Flower, and by the ServerApp)."""
    from client_models import ModelConfigError

    from fedapp.config import ConfigError
    try:
        data = dataset(cfg)
    except PublicSetError as exc:
        raise ConfigError(str(exc)) from None
    try:
        split = partition(cfg)
    except PartitionError as exc:
        raise ConfigError(f"the partition settings do not fit {cfg.dataset}: {exc}") from None
    if cfg.public_source != "none":
        # A method's card says how many public samples it draws per round and whether it
        # reads their labels (strategies.load_config puts both in cfg.settings' reach).
        needed = getattr(cfg.settings, "public_per_round", lambda cfg: 1)(cfg)
        reads_labels = getattr(cfg.settings, "reads_public_labels", lambda cfg: False)(cfg)
        try:
            check_public(public_set(cfg, labels=reads_labels), data.input_shape,
                         data.num_classes, needed)
        except PublicSetError as exc:
            raise ConfigError(str(exc)) from None
    for arch in sorted(set(cfg.architectures)):
        try:
            new_model(cfg, arch, data.input_shape, data.num_classes, "check")
        except ModelConfigError as exc:
            raise ConfigError(f"architecture {arch!r} cannot run on {cfg.dataset} "
                              f"{data.input_shape}: {exc}") from None
    check_own_models(cfg, data.input_shape, data.num_classes)
    return data, split


def check_own_models(cfg: RunConfig, input_shape: tuple[int, int, int],
                     num_classes: int) -> None:
    """Build the models a method makes besides arch-mix's (the global model its clients slice,
    a server model): its settings' ``build_own_models(cfg, input_shape, num_classes)``, which
    raises ``ModelConfigError`` for an input they cannot take. Raises ConfigError."""
    from client_models import ModelConfigError

    from fedapp.config import ConfigError
    build = getattr(cfg.settings, "build_own_models", None)
    if build is None:
        return
    try:
        with isolated_rng(model_init_seed(cfg, cfg.method, "check")):
            build(cfg, tuple(input_shape), num_classes)
    except ModelConfigError as exc:
        raise ConfigError(f"method {cfg.method!r} cannot run on {cfg.dataset} "
                          f"{tuple(input_shape)}: {exc}") from None
