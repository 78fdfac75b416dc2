"""HeteroFL (Diao, Ding and Tarokh, "HeteroFL: Computation and Communication Efficient Federated
Learning for Heterogeneous Clients", ICLR 2021): clients of different compute train width slices
of one global model.

Client k of rate r_k (``heterofl.rates``: HeteroFL's levels a = 1 ... e = 1/16) receives the
leading ⌈r_k·w⌉ channels of every hidden layer of the global model (``heterofl.global-arch``),
as a model built at that width (``client_models.width``: the global model is never built on
the client), trains it with the masked cross-entropy (logits of classes it holds no samples of
set to 0, ``heterofl.mask``) and uploads it whole. Its static BatchNorms use batch statistics,
and its Scaler divides activations by r_k while training.

Server, each round (the code's ``fed.Federation.combine``): for every tensor, Σ values and Σ
counts over the clients whose slice holds each coordinate (the head's rows only for the
client's own classes), Σ/count where the count is positive; coordinates nobody trained keep
their value. Unweighted by samples. The coordinate bookkeeping is the base's
(``fedapp.runtime.submodels``); only the index scheme differs in FedRolex.

Evaluation, both ways:

- the paper's: the global model at full width on the global test set (``server_accuracy``'s
  ``global``), its BatchNorm statistics from the pooled training set (``heterofl.sbn``);
- the project's: each client's own slice (this round's rate) on its local test split, its
  statistics from its own training data; ``accuracy-masked`` with the label-split head.

Traffic per client per round: params(r_k) floats each way; the index sets follow from
(r_k, layer) and never travel.
"""

from __future__ import annotations

import functools
from fractions import Fraction

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedapp.data import setup
from fedapp.data.local_data import expected_input
from fedapp.data.partitions import load_client_data
from fedapp.runtime import secure_aggregation
from fedapp.runtime.client_base import FedClient, load_arrays, state_arrays
from fedapp.runtime.payload import ArraySpec, Payload
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload
from fedapp.runtime.submodel_settings import SubmodelSettings
from fedapp.runtime.submodels import (CoordinateAverage, IndexMap, extract, index_maps,
                                      label_mask, masked_logits, meta_shapes, padded_layout,
                                      padded_upload, window_offset, with_statistics)
from fedapp.runtime.training import EVAL_BATCH, evaluate
from fedapp.seeding import derive_seed, isolated_rng
from strategies.heterofl import HeteroFLSettings


def width_model(cfg, rate: Fraction, input_shape: tuple[int, int, int],
                num_classes: int) -> nn.Module:
    """The run's global architecture at ``rate`` (``SubmodelSettings.width_model``)."""
    return cfg.settings.width_model(cfg, rate, input_shape, num_classes)


def slice_maps(settings: SubmodelSettings, global_shapes: dict[str, tuple[int, ...]],
               slice_shapes: dict[str, tuple[int, ...]], server_round: int) -> IndexMap:
    """The index maps of a slice in ``server_round``: the method's index scheme, and the
    rolling window's offset in that round. The server computes them for every upload; with
    secure aggregation the client computes its own, to pad its slice."""
    return index_maps(global_shapes, slice_shapes, settings.index_scheme,
                      window_offset(server_round))


class MaskedHead(nn.Module):
    """``model`` with the logits outside ``mask`` set to 0 (HeteroFL's masked head)."""

    def __init__(self, model: nn.Module, mask: torch.Tensor) -> None:
        super().__init__()
        self.model, self.mask = model, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return masked_logits(self.model(x), self.mask)


