"""FedAvg (McMahan et al., 2017): average the whole model, weighted by local sample counts.

Only meaningful when every client runs the same architecture; a heterogeneous arch mix is
refused at configuration time (its card's ``homogeneous_only``). Each round the
sampled clients start from the global model, train locally and upload all their weights; the
server replaces the global model by the n_k-weighted average. Clients are evaluated on their own
test split with the global model installed, as FedAvg has no personal model.
"""

from fedapp.runtime.client_base import FedClient, load_arrays, state_arrays
from fedapp.runtime.payload import ArraySpec, Payload
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload


class FedAvgClient(FedClient):
    """Installs the global model, trains it with cross-entropy, uploads all of it."""

    def receive(self, payload: Payload, server_round: int) -> None:
        load_arrays(self.model, payload)

    def upload(self) -> Payload:
        return state_arrays(self.model)


class FedAvg(FedStrategy):
    """Keeps one global model; its state is what every client downloads."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.global_model = state_arrays(self.new_model(self.architectures[0]))

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        return self.global_model

    eval_payload = fit_payload  # evaluate the global model, not the last local update

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        return {name: ArraySpec(a.shape, "float" if a.dtype.kind == "f" else "int")
                for name, a in self.global_model.items()}

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        self.global_model = self.average([u.payload for u in uploads],
                                         [u.num_examples for u in uploads],
                                         reference=self.global_model)
