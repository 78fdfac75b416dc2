"""LG-FedAvg (Liang et al., 2020): share and average only the head; extractors stay local.

Every client keeps its own extractor (any architecture) and shares the linear head, which has
the same shape for all because every extractor outputs the shared feature dimension d. Per
client per round d*C + C floats go each way (5010 for d=500, C=10 — FedGH Table 3's
39.14 KB both ways). Clients are evaluated with their own model after local training;
``accuracy-global-head`` is the same extractor with the current global head, what HtFLlib's
LG-FedAvg evaluates (it installs the global head before testing).
"""

import torch

from fedapp.runtime.client_base import FedClient, load_arrays, state_arrays
from fedapp.runtime.payload import ArraySpec, Payload
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload


class LgFedAvgClient(FedClient):
    """Replaces its head by the global head, trains everything, uploads the head."""

    def receive(self, payload: Payload, server_round: int) -> None:
        load_arrays(self.model, payload)

    def receive_for_evaluation(self, payload: Payload) -> bool:
        # The personalised model (global head + local training) is the headline; the global
        # head is kept aside for the variant.
        self.global_head = payload
        return False

    def evaluation_variants(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        head = getattr(self, "global_head", None)
        return {"global-head": self.head_accuracy(head, x, y)} if head else {}

    def upload(self) -> Payload:
        return state_arrays(self.model, list(self.model.head_state()))


class LgFedAvg(FedStrategy):
    """Keeps the global head; averages uploaded heads weighted by n_k."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        model = self.new_model(self.architectures[0])
        self.global_head = state_arrays(model, list(model.head_state()))

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        return self.global_head

    def eval_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        return self.global_head  # for the "global-head" variant only

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        return {name: ArraySpec(a.shape) for name, a in self.global_head.items()}

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        self.global_head = self.average([u.payload for u in uploads],
                                        [u.num_examples for u in uploads],
                                        reference=self.global_head)
