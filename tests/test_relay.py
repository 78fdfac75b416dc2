"""CompFL device to device (server-loop = "walk" / "gossip"), in process on the fake grid of
test_async.py: topologies and mixing weights, that the server only relays (every model a
client receives is, byte for byte, a reply of another client or the seed's initial model, and
the strategy never aggregates), that the virtual clock makes a walk reproducible, that a
hostile reply does not travel on, and the per-edge traffic. Against real SuperNodes:
test_deploy.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Message
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.compat.common.recorddict_compat import fitres_to_recorddict, recorddict_to_fitres

from fedapp.config import ConfigError
from fedapp.loops.relay import GossipLoop, WalkLoop
from fedapp.loops.topology import draw, metropolis_weights
from fedapp.runtime.payload import from_ndarrays, to_ndarrays
from fedapp.runtime.strategy_base import Encoder
from strategies import load_config
from strategies.compfl.maths import CompFL, gossip_mix
from tests.test_async import run_async, run_config

SMALL, LARGE = "fedpac-cnn", "fedpac-cnn3"  # clients 0, 2 run the small expert, 1, 3 the large


def relay_config(loop: str, **overrides) -> dict:
    base = dict(method="compfl", server_loop=loop, arch_mix=f"{SMALL},{LARGE}", feature_dim=0,
                partition="pathological", classes_per_client=3, val_fraction=0.1,
                batch_size=30, num_server_rounds=2)
    return run_config(**{**base, **overrides})


def run(tmp_path, name, loop, grid_out=None, **overrides):
    cls = {"walk": WalkLoop, "gossip": GossipLoop}[loop]
    return run_async(tmp_path, name, flat=relay_config(loop, **overrides), loop=cls,
                     grid_out=grid_out)


@pytest.fixture
def no_aggregation(monkeypatch):
    def refuse(self, server_round, uploads):
        raise AssertionError("a device-to-device loop must never aggregate")
    monkeypatch.setattr(CompFL, "aggregate", refuse)


# -- topologies ----------------------------------------------------------------------------------

def _cfg(**kw):
    return load_config(relay_config("walk", **{"num_clients": 10, **kw}))


@pytest.mark.parametrize("kind,edges", [("full", 45), ("ring", 10), ("regular", 15)])
def test_topologies_have_their_shape_and_are_connected(kind, edges):
    graph = draw(_cfg(topology=kind, topology_degree=3))
    assert len(graph.edges()) == edges and graph.connected()
    if kind != "full":
        assert {graph.degree(i) for i in range(10)} == ({2} if kind == "ring" else {3})


def test_erdos_renyi_is_seeded_connected_and_keeps_subsets_connected():
    a, b = draw(_cfg(topology="erdos-renyi")), draw(_cfg(topology="erdos-renyi"))
    c = draw(_cfg(topology="erdos-renyi", seed=1))
    assert a == b and a != c and a.connected() and 20 < len(a.edges()) < 45
    evens = list(range(0, 10, 2))
    assert draw(_cfg(topology="erdos-renyi", topology_p=0.3), [evens]).connected(evens)
    with pytest.raises(ConfigError, match="no connected erdos-renyi graph"):
        draw(_cfg(topology="erdos-renyi", topology_p=0.01))
    with pytest.raises(ConfigError, match="d-regular graph needs"):
        draw(_cfg(topology="regular", topology_degree=3, num_clients=9))


def test_metropolis_weights_are_doubly_stochastic():
    graph = draw(_cfg(topology="erdos-renyi"))
    within = [0, 1, 2, 3, 5, 8]
    if not graph.connected(within):
        graph = draw(_cfg(topology="erdos-renyi"), [within])
    w = np.zeros((10, 10))
    for i in within:
        for j, v in metropolis_weights(graph, i, within).items():
            w[i, j] = v
    sub = w[np.ix_(within, within)]
    assert (sub >= 0).all() and np.allclose(sub.sum(0), 1) and np.allclose(sub.sum(1), 1)
    assert np.allclose(sub, sub.T)


def test_gossip_mix_is_the_weighted_average():
    rng = np.random.default_rng(0)
    models = [{"w": rng.normal(size=(3, 2)).astype(np.float32), "n": np.array([k])}
              for k in range(3)]
    mixed = gossip_mix(models, [0.5, 0.25, 0.25])
    np.testing.assert_allclose(mixed["w"], 0.5 * models[0]["w"] + 0.25 * (models[1]["w"]
                                                                         + models[2]["w"]),
                               rtol=1e-6)
    assert mixed["w"].dtype == np.float32 and mixed["n"].tolist() == [2]


def test_only_compfl_runs_device_to_device_and_settings_are_checked():
    with pytest.raises(ConfigError, match="server-loop = 'walk' is invalid for method 'fedhe'"):
        load_config(run_config(server_loop="walk"))
    with pytest.raises(ConfigError, match="walk-forward = 1"):
        load_config(relay_config("walk", walk_forward=1.0))
    with pytest.raises(ConfigError, match="only synchronous rounds keep checkpoints"):
        load_config(relay_config("gossip", checkpoint_every=1))


# -- the walk ------------------------------------------------------------------------------------

def _visits(updates):
    return [(u["client"], u["expert"], u["client_update"]) for u in updates]


def test_a_walk_only_relays_and_is_reproducible(tmp_path, no_aggregation):
    grids = []
    summary, updates, strategy = run(tmp_path, "w", "walk", grid_out=grids, topology="ring",
                                     walk_forward=0.3)
    assert summary["updates"]["committed"] == 8 and summary["loop"] == "walk"
    # The budget (2 rounds x 4 clients) is split over the two walkers; the large expert is
    # trained only by clients that can run it.
    by_expert = {e: [u["client"] for u in updates if u["expert"] == e] for e in (SMALL, LARGE)}
    assert len(by_expert[SMALL]) == len(by_expert[LARGE]) == 4
    assert set(by_expert[LARGE]) <= {1, 3}
    # Relay only: each visit gets exactly the bytes its walker's previous holder replied (or
    # the seed's initial model first), and the server's models never change.
    last = {e: Encoder()(strategy.initial_model(e))[0].tensors for e in (SMALL, LARGE)}
    for pid, config, sent, replied in grids[0].trains:
        assert config["visit"] == "walk"
        assert sent == last[config["expert"]]
        last[config["expert"]] = replied
    assert all(np.array_equal(v, strategy.new_model(a).state_dict()[k.split("/", 1)[1]]
                              .numpy().reshape(v.shape))
               for a in (SMALL, LARGE) for k, v in strategy.initial_model(a).items())
    # Per-edge traffic: only topology edges (ring: i -> i +- 1), and every hop counted.
    edges = json.loads((tmp_path / "w" / "edges.json").read_text())
    assert edges["topology"]["kind"] == "ring"
    for key in edges["bytes"]:
        s, d = map(int, key.split("->"))
        assert (d - s) % 4 in (1, 3)
    # Every visit but each walker's first came over at least one edge.
    first = {}
    for i, (_, config, _, _) in enumerate(grids[0].trains):
        first.setdefault(config["expert"], i)
    hops = sum(len(b"".join(sent)) for i, (_, _, sent, _) in enumerate(grids[0].trains)
               if i not in first.values())
    assert summary["peer_traffic"]["total_bytes"] >= hops > 0
    # One seed, one walk, whatever order the replies come back in.
    shuffled, updates_shuffled, _ = run_async(
        tmp_path, "w2", shuffle=3, flat=relay_config("walk", topology="ring", walk_forward=0.3),
        loop=WalkLoop, grid_out=grids)
    arrivals = [[(pid, config["expert"]) for pid, config, _, _ in g.trains] for g in grids]
    assert arrivals[0] != arrivals[1], "the shuffled grid delivered the replies in one order"
    assert _visits(updates) == _visits(updates_shuffled)
    assert summary["accuracy"]["per_client"] == shuffled["accuracy"]["per_client"]
    assert (tmp_path / "w" / "topology.json").exists()


def test_a_hostile_reply_does_not_travel_on(tmp_path, no_aggregation):
    answered = []

    def poison(pid, update, message, reply):  # the second training reply of the run
        answered.append((pid, update))
        if len(answered) != 2:
            return None
        res = recorddict_to_fitres(reply.content, keep_input=True)
        arrays = from_ndarrays(parameters_to_ndarrays(res.parameters))
        name = next(iter(arrays))
        arrays[name] = np.full_like(arrays[name], np.nan)
        res.parameters = ndarrays_to_parameters(to_ndarrays(arrays))
        return Message(fitres_to_recorddict(res, keep_input=True), reply_to=message)

    grids = []
    summary, updates, _ = run_async(tmp_path, "h", break_reply=poison,
                                    flat=relay_config("walk"), loop=WalkLoop, grid_out=grids)
    bad = [u for u in updates if u["status"] == "rejected"]
    assert [(u["client"], u["client_update"]) for u in bad] == [answered[1]]
    assert summary["updates"]["committed"] == 8
    # The walker went on from what its holder had been given, not from the poisoned reply.
    trains = grids[0].trains
    expert = trains[1][1]["expert"]
    after = next(t for t in trains[2:] if t[1]["expert"] == expert)
    assert after[2] == trains[1][2] and after[2] != trains[1][3]


# -- gossip --------------------------------------------------------------------------------------

def test_gossip_trains_largest_first_and_only_relays(tmp_path, no_aggregation):
    grids = []
    summary, updates, strategy = run(tmp_path, "g", "gossip", grid_out=grids,
                                     num_server_rounds=3, topology="full")
    # 12 updates over the phases' 2 + 4 clients: 2 gossip rounds per expert, largest first.
    assert summary["updates"]["committed"] == 12
    assert [u["expert"] for u in updates] == [LARGE] * 4 + [SMALL] * 8
    assert {u["client"] for u in updates[:4]} == {1, 3}
    initial = {e: Encoder()(strategy.initial_model(e))[0].tensors for e in (SMALL, LARGE)}
    replies: list[list[bytes]] = []
    for pid, config, sent, replied in grids[0].trains:
        sizes = [int(n) for n in config["mix-sizes"].split(",")]
        weights = [float(w) for w in config["mix-weights"].split(",")]
        assert abs(sum(weights) - 1) < 1e-12 and len(sizes) == len(weights)
        parts, start = [], 0
        for n in sizes:
            parts.append(sent[start:start + n])
            start += n
        assert start == len(sent)
        # Each part is the expert's initial model or some client's earlier reply, unopened.
        assert all(p == initial[config["expert"]] or p in replies for p in parts)
        replies.append(replied)
    edges = json.loads((tmp_path / "g" / "edges.json").read_text())["bytes"]
    # Full topology: in each gossip round every client gets every other member's model.
    assert summary["peer_traffic"]["total_bytes"] == sum(edges.values()) > 0
    assert set(edges) == {f"{s}->{d}" for s in range(4) for d in range(4) if s != d}


def test_a_dropped_gossip_member_shrinks_the_budget_and_the_run_ends(tmp_path, caplog):
    import logging

    from flwr.app import Error

    def crash(pid, update, message, reply):
        return Message(Error(code=2, reason="boom"), reply_to=message) if pid == 3 else None

    with caplog.at_level(logging.WARNING):
        summary, updates, _ = run_async(tmp_path, "d", break_reply=crash, loop=GossipLoop,
                                        flat=relay_config("gossip", async_retries=0))
    # One gossip round per phase (8 / (2 + 4) rounded): 6 updates, of which client 3's two
    # (one per phase) are never made once it is dropped.
    assert "client 3 left the gossip; the run now ends after 4 updates" in caplog.text
    assert summary["updates"]["committed"] == 4 and "3" not in summary["updates"]["per_client"]
    assert [u["client"] for u in updates if u["status"] == "failed"] == [3]
