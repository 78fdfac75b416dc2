"""FedGKT (He, Annavaram, Avestimehr, NeurIPS 2020): group knowledge transfer.

Each client model is cut after its stem (``client_models.stems``): the stem's feature map H is
what travels, and the rest of the model, head included, is the client's own small classifier
path. Every stem of the federation emits the same map shape, since one server model g takes
them all (the card refuses another mix before the run starts).

Client k, each round: ``local-epochs`` passes of ``CE(o, y) + alpha * KL_T(z_s || o)`` over
its training set, where ``z_s`` is the server's logit vector for *the same sample*: the table
the server sent is indexed by sample id, and the training loop hands the loss the ids of its
(shuffled) batch. The reference keys the server logits by batch index and so needs unshuffled
loaders; here batches are shuffled as for every other method and each sample still meets its
own target. In its first round a client has no table yet and trains with CE alone. After
training, in eval mode, it extracts for every training sample (H_i, o_i, y_i) and uploads them
with the sample ids i: ``n_k * (F + C)`` floats and ``2 n_k`` int32 (label, id).

Server, each round: ``fedgkt.server-epochs`` passes of g over the round's uploads with
``CE(g(H), y)`` (plus, with ``fedgkt.server-distill``, ``KL_T(o_client || g(H))``; off by
default, as in the reference), then each uploader's server logits go back to it at its next
round, row i for its sample i: ``n_k * C`` floats. The server optimizer is built once and kept
(as the reference's), the client's too (the recipe's ``optimizer-state = "keep"``). The
reference's ReduceLROnPlateau stepped on the *test* accuracy is left out: it tunes the
learning rate on the test set.

Memory: the maps of a round are held only while the server trains on them (about twice one
round's uploads at the peak: the arrays received and their concatenation), then dropped. What
stays is the server model and each client's latest server logits (``C`` floats per training
sample of the federation), so a client that skips rounds still gets the logits of its last
upload.

Evaluation: ``accuracy`` is the client's own small model on its test split (the project's
metric); with ``fedgkt.eval-server-model`` the server sends its model for evaluation and the
client also reports ``accuracy-server-model``, its stem followed by the server model (the
paper's metric), at the cost of the server model's bytes (``eval_bytes_down``).
"""

from __future__ import annotations

from logging import WARNING

import numpy as np
import torch
import torch.nn.functional as F
from flwr.common.logger import log

from client_models import build_model
from client_models.base import probe_output_shape
from client_models.stems import stem
from fedapp.config import RunConfig
from fedapp.data.setup import model_init_seed
from fedapp.runtime.client_base import FedClient, load_arrays, state_arrays
from fedapp.runtime.payload import ArraySpec, Payload, PayloadError
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload
from fedapp.runtime.training import EVAL_BATCH, TrainStats, evaluate, recipe_optimizer, train_recipe
from fedapp.seeding import derive_seed, isolated_rng
from strategies.fedgkt import FedGKTSettings


def kl_t(target: torch.Tensor, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``KL_T(target || logits) = T^2 * batch-mean sum_c p_c log(p_c / q_c)`` with
    ``p = softmax(target / T)`` and ``q = softmax(logits / T)``; the target is not
    differentiated (the reference's ``KL_Loss``: T^2 keeps the gradient's scale)."""
    t = temperature
    return F.kl_div(F.log_softmax(logits / t, 1), F.log_softmax(target.detach() / t, 1),
                    log_target=True, reduction="batchmean") * t * t


def server_model(cfg: RunConfig, map_shape: tuple[int, ...], num_classes: int
                 ) -> torch.nn.Module:
    """The server's model g on maps of ``map_shape``, its initial weights keyed by (seed,
    server arch, "server"); its own representation size (no shared d)."""
    arch = cfg.settings.server_arch
    with isolated_rng(model_init_seed(cfg, arch, "server")):
        return build_model(arch, map_shape, num_classes, width=cfg.model_width)


def split_forward(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(stem maps H, logits o) of ``x`` in eval mode, in evaluation's batches: the stem runs
    once, the rest of the model on its output (the same operations as ``model(x)``)."""
    cut = stem(model)
    rest = torch.nn.Sequential(model.extractor[0][len(cut):], *model.extractor[1:], model.head)
    model.eval()
    maps, logits = [], []
    with torch.no_grad():
        for start in range(0, len(x), EVAL_BATCH):
            h = cut(x[start:start + EVAL_BATCH])
            maps.append(h)
            logits.append(rest(h))
    if not maps:
        shape = probe_output_shape(cut, tuple(x.shape[1:]), "stem")
        return x.new_zeros((0, *shape)), x.new_zeros((0, model.num_classes))
    return torch.cat(maps), torch.cat(logits)