class SubmodelClient(FedClient):
    """Keeps no private model: each message builds the model of this round's rate, fills it
    with the slice the server sent, trains and uploads it."""

    submodel_round = 0

    def fit(self, parameters, config):
        self.submodel_round = int(config.get("server-round", 0))
        return super().fit(parameters, config)

    def evaluate(self, parameters, config):
        self.submodel_round = int(config.get("server-round", 0))
        return super().evaluate(parameters, config)

    @functools.cached_property
    def rate(self) -> Fraction:
        """This client's width rate in this message's round."""
        return self.cfg.settings.client_rates(self.cfg, self.submodel_round)[self.partition_id]

    def _restore_model(self) -> nn.Module:
        self._version = 0
        # Its initial weights are overwritten by the slice; drawn from a keyed stream anyway.
        with isolated_rng(derive_seed(self.cfg.seed, "model-init", self.partition_id)):
            model = width_model(self.cfg, self.rate, *expected_input(self.cfg))
        return model.to(self.device)

    def _cache_model(self, version: int) -> None:
        """Nothing to keep between messages: the next one brings its own slice."""

    def receive(self, payload: Payload, server_round: int) -> None:
        load_arrays(self.model, payload)

    @functools.cached_property
    def own_classes(self) -> torch.Tensor:
        """[C] bool: the classes of this client's training data (HeteroFL's label split)."""
        return label_mask(self.data.train_y, self.num_classes)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        if self.cfg.settings.mask:
            logits = masked_logits(logits, self.own_classes)
        return F.cross_entropy(logits, y)

    def upload(self) -> Payload:
        return state_arrays(self.model)

    # -- secure aggregation: the slice padded to the global model --------------------------------
    def head_rows(self) -> np.ndarray | None:
        """The head rows this client adds and counts: its own classes with the label-split head
        (the server's ``HeteroFL.label_rows``), None = all rows."""
        if not self.cfg.settings.mask:
            return None
        return np.flatnonzero(self.own_classes.cpu().numpy()).astype(np.int64)

    def secure_weight(self) -> float:
        return 1.0  # HeteroFL's average is unweighted

    def secure_upload(self, upload: Payload) -> Payload:
        # The server's CoordinateAverage of this one client, padded to the global model's
        # shapes: its slice (its head rows only, with the label-split head) times its weight
        # at the coordinates it holds, and that weight there; zeros elsewhere. The survivors'
        # sum is the round's Σ values and Σ weights (HeteroFL.aggregate_sums).
        global_shapes = meta_shapes(lambda: width_model(self.cfg, Fraction(1),
                                                        *expected_input(self.cfg)))
        maps = slice_maps(self.cfg.settings, global_shapes,
                          {name: array.shape for name, array in upload.items()},
                          self.submodel_round)
        return padded_upload(global_shapes, upload, maps, self.secure_weight(),
                             self.head_rows())

    def predictor(self) -> nn.Module:
        """The slice, with BatchNorm statistics of this client's training data (sBN), or with
        the test batches' own (``sbn = "none"``)."""
        if self.cfg.settings.sbn == "none":
            return self.model
        kept = getattr(self, "_with_statistics", None)
        if kept is None or kept[0] is not self.model:
            kept = self._with_statistics = (
                self.model, with_statistics(self.model, self.data.train_x, EVAL_BATCH))
        return kept[1]

    def evaluation_variants(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        if not self.cfg.settings.mask:
            return {}
        return {"masked": evaluate(MaskedHead(self.predictor(), self.own_classes), x, y)[1]}


class HeteroFL(FedStrategy):
    """Holds the global model; sends each client its slice and averages per coordinate."""

    _caches = ("_shapes", "_slices", "_predictor", "_label_rows")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings: HeteroFLSettings = self.cfg.settings
        with isolated_rng(setup.model_init_seed(self.cfg, self.settings.global_arch, "server")):
            model = width_model(self.cfg, Fraction(1), self.input_shape, self.num_classes)
        self.global_model = state_arrays(model)
        self.fit_round = 0  # the round whose slices the uploads must have
        self._shapes: dict[Fraction, dict[str, tuple[int, ...]]] = {}
        self._slices: tuple[Payload | None, dict] = (None, {})
        self._predictor: tuple[Payload, nn.Module] | None = None
        self._label_rows: dict[int, np.ndarray] = {}

    def method_state(self) -> dict:
        # The caches are rebuilt from the global model and the run config.
        return {k: v for k, v in super().method_state().items() if k not in self._caches}

    def restore(self, server_round: int, method_state: dict) -> None:
        super().restore(server_round, method_state)
        self._slices, self._predictor = (None, {}), None

    # -- who holds which coordinates -------------------------------------------------------------
    @property
    def index_scheme(self) -> str:
        """The settings' (HeteroFL: "leading"; FedRolex: "rolling")."""
        return self.settings.index_scheme

    def slice_shapes(self, rate: Fraction) -> dict[str, tuple[int, ...]]:
        if rate not in self._shapes:
            model = width_model(self.cfg, rate, self.input_shape, self.num_classes)
            self._shapes[rate] = {k: tuple(v.shape) for k, v in state_arrays(model).items()}
        return self._shapes[rate]

    def maps(self, partition_id: int, server_round: int) -> IndexMap:
        """The index maps of ``partition_id``'s slice in ``server_round``."""
        rate = self.settings.client_rates(self.cfg, server_round)[partition_id]
        return slice_maps(self.settings, {k: v.shape for k, v in self.global_model.items()},
                          self.slice_shapes(rate), server_round)

    def slice_for(self, partition_id: int, server_round: int) -> Payload:
        """The slice of the global model ``partition_id`` trains in ``server_round``: one
        dict per distinct (rate, window), so that it is encoded once for all its clients."""
        rate = self.settings.client_rates(self.cfg, server_round)[partition_id]
        key = (rate, window_offset(server_round) if self.index_scheme != "leading" else 0)
        # Keyed by the global model itself, not its id(): a later model may reuse a freed
        # one's address.
        if self._slices[0] is not self.global_model:
            self._slices = (self.global_model, {})
        kept = self._slices[1]
        if key not in kept:
            kept[key] = extract(self.global_model, self.maps(partition_id, server_round))
        return kept[key]

    def label_rows(self, client: ClientInfo) -> np.ndarray | None:
        """The head rows ``client`` adds and counts (its training classes), as HeteroFL's
        server splits the labels; None = all rows (``mask`` off, or a node with its own data,
        whose classes the server does not know)."""
        if not self.settings.mask or client.own_data:
            return None
        pid = client.partition_id
        if pid not in self._label_rows:
            labels = load_client_data(setup.dataset(self.cfg), setup.partition_spec(self.cfg),
                                      pid).train_y
            self._label_rows[pid] = np.unique(labels.numpy()).astype(np.int64)
        return self._label_rows[pid]

    # -- the round ---------------------------------------------------------------------------------
    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        self.fit_round = server_round
        return self.slice_for(client.partition_id, server_round) if client is not None else {}

    def eval_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        # Each client evaluates its own slice of the round's global model.
        return self.slice_for(client.partition_id, server_round) if client is not None else {}

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        return {name: ArraySpec(tuple(len(i) for i in idx))
                for name, idx in self.maps(client.partition_id, self.fit_round).items()}

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        total = CoordinateAverage(self.global_model, self.robust)
        for upload in uploads:
            total.add(upload.payload, self.maps(upload.client.partition_id, server_round),
                      rows=self.label_rows(upload.client))
        self.global_model = total.result()

    def secure_layout(self) -> dict[str, tuple[int, ...]]:
        return padded_layout({name: array.shape for name, array in self.global_model.items()})

    def aggregate_sums(self, server_round: int, sums: Payload, uploads: list[Upload]) -> None:
        # The same coordinate average as aggregate, from the sums of the survivors' padded
        # slices (each client added its own head rows and weight: SubmodelClient.secure_upload).
        noise = secure_aggregation.sum_error(self.cfg, len(uploads))
        self.global_model = CoordinateAverage.from_padded(self.global_model, sums,
                                                          noise).result()

    # -- the paper's evaluation --------------------------------------------------------------------
    def global_predictor(self) -> nn.Module:
        """The global model at full width, with statistics of the pooled training set (sBN,
        the code's ``stats``) unless ``sbn = "none"``; rebuilt when the global model changes."""
        if self._predictor is None or self._predictor[0] is not self.global_model:
            model = width_model(self.cfg, Fraction(1), self.input_shape, self.num_classes)
            load_arrays(model, self.global_model)
            if self.settings.sbn == "server-pool":
                data, spec = setup.dataset(self.cfg), setup.partition_spec(self.cfg)
                pooled = torch.cat([load_client_data(data, spec, pid).train_x
                                    for pid in range(self.cfg.num_clients)])
                model = with_statistics(model, pooled, EVAL_BATCH)
            self._predictor = (self.global_model, model.eval())
        return self._predictor[1]

    @torch.no_grad()
    def server_predict(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"global": self.global_predictor()(x)}
