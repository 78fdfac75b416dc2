"""Who may talk to whom in the device-to-device loops (settings ``topology``, ``topology-p``,
``topology-degree``): an undirected graph over the partition ids, drawn from the seed.

- ``full``: every pair of clients is linked (Erdős–Rényi with p = 1, CompFL's Figure 7);
- ``erdos-renyi``: each pair linked with probability ``topology-p`` (the paper's sparse case is
  p = 0.6), re-drawn until the graph is connected;
- ``ring``: client i linked to i - 1 and i + 1;
- ``regular``: a random ``topology-degree``-regular graph (pairing model), re-drawn until it
  is simple and connected.

A draw that must also keep some subsets of clients connected (the clients able to run an
expert, for gossip) passes them as ``keep_connected``; the graph is re-drawn until each of
them induces a connected subgraph. :func:`metropolis_weights` gives the gossip mixing weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from fedapp.config import ConfigError, RunConfig
from fedapp.seeding import derive_seed

MAX_DRAWS = 1000


@dataclass(frozen=True)
class Topology:
    """An undirected simple graph on ``0..n-1``: ``neighbours[i]`` sorted."""

    kind: str
    neighbours: tuple[tuple[int, ...], ...]

    @property
    def n(self) -> int:
        return len(self.neighbours)

    def degree(self, node: int, within: Iterable[int] | None = None) -> int:
        return len(self.neighbours_of(node, within))

    def neighbours_of(self, node: int, within: Iterable[int] | None = None) -> tuple[int, ...]:
        """The neighbours of ``node`` (only those in ``within`` when given)."""
        if within is None:
            return self.neighbours[node]
        keep = set(within)
        return tuple(j for j in self.neighbours[node] if j in keep)

    def edges(self) -> list[tuple[int, int]]:
        return [(i, j) for i in range(self.n) for j in self.neighbours[i] if i < j]

    def connected(self, within: Iterable[int] | None = None) -> bool:
        """Whether the subgraph induced by ``within`` (default: every node) is connected."""
        nodes = set(range(self.n) if within is None else within)
        if not nodes:
            return True
        start = min(nodes)
        seen, stack = {start}, [start]
        while stack:
            for j in self.neighbours_of(stack.pop(), nodes):
                if j not in seen:
                    seen.add(j)
                    stack.append(j)
        return seen == nodes

    def to_json(self) -> dict:
        return {"kind": self.kind, "nodes": self.n, "edges": [list(e) for e in self.edges()]}


def _from_edges(kind: str, n: int, edges: Iterable[tuple[int, int]]) -> Topology:
    nbrs: list[set[int]] = [set() for _ in range(n)]
    for i, j in edges:
        nbrs[i].add(j)
        nbrs[j].add(i)
    return Topology(kind, tuple(tuple(sorted(s)) for s in nbrs))


def _erdos_renyi(n: int, p: float, rng: np.random.Generator) -> Topology:
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    keep = rng.random(len(pairs)) < p
    return _from_edges("erdos-renyi", n, (e for e, k in zip(pairs, keep) if k))


def _regular(n: int, d: int, rng: np.random.Generator) -> Topology | None:
    """One draw of the pairing model; None when it made a loop or a double edge."""
    stubs = rng.permutation(np.repeat(np.arange(n), d))
    edges = {tuple(sorted((int(a), int(b)))) for a, b in stubs.reshape(-1, 2)}
    if len(edges) != n * d // 2 or any(a == b for a, b in edges):
        return None
    return _from_edges("regular", n, edges)


def draw(cfg: RunConfig, keep_connected: Iterable[Iterable[int]] = ()) -> Topology:
    """The run's graph over its ``num-clients`` partitions, from (seed, "topology")."""
    n, kind = cfg.num_clients, cfg.topology
    subsets = [sorted(s) for s in keep_connected]
    if kind == "ring":
        graph = _from_edges("ring", n, ((i, (i + 1) % n) for i in range(n) if n > 1))
        if not all(graph.connected(s) for s in subsets):
            raise ConfigError("topology = 'ring' leaves the clients of one expert unconnected "
                              "among themselves (gossip needs them connected): use 'full', "
                              "'erdos-renyi' or 'regular', or arch-assignment = 'blocks'")
        return graph
    if kind == "full":
        return _from_edges("full", n, ((i, j) for i in range(n) for j in range(i + 1, n)))
    if kind == "regular" and (cfg.topology_degree >= n or n * cfg.topology_degree % 2):
        raise ConfigError(f"setting topology-degree = {cfg.topology_degree} is invalid for "
                          f"{n} clients: a d-regular graph needs d < n and n x d even")
    rng = np.random.default_rng(derive_seed(cfg.seed, "topology"))
    for _ in range(MAX_DRAWS):
        graph = (_erdos_renyi(n, cfg.topology_p, rng) if kind == "erdos-renyi"
                 else _regular(n, cfg.topology_degree, rng))
        if graph is not None and graph.connected() and all(graph.connected(s) for s in subsets):
            return graph
    raise ConfigError(f"no connected {kind} graph on {n} clients in {MAX_DRAWS} draws (with "
                      f"topology-p = {cfg.topology_p}, topology-degree = {cfg.topology_degree}"
                      "): raise the edge probability or the degree")


def metropolis_weights(graph: Topology, node: int, within: Iterable[int] | None = None
                       ) -> dict[int, float]:
    """Gossip weights of ``node``: ``1 / (1 + max(deg_i, deg_j))`` for each neighbour j and the
    rest for itself (degrees in the subgraph induced by ``within``), a doubly stochastic
    matrix over the graph."""
    nodes = None if within is None else list(within)
    weights = {j: 1.0 / (1 + max(graph.degree(node, nodes), graph.degree(j, nodes)))
               for j in graph.neighbours_of(node, nodes)}
    weights[node] = 1.0 - sum(weights.values())
    return dict(sorted(weights.items()))
