"""The link state's per-node message lookup (fedapp.runtime.linkstate) returns what Flower's own
does, message for message, expired messages included, on a state built as a simulation builds
it."""

import time

import flwr
import pytest
from flwr.app import Message, RecordDict
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState, RunRecord
from flwr.superlink.grid.inmemory_grid import InMemoryGrid
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager

from fedapp.runtime import linkstate

ORIGINAL = InMemoryLinkState.get_message_ins


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    # The process-wide identity a simulation sets before its ServerApp pushes anything.
    for key, value in (("_task_id", 1), ("_run_id", 7), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, key, value)


def _state_with_messages():
    """(state, node ids, ids of the messages pushed): 6 nodes, 2 messages for node 0, one
    each for nodes 1-3, one for node 4 that expires at once; node 5 gets none."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(),
                               ObjectStoreFactory())
    nodes = list(_register_nodes(6, factory))
    state = factory.state()
    run = Run.create_empty(run_id=7)  # registered as flwr.simulation.run_simulation does
    run.primary_task_id, run.federation_id = 1, NOOP_FEDERATION_ID
    state.run_ids[run.run_id] = RunRecord(run=run)
    state.task_store[1] = Task(task_id=1, run_id=run.run_id)
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    messages = [Message(RecordDict(), dst_node_id=nodes[k], message_type="train", ttl=ttl)
                for k, ttl in ((0, 60), (0, 60), (1, 60), (2, 60), (3, 60), (4, 0.05))]
    ids = list(grid.push_messages(messages))
    assert len(ids) == len(messages)
    time.sleep(0.1)  # node 4's message expires
    return state, nodes, ids


def _sweep(get, state, nodes, limit):
    """What one engine sweep (every node asked once) gets, by node, and what stays stored."""
    got = {k: [m.metadata.message_id for m in get(state, node, limit)]
           for k, node in enumerate(nodes)}
    return got, sorted(state.message_ins_store)


@pytest.mark.parametrize("limit", [1, None])
def test_per_node_lookup_returns_what_flowers_returns(limit):
    original, ours = _state_with_messages(), _state_with_messages()
    for _ in range(3):  # delivered messages are not handed out again
        got_original, stored_original = _sweep(ORIGINAL, original[0], original[1], limit)
        got_ours, stored_ours = _sweep(linkstate.get_message_ins, ours[0], ours[1], limit)
        # Message ids are random per push: compare by position in the push order.
        assert ([[original[2].index(i) for i in got_original[k]] for k in range(6)]
                == [[ours[2].index(i) for i in got_ours[k]] for k in range(6)])
        assert len(stored_original) == len(stored_ours)
    first = _sweep(ORIGINAL, *_state_with_messages()[:2], limit)[0]
    assert len(first[0]) == (1 if limit else 2) and first[4] == [] and first[5] == []


def test_installed_only_on_the_release_it_mirrors(monkeypatch):
    monkeypatch.setattr(InMemoryLinkState, "get_message_ins", ORIGINAL)
    monkeypatch.setattr(flwr, "__version__", "0.0.0")
    assert not linkstate.install()
    assert InMemoryLinkState.get_message_ins is ORIGINAL
    monkeypatch.setattr(flwr, "__version__", linkstate.VERSION)
    assert linkstate.install()
    assert InMemoryLinkState.get_message_ins is linkstate.get_message_ins


def test_node_partitions_are_the_engines_assignment(monkeypatch):
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(),
                               ObjectStoreFactory())
    grid = InMemoryGrid(state_factory=factory)
    partitions = linkstate.node_partitions(grid)
    assert partitions() == {}  # asked later, once the engine has registered the nodes
    engines = _register_nodes(50, factory)  # node id -> partition id, as the engine keeps it
    assert partitions() == engines
    assert linkstate.node_partitions(object()) is None  # a deployment's grid
    monkeypatch.setattr(flwr, "__version__", "0.0.0")
    assert linkstate.node_partitions(grid) is None
