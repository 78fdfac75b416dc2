"""FedGH (Yi et al., ACM MM 2023): a global prediction header trained on the server from the
clients' local averaged representations.

Client k owns a heterogeneous feature extractor g_k and a header h_k = Linear(d, C) of the same
shape for everyone. Each round it installs the global header h, trains the whole model with
plain cross-entropy, then computes one *local averaged representation* (LAR) per local class,
``R_kc = mean of g_k(x) over its training samples of class c`` (exact mean, eval mode, after
training), and uploads the pairs (R_kc, c): S_k * (d + 1) numbers, the label counted as one
32-bit value as the paper does (1002 for d=500 and two classes). The locally trained header is
not uploaded. The server keeps one global header and trains it with cross-entropy on the LARs
it received, client after client ("as soon as a client's LARs arrive"), then sends it to the
next round's clients: d*C + C floats (5010).

Evaluation reports both headers: ``accuracy`` is the client's model after local training (the
global header fine-tuned locally: the paper's tables and the authors' code), and
``accuracy-global-header`` the same extractor with the current global header installed.

``fedgh.server-head-training = false`` reproduces the authors' released code, whose server
optimizer never updates the header: clients then re-install the same random header every round.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedapp.runtime.client_base import FedClient, load_arrays
from fedapp.runtime.payload import ArraySpec, Payload, PayloadError
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload
from fedapp.seeding import derive_seed
from strategies.fedgh import FedGHSettings


class FedGHClient(FedClient):
    """Installs the global header, trains with CE, uploads its local averaged representations."""

    def receive(self, payload: Payload, server_round: int) -> None:
        load_arrays(self.model, payload)  # {} in round 1: train with the own random header

    def receive_for_evaluation(self, payload: Payload) -> bool:
        # Keep the global header aside; the headline accuracy uses the locally trained one.
        self.global_header = payload
        return False

    def evaluation_variants(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        header = getattr(self, "global_header", None)
        if not header:
            return {}
        return {"global-header": self.head_accuracy(header, x, y)}

    def upload(self) -> Payload:
        lars = self.class_means()
        return {"representations": lars.means, "labels": lars.labels}


class FedGH(FedStrategy):
    """Trains the global header on the uploaded (LAR, label) pairs; sends it to everyone."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings: FedGHSettings = self.cfg.settings
        model = self.new_model(self.architectures[0])
        self.feature_dim = model.feature_dim
        self.global_header = torch.nn.Linear(self.feature_dim, self.num_classes)
        self.global_header.load_state_dict(model.head.state_dict())
        self._payload = self._header_payload()

    def _header_payload(self) -> Payload:
        return {f"head.{k}": v.detach().numpy().astype(np.float32)
                for k, v in self.global_header.state_dict().items()}

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        # Round 1: clients train with their own random headers (the paper's t = 0).
        return self._payload if server_round > 1 else {}

    def eval_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        return self._payload

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        return {"representations": ArraySpec((None, self.feature_dim)),
                "labels": self.label_spec()}

    def check_upload(self, payload: Payload, client: ClientInfo) -> None:
        labels, reps = payload["labels"], payload["representations"]
        if len(labels) != len(reps) or len(labels) == 0:
            raise PayloadError(f"{len(reps)} representations for {len(labels)} labels")
        if len(np.unique(labels)) != len(labels):
            raise PayloadError("a class appears twice among the labels")

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        if self.settings.server_head_training:
            train_header(self.global_header, self.client_lars(uploads), self.settings,
                         derive_seed(self.cfg.seed, "fedgh-server", server_round))
            self._payload = self._header_payload()

    def client_lars(self, uploads: list[Upload]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each client's (LARs, labels), in upload order, less the pairs a robust rule drops
        (``training_pairs``: per label, over every client's LARs of it); a client left with
        none drops out of the round's training."""
        reps = np.concatenate([u.payload["representations"] for u in uploads])
        labels = np.concatenate([u.payload["labels"] for u in uploads])
        sender = np.repeat(np.arange(len(uploads)), [len(u.payload["labels"]) for u in uploads])
        pids = np.array([u.client.partition_id for u in uploads])
        reps, keep = self.training_pairs(reps, labels, owners=pids[sender])
        return [(reps[mine], labels[mine]) for i in range(len(uploads))
                if (mine := keep & (sender == i)).any()]


def train_header(header: torch.nn.Linear, lars: list[tuple[np.ndarray, np.ndarray]],
                 settings: FedGHSettings, seed: int) -> None:
    """SGD with cross-entropy on each client's (representations, labels), client by client.

    The paper updates the header "as soon as a client's LARs arrive", so one step per client
    (``server-batch-size`` = 0) by default, in a seeded shuffled order standing in for arrival
    order. Plain SGD keeps no state, so a fresh optimizer per round equals a persistent one."""
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.SGD(header.parameters(), lr=settings.server_lr)
    header.train()
    if settings.client_order == "pooled":
        # HtFLlib's server: one shuffled DataLoader over every client's pairs, each epoch.
        lars = [tuple(np.concatenate(parts) for parts in zip(*lars))] if lars else []
    for _ in range(settings.server_epochs):
        order = (rng.permutation(len(lars)) if settings.client_order == "shuffled"
                 else np.arange(len(lars)))
        for i in order:
            reps, labels = (torch.from_numpy(a) for a in lars[i])
            if settings.client_order == "pooled":
                mix = torch.from_numpy(rng.permutation(len(labels)))
                reps, labels = reps[mix], labels[mix]
            step = settings.server_batch_size or len(labels)
            for start in range(0, len(labels), step):
                loss = F.cross_entropy(header(reps[start:start + step]),
                                       labels[start:start + step].long())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