class FedGKTClient(FedClient):
    """CE + alpha * KL_T to the server's logits of each sample; uploads (H, o, y, id) of every
    training sample."""

    server_logits: torch.Tensor | None = None  # z_s, row i for training sample i

    def receive(self, payload: Payload, server_round: int) -> None:
        table = payload.get("logits")
        n = len(self.data.train_y)
        if table is not None and table.shape != (n, self.num_classes):
            # Not this client's samples (its data changed since its last upload): no target.
            log(WARNING, "partition %s: server logits of shape %s for %d training samples are "
                "ignored", self.partition_id, table.shape, n)
            table = None
        self.server_logits = (None if table is None
                              else torch.from_numpy(np.asarray(table, np.float32)).to(self.device))

    def loss(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The loss of a mini-batch: ``ids`` are its samples' ids (indices into the training
        set), which key both the labels and the server's logits."""
        logits = self.model(x)
        loss = F.cross_entropy(logits, self.data.train_y[ids])
        s: FedGKTSettings = self.cfg.settings
        if s.alpha > 0 and self.server_logits is not None:
            loss = loss + s.alpha * kl_t(self.server_logits[ids], logits, s.temperature)
        return loss

    def train(self, server_round: int) -> TrainStats:
        # The loop batches the sample ids in place of the labels: the same batches, in the
        # same order, as every method's loop over (x, y).
        ids = torch.arange(len(self.data.train_y), device=self.device)
        return train_recipe(self.model, self.data.train_x, ids, loss_fn=self.loss,
                            optimizer=self.optimizer(), cfg=self.cfg,
                            generator=self.batch_generator(server_round),
                            steps=self.local_steps())

    def upload(self) -> Payload:
        maps, logits = split_forward(self.model, self.data.train_x)
        n = len(self.data.train_y)
        return {"features": maps.cpu().numpy().astype(np.float32),
                "logits": logits.cpu().numpy().astype(np.float32),
                "labels": self.data.train_y.cpu().numpy().astype(np.int32),
                "sample_ids": np.arange(n, dtype=np.int32)}

    def receive_for_evaluation(self, payload: Payload) -> bool:
        self.server_state = payload  # the server model, scored beside the own one
        return False

    def evaluation_variants(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        state = getattr(self, "server_state", None)
        if not state:
            return {}
        cut = stem(self.model)
        map_shape = tuple(probe_output_shape(cut, self.model.input_shape, self.arch))
        server = server_model(self.cfg, map_shape, self.num_classes)
        load_arrays(server, state)
        return {"server-model": evaluate(torch.nn.Sequential(cut, server.to(self.device)),
                                         x, y)[1]}


class FedGKT(FedStrategy):
    """Trains the server model on the round's uploaded maps; sends each client its samples'
    server logits."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings: FedGKTSettings = self.cfg.settings
        # Checked before training by the data set-up (FedGKTSettings.build_own_models).
        self.map_shape = self.settings.server_input(self.cfg, self.architectures,
                                                    self.input_shape, self.num_classes)
        self.server_model = server_model(self.cfg, self.map_shape, self.num_classes)
        self.server_optimizer = recipe_optimizer(self.server_model.parameters(), self.cfg)
        self.server_logits: dict[int, np.ndarray] = {}  # partition id -> [n_k, C], by sample id
        self._eval_payload: Payload = {}

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        table = self.server_logits.get(client.partition_id) if client is not None else None
        return {} if table is None else {"logits": table}

    def eval_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        return self._eval_payload

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        return {"features": ArraySpec((None, *self.map_shape)),
                "logits": ArraySpec((None, self.num_classes)),
                "labels": self.label_spec(),
                "sample_ids": ArraySpec((None,), kind="int", low=0,
                                        high=self.examples_bound(client) - 1)}

    def check_upload(self, payload: Payload, client: ClientInfo) -> None:
        ids = payload["sample_ids"]
        n = len(ids)
        lengths = {k: len(payload[k]) for k in ("features", "logits", "labels")}
        if n == 0 or any(m != n for m in lengths.values()):
            raise PayloadError(f"{n} sample ids for {lengths}")
        if not client.own_data and n != self.examples_bound(client):
            raise PayloadError(f"{n} samples uploaded, but partition {client.partition_id} has "
                               f"{self.examples_bound(client)} training examples")
        if not np.array_equal(np.sort(ids), np.arange(n)):
            raise PayloadError("the sample ids are not each of 0..n-1 once")

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        cfg = self.cfg
        for group in self.server_optimizer.param_groups:  # the run's schedule (lr-decay-at)
            group["lr"] = cfg.lr * cfg.lr_factor(server_round)
        parts = [(torch.from_numpy(u.payload["features"]), torch.from_numpy(u.payload["logits"]),
                  torch.from_numpy(u.payload["labels"].astype(np.int64))) for u in uploads]
        generator = torch.Generator().manual_seed(derive_seed(cfg.seed, "fedgkt-server",
                                                              server_round))
        logits = train_server(self.server_model, self.server_optimizer, parts, self.settings,
                              cfg.batch_size, generator)
        for u, z in zip(uploads, logits):
            table = np.empty_like(z)
            table[u.payload["sample_ids"].astype(np.int64)] = z  # row i: sample i
            self.server_logits[u.client.partition_id] = table
        self._eval_payload = (state_arrays(self.server_model)
                              if self.settings.eval_server_model else {})


def train_server(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                 settings: FedGKTSettings, batch_size: int, generator: torch.Generator
                 ) -> list[np.ndarray]:
    """``settings.server_epochs`` passes of ``model`` over every client's (maps, client logits,
    labels); returns each client's server logits, in its upload's row order.

    ``server-order = "clients"`` goes client after client, each one's rows in order, in
    batches that never mix clients (the reference's loop over its per-client batch dicts);
    ``"shuffled"`` pools the round's rows and reshuffles them every epoch. The logits sent back
    are recorded during the last epoch in train mode, before each step (the reference), or with
    ``server-logits = "eval"`` by one pass in eval mode after training."""
    maps = torch.cat([p[0] for p in parts])
    client_logits = torch.cat([p[1] for p in parts])
    labels = torch.cat([p[2] for p in parts])
    sizes = [len(p[2]) for p in parts]
    n = len(labels)
    recorded = torch.empty(n, client_logits.shape[1])
    t, alpha = settings.temperature, settings.alpha
    model.train()
    for epoch in range(settings.server_epochs):
        if settings.server_order == "shuffled":
            order = torch.randperm(n, generator=generator)
            batches = list(order.split(batch_size))
        else:
            batches = [idx for start, size in zip(np.cumsum([0] + sizes[:-1]), sizes)
                       for idx in torch.arange(int(start), int(start) + size).split(batch_size)]
        for idx in batches:
            out = model(maps[idx])
            loss = F.cross_entropy(out, labels[idx])
            if settings.server_distill:
                kd = kl_t(client_logits[idx], out, t)
                loss = (loss + alpha * kd if settings.server_weighting == "paper"
                        else kd + alpha * loss)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if epoch == settings.server_epochs - 1:
                recorded[idx] = out.detach()
    if settings.server_logits == "eval":
        model.eval()
        with torch.no_grad():
            recorded = torch.cat([model(maps[i:i + EVAL_BATCH]) for i in range(0, n, EVAL_BATCH)])
    return [z.numpy().astype(np.float32) for z in recorded.split(sizes)]
