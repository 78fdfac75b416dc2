"""FedPer (Arivazhagan et al., 2019): share the extractor ("base layers"), keep the head private.

Every client installs the global extractor of its own architecture, trains the whole model
(extractor and private head together) with cross-entropy and uploads its extractor; the server
averages the extractors within each architecture, weighted by n_k, so any architecture mix
works and heads never leave a client (which also makes per-client label permutations work).
Per client per round the extractor's parameters go each way. Clients are evaluated with their
own model after local training.

:class:`PerArchitectureExtractors` is the server side FedPer, FedRep and CompFL share: one
global extractor per architecture, initialised from the seed and averaged per architecture.

With ``secure-aggregation`` a client uploads a table of every architecture's extractor, its own
trained one times n_k / S in its architecture's slot and zeros elsewhere, with a weight and a
holders column per architecture (``fedapp.runtime.secure_aggregation.group_table``); the
server's per-architecture averages are then ratios of the survivors' sums.
"""

from __future__ import annotations



from fedapp.config import RunConfig
from fedapp.data.local_data import expected_input
from fedapp.runtime import secure_aggregation
from fedapp.runtime.client_base import FedClient, load_arrays, state_arrays
from fedapp.runtime.payload import ArraySpec, Payload
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload


def extractor_arrays(model) -> Payload:
    """The extractor's entries of ``model``'s state (BatchNorm buffers included) as arrays."""
    return state_arrays(model, list(model.extractor_state()))


def arrays_spec(arrays: Payload) -> dict[str, ArraySpec]:
    """The spec of an upload that must have exactly the names, shapes and kinds of ``arrays``."""
    return {name: ArraySpec(a.shape, "float" if a.dtype.kind == "f" else "int")
            for name, a in arrays.items()}


def extractor_layouts(cfg: RunConfig, input_shape: tuple[int, int, int], num_classes: int
                      ) -> dict[str, dict[str, tuple[int, ...]]]:
    """Every architecture's extractor layout (name -> shape), architectures sorted by name:
    the groups of a secure-aggregation table."""
    return secure_aggregation.architecture_layouts(cfg, input_shape, num_classes,
                                                   extractor_arrays)


def secure_group_upload(client: FedClient, group: str, arrays: Payload) -> Payload:
    """A client's secure upload: the extractor ``arrays`` it trained, of architecture
    ``group``, in that group's slot of the table of every architecture, weighted by n_k / S
    (the n_k of the plain average)."""
    groups = extractor_layouts(client.cfg, *expected_input(client.cfg))
    return secure_aggregation.group_table(groups, group, arrays, client.secure_weight())


class PerArchitectureExtractors(FedStrategy):
    """One global extractor per architecture of the run; uploads averaged within architecture."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.extractors: dict[str, Payload] = {
            arch: extractor_arrays(self.new_model(arch)) for arch in sorted(set(self.architectures))}

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        # The same dict object for every client of an architecture: encoded once per round.
        return self.extractors[client.arch] if client is not None else {}

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        return arrays_spec(self.extractors[client.arch])

    def trained_extractor(self, upload: Upload) -> tuple[str, Payload]:
        """Which architecture an upload trained, and its extractor arrays."""
        return upload.client.arch, upload.payload

    def merge(self, arch: str, average: Payload) -> Payload:
        """The new global extractor of ``arch`` from the n_k-weighted average of its uploads."""
        return average

    def starting_point(self, arch: str) -> Payload:
        """What an upload of ``arch`` is measured from (robust-aggregation's norm bound): the
        global extractor the client started from."""
        return self.extractors[arch]

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        archs, extractors = zip(*(self.trained_extractor(u) for u in uploads))
        averages = self.average_per_group(
            list(archs), list(extractors), [u.num_examples for u in uploads],
            references={arch: self.starting_point(arch) for arch in set(archs)})
        # Architectures nobody trained this round keep their extractor.
        for arch, average in averages.items():
            self.extractors[arch] = self.merge(arch, average)

    def secure_layout(self) -> dict[str, tuple[int, ...]]:
        return secure_aggregation.group_table_layout(
            extractor_layouts(self.cfg, self.input_shape, self.num_classes))

    def aggregate_sums(self, server_round: int, sums: Payload, uploads: list[Upload]) -> None:
        # The same n_k-weighted averages within each architecture as aggregate, from the sums
        # of the survivors' tables (in the wire dtypes, as weighted_average returns them); an
        # architecture no survivor trained keeps its extractor.
        means = secure_aggregation.group_means_from_sums(
            sums, extractor_layouts(self.cfg, self.input_shape, self.num_classes))
        for arch, mean in means.items():
            self.extractors[arch] = self.merge(
                arch, secure_aggregation.in_dtypes_of(mean, self.extractors[arch]))


class FedPerClient(FedClient):
    """Installs its architecture's global extractor, trains everything, uploads the extractor."""

    def receive(self, payload: Payload, server_round: int) -> None:
        load_arrays(self.model, payload)

    def upload(self) -> Payload:
        return extractor_arrays(self.model)

    def secure_upload(self, upload: Payload) -> Payload:
        return secure_group_upload(self, self.arch, upload)


class FedPer(PerArchitectureExtractors):
    """Averages the uploaded extractors within each architecture."""
