"""Flower's in-memory link state, answering "what is there for node k?" at a cost that does not
grow with the number of nodes.

In a simulation (flwr 1.41) the engine asks the state for every node's next message ten times
a second (``vce_api.add_messages_to_queue`` loops over all nodes), and
``InMemoryLinkState.get_message_ins`` answers each question by first checking the expiry and
federation of *every* stored message, whoever it is for. A sweep over the nodes therefore costs
nodes x messages-in-flight validity checks: 10,000 nodes with 32 messages in flight are 320,000
checks, seconds per sweep, and every message waits for a sweep. So the time of a round grew with
the number of nodes in the federation even when only 20 of them were sampled.

:func:`install` replaces that method by one that does the same checks on the messages addressed
to the node asked, and returns the same messages: another node's message is checked (and, if
expired, dropped) when its own node is asked, which the engine does in the same sweep. It is
installed by the ServerApp, which in a simulation runs in the process that holds the state; in a
deployment the state lives in the SuperLink's process and nothing changes.

:func:`node_partitions` reads, in the same process, which partition each simulated node holds.
"""

from __future__ import annotations

from typing import Callable

from flwr.app import Message

VERSION = "1.41.0"  # the Flower release whose method this one mirrors (see tests/test_linkstate)


def get_message_ins(self, node_id: int, limit: int | None, *,
                    run_id: int | None = None) -> list[Message]:
    """``InMemoryLinkState.get_message_ins`` of flwr 1.41, checking only node_id's messages."""
    from flwr.server.superlink.linkstate.in_memory_linkstate import now

    if limit is not None and limit < 1:
        raise AssertionError("`limit` must be >= 1")
    found: list[Message] = []
    with self.lock:
        for msg_id, msg in list(self.message_ins_store.items()):
            if msg.metadata.dst_node_id != node_id:
                continue  # checked when its own node is asked
            self._check_stored_messages({msg_id})  # drops it if expired or out of federation
            msg = self.message_ins_store.get(msg_id)
            if (msg is not None and (run_id is None or msg.metadata.run_id == run_id)
                    and msg.metadata.delivered_at == ""):
                found.append(msg)
            if limit and len(found) == limit:
                break
    delivered_at = now().isoformat()
    for msg in found:
        msg.metadata.delivered_at = delivered_at
    return found


def node_partitions(grid: object) -> Callable[[], dict[int, int]] | None:
    """In a simulation on the Flower release mirrored here: a function giving each node's
    partition id as the simulation engine assigned it, so the server need not ask every node
    who it is (10,000 messages at 10,000 clients). ``vce_api._register_nodes`` creates node
    ``i`` for partition ``i``, in order, in this process's link state, whose ``nodes`` keeps
    that order. None in a deployment (the grid is not in-memory: the state is in the
    SuperLink's process) or on another release."""
    import flwr
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    if flwr.__version__ != VERSION or not isinstance(grid, InMemoryGrid):
        return None
    state = grid.state

    def partitions() -> dict[int, int]:
        with state.lock:
            return {node_id: i for i, node_id in enumerate(state.nodes)}
    return partitions


def install() -> bool:
    """Use :func:`get_message_ins` in this process's in-memory link states, on the Flower
    release it mirrors only (another release keeps its own method). Returns whether it did."""
    import flwr
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    if flwr.__version__ != VERSION:
        return False
    InMemoryLinkState.get_message_ins = get_message_ins
    return True
