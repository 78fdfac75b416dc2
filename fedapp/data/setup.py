"""What a run config means for one experiment: its data, partition and client models.

Server and clients derive everything from the run config and the partition id alone, so a
client needs nothing from the server to know its shard and its architecture, and the server
can check the whole federation (data present, architectures compatible) before any training.
"""

from __future__ import annotations

from client_models import HeteroModel, assign_architectures, build_model
from fedapp.config import RunConfig
from fedapp.data.datasets import TensorData, load_dataset
from fedapp.data.files import FILE_DATASETS, load_file_dataset
from fedapp.data.partitions import Partition, PartitionError, PartitionSpec, get_partition
from fedapp.seeding import derive_seed, isolated_rng


def dataset(cfg: RunConfig) -> TensorData:
    """The run's dataset, loaded once per process (both loaders cache)."""
    if cfg.dataset in FILE_DATASETS:  # a user's own files (fedapp.data.files)
        return load_file_dataset(cfg.dataset, cfg.data_dir, cfg.image_size)
    return load_dataset(cfg.dataset, cfg.data_dir, cfg.download, seed=cfg.seed,
                        synthetic_shape=cfg.shape, synthetic_classes=cfg.synthetic_classes,
                        synthetic_train=cfg.synthetic_train, synthetic_test=cfg.synthetic_test)


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
    """Load the data, partition it and build every architecture once, so that a missing
    dataset, an impossible partition or an input too small for an architecture is refused
    before any training (by ``fedapp run`` before it starts Flower, and by the ServerApp)."""
    from client_models import ModelConfigError

    from fedapp.config import ConfigError
    data = dataset(cfg)
    try:
        split = partition(cfg)
    except PartitionError as exc:
        raise ConfigError(f"the partition settings do not fit {cfg.dataset}: {exc}") from None
    for arch in sorted(set(cfg.architectures)):
        try:
            new_model(cfg, arch, data.input_shape, data.num_classes, "check")
        except ModelConfigError as exc:
            raise ConfigError(f"architecture {arch!r} cannot run on {cfg.dataset} "
                              f"{data.input_shape}: {exc}") from None
    return data, split
