"""FedRolex (Alam, Liu, Yan and Zhang, "FedRolex: Model-Heterogeneous Federated Learning with
Rolling Sub-Model Extraction", NeurIPS 2022): HeteroFL with a rolling window of channels.

Everything is HeteroFL's (``strategies.heterofl.maths``: the client, the coordinate-count
average with the label-split head, both evaluations) except which channels a client of rate r
holds: along every hidden dimension of width w, the k = ⌈r·w⌉ indices
{(j − t) mod w : j < k}, in that order, in round t + 1 (the code's
``torch.roll(torch.arange(w), t % w)[:k]`` in ``ResnetServerRoll.split_model``; the base's
``window(..., "rolling", t)``). The same t applies to every layer, so a layer's input indices
are its predecessor's output indices; the head keeps all C rows. Over w rounds every channel
of a layer is in exactly k of the windows.
"""

from __future__ import annotations

from strategies.heterofl.maths import HeteroFL, SubmodelClient


class FedRolexClient(SubmodelClient):
    """HeteroFL's client: it trains the slice it receives, whichever window it is (the window
    never travels; with secure aggregation the client computes it from the round, to pad its
    slice)."""


class FedRolex(HeteroFL):
    """HeteroFL's server with the rolling index scheme (``FedRolexSettings.index_scheme``)."""
