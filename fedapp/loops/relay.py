"""Device-to-device training through the SuperLink (``server-loop = "walk"`` or ``"gossip"``).

Flower has nothing peer-to-peer: SuperNodes talk only to the SuperLink. In these loops the
ServerApp is a relay and a scheduler and nothing else: it never averages, never trains and
never changes a model. What a client replies goes, byte for byte, to the next client(s) that
the topology (``fedapp.loops.topology``) and the seed choose; all the maths runs on the clients.
CompFL's Appendix E (Hong et al.) gives the two modes:

- **walk** (D/D, device by device): one walker per expert architecture, all walking at once.
  A walker starts at a client drawn from the seed; each client that holds it trains it with
  the method's local step and the relay forwards the reply to a neighbour drawn from
  (seed, expert, hop). A holder that cannot run the expert, or that draws a forward
  (``walk-forward``), passes it on untrained: the relay makes that hop on its behalf (the
  bytes are counted on both edges; the model is not sent to the node and back). A node holds
  one message at a time; walkers that reach a busy node queue there. The update budget
  (``async-updates``) is split evenly over the walkers.
- **gossip** (M/M, model by model): experts trained one after another, largest first, each
  by the clients able to run it. A phase is a number of synchronous gossip rounds (the budget
  spread evenly over the phases' updates): in round r every such client is sent its own and
  its neighbours' models of round r - 1 (neighbours within the phase's clients) with their
  Metropolis weights, mixes them, trains, and replies with its model.

Everything else is the asynchronous loop's (``fedapp.loops.asynchronous``): one message in
flight per node, the virtual or arrival clock, retries and drops, evaluation of every client every
``async-eval-every`` updates, ``updates.jsonl``, the timeline. Every reply still goes through
the strategy's one validation path (``FedStrategy.accept_upload``) before it travels on: the
relay reads what it forwards, it does not change it. A rejected reply is not passed on; the
walker goes on from the model its holder received.

Traffic: besides the relay's own bytes (each model goes up to the SuperLink and down again),
``edges.json`` holds the bytes that would cross each edge ``src -> dst`` if the clients talked
directly, and the topology; ``summary.json`` adds the totals.
"""

from __future__ import annotations

import json
import math
from collections import deque
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common import FitIns, FitRes, Parameters
from flwr.common.logger import log

from fedapp.loops.asynchronous import AsyncLoop, Work
from fedapp.loops.topology import Topology, draw, metropolis_weights
from fedapp.runtime.payload import wire_size
from fedapp.runtime.strategy_base import Encoder, RoundFailed, Upload
from fedapp.seeding import derive_seed

MAX_FORWARDS = 100_000  # hops of one walker without finding a holder that trains it


def concatenate(parts: list[Parameters]) -> Parameters:
    """Several encoded payloads in one message, their tensors one after another (the client
    splits them by the counts it is given): the relay never opens them."""
    return Parameters(tensors=[t for p in parts for t in p.tensors],
                      tensor_type=parts[0].tensor_type)


class RelayLoop(AsyncLoop):
    """What both device-to-device loops share: the experts, who can run which, the topology,
    per-edge bytes. The strategy provides ``experts()`` (smallest first), ``can_run(arch,
    expert)`` and ``initial_model(expert)`` (a payload)."""

    def __init__(self, grid, strategy, recorder) -> None:
        super().__init__(grid, strategy, recorder)
        self.experts: tuple[str, ...] = strategy.experts()
        arch = strategy.architectures
        self.capable = {e: [p for p in range(self.cfg.num_clients) if strategy.can_run(arch[p], e)]
                        for e in self.experts}
        self.graph: Topology = draw(self.cfg, self.keep_connected())
        self.edge_bytes: dict[tuple[int, int], int] = {}
        self.queue: dict[int, deque[Work]] = {}   # pid -> work waiting for the node

    def keep_connected(self) -> list[list[int]]:
        return []

    def _start(self) -> None:
        (self.recorder.run_dir / "topology.json").write_text(json.dumps(self.graph.to_json()))
        self.recorder.num_rounds = self.recorder.meta["rounds"] = self.num_evaluations
        log(INFO, "[fedapp] %s loop over a %s topology (%d edges), %d updates, evaluation "
            "every %d, %s clock: the server relays, it never averages", self.cfg.server_loop,
            self.graph.kind, len(self.graph.edges()), self.budget, self.eval_every,
            self.cfg.clock)

    def _progress(self) -> int:
        """The synchronous round this point of the run corresponds to (for warm-ups)."""
        return self.committed // self.cfg.num_clients + 1

    def _send(self, src: int, dst: int, params: Parameters) -> None:
        """Count a model moving along the edge src -> dst."""
        self.edge_bytes[src, dst] = self.edge_bytes.get((src, dst), 0) + wire_size(params).total

    def _enqueue(self, work: Work) -> None:
        """Work for a node: it starts when the node is free (virtual time included)."""
        self.queue.setdefault(work.pid, deque()).append(work)

    def _plan(self) -> None:
        for pid, waiting in self.queue.items():
            if waiting and pid not in self.training and pid in self.proxies:
                work = waiting.popleft()
                self._new_work(pid, work.ins.parameters, work.down, dict(work.ins.config),
                               start=max(self.now, work.virtual_start), meta=work.meta)

    def _item(self, pid: int, params: Parameters, config: dict[str, Any],
              meta: dict[str, Any]) -> Work:
        """A queued piece of work (update number and durations are given when it starts)."""
        return Work(pid, 0, self.committed, self.now, self.now, FitIns(params, config),
                    wire_size(params), meta=meta)

    def _retry(self, work: Work) -> None:
        # The same message again, first in the node's queue.
        self.queue.setdefault(work.pid, deque()).appendleft(
            self._item(work.pid, work.ins.parameters, _own_config(work), work.meta))

    def _describe(self, work: Work) -> dict[str, Any]:
        return {k: v for k, v in work.meta.items() if k in ("expert", "source", "phase",
                                                            "gossip_round")}

    def _summary_extra(self) -> dict[str, Any]:
        edges = {f"{s}->{d}": b for (s, d), b in sorted(self.edge_bytes.items())}
        (self.recorder.run_dir / "edges.json").write_text(json.dumps(
            {"topology": self.graph.to_json(), "bytes": edges}, indent=1))
        return {"peer_traffic": {
            "topology": self.graph.kind, "edges": len(self.graph.edges()),
            "total_bytes": sum(edges.values()), "edges_used": len(edges),
            "max_edge_bytes": max(edges.values(), default=0),
            "per_client_sent": {str(p): sum(b for (s, _), b in self.edge_bytes.items() if s == p)
                                for p in range(self.cfg.num_clients)}}}


def _own_config(work: Work) -> dict[str, Any]:
    """The relay's keys of a message config (the loop adds the round keys when it starts)."""
    return {k: v for k, v in work.ins.config.items() if k in RELAY_KEYS}


RELAY_KEYS = ("visit", "expert", "mix-sizes", "mix-weights", "progress-round")


class WalkLoop(RelayLoop):
    """``server-loop = "walk"``: one model per expert walks over the clients (module doc)."""

    def __init__(self, grid, strategy, recorder) -> None:
        super().__init__(grid, strategy, recorder)
        share, extra = divmod(self.budget, len(self.experts))
        # Larger experts first get the remainder: they have fewer clients to train them.
        self.walk_budget = {e: share + (i < extra) for i, e in enumerate(reversed(self.experts))}
        self.trained = {e: 0 for e in self.experts}
        self.hops = {e: 0 for e in self.experts}

    def _start(self) -> None:
        super()._start()
        for expert in self.experts:
            if not self.capable[expert]:
                raise RoundFailed(f"no client can run expert {expert!r}")
            if self.walk_budget[expert] == 0:
                continue
            rng = np.random.default_rng(derive_seed(self.cfg.seed, "walk-start", expert))
            start = int(rng.choice(self.capable[expert]))
            params, _ = Encoder()(self.strategy.initial_model(expert))
            self._arrive(expert, start, None, params)

    def _arrive(self, expert: str, pid: int, source: int | None, params: Parameters) -> None:
        """The walker of ``expert`` reaches ``pid`` (from ``source``): train there, or pass it
        on until a holder that trains it."""
        for _ in range(MAX_FORWARDS):
            if source is not None:
                self._send(source, pid, params)
            if pid in self.proxies and self._trains(expert, pid):
                self._enqueue(self._item(pid, params, {
                    "visit": "walk", "expert": expert, "progress-round": self._progress()},
                    {"expert": expert, "source": source, "hop": self.hops[expert]}))
                return
            source, pid = pid, self._next(expert, pid)
        raise RoundFailed(f"the walker of {expert!r} found no client to train it in "
                          f"{MAX_FORWARDS} hops")

    def _trains(self, expert: str, pid: int) -> bool:
        """Whether the holder trains the walker: it can run it and does not draw a forward."""
        if pid not in self.capable[expert]:
            return False
        if self.cfg.walk_forward == 0:
            return True
        rng = np.random.default_rng(derive_seed(self.cfg.seed, "walk-forward", expert,
                                                self.hops[expert]))
        return rng.random() >= self.cfg.walk_forward

    def _next(self, expert: str, pid: int) -> int:
        """A neighbour of ``pid`` still in the run, drawn from (seed, expert, hop)."""
        self.hops[expert] += 1
        alive = self.graph.neighbours_of(pid, self.proxies)
        if not alive:
            raise RoundFailed(f"client {pid} holds the walker of {expert!r} and has no "
                              "neighbour left in the run")
        rng = np.random.default_rng(derive_seed(self.cfg.seed, "walk", expert, self.hops[expert]))
        return int(alive[rng.integers(len(alive))])

    def _fold(self, work: Work, upload: Upload, res: FitRes) -> None:
        self._trained(work, res.parameters)  # the reply, untouched

    def _lost(self, work: Work, committed: bool) -> None:
        if committed:
            self._trained(work, work.ins.parameters)  # rejected: what the holder was given
        else:
            self._pass_on(work)

    def _trained(self, work: Work, params: Parameters) -> None:
        expert = work.meta["expert"]
        self.trained[expert] += 1
        if self.trained[expert] < self.walk_budget[expert]:
            self._arrive(expert, self._next(expert, work.pid), work.pid, params)

    def _pass_on(self, work: Work) -> None:
        """A walker whose holder left the run goes on, untrained, from what it was given."""
        self._arrive(work.meta["expert"], self._next(work.meta["expert"], work.pid), work.pid,
                     work.ins.parameters)

    def _drop(self, pid: int) -> None:
        super()._drop(pid)
        for work in self.queue.pop(pid, ()):
            self._pass_on(work)


class GossipLoop(RelayLoop):
    """``server-loop = "gossip"``: experts one after another, largest first (module doc)."""

    def __init__(self, grid, strategy, recorder) -> None:
        super().__init__(grid, strategy, recorder)
        self.phases = [e for e in reversed(self.experts) if self.capable[e]]
        per_round = sum(len(self.capable[e]) for e in self.phases)
        self.rounds_per_phase = max(1, round(self.budget / per_round))
        self.budget = self.rounds_per_phase * per_round
        self.num_evaluations = math.ceil(self.budget / self.eval_every)
        self.phase, self.gossip_round = -1, 0
        self.mailbox: dict[int, Parameters] = {}   # pid -> its latest model of this phase
        self.pending = 0                             # this gossip round's updates still out

    def keep_connected(self) -> list[list[int]]:
        return [self.capable[e] for e in self.experts]

    def _start(self) -> None:
        super()._start()
        self._next_round()

    def _next_round(self) -> None:
        """Send every client of the phase its neighbours' models of the last round."""
        if self.phase < 0 or self.gossip_round == self.rounds_per_phase:
            self.phase += 1
            self.gossip_round = 0
            if self.phase == len(self.phases):
                return
            expert = self.phases[self.phase]
            params, _ = Encoder()(self.strategy.initial_model(expert))
            self.mailbox = {p: params for p in self.capable[expert]}
            log(INFO, "[fedapp] gossip: expert %s, %d rounds on %d clients", expert,
                self.rounds_per_phase, len(self.capable[expert]))
        self.gossip_round += 1
        expert = self.phases[self.phase]
        members = [p for p in self.capable[expert] if p in self.proxies]
        for pid in members:
            weights = metropolis_weights(self.graph, pid, members)
            parts = [self.mailbox[j] for j in weights]
            for j in weights:
                if j != pid:
                    self._send(j, pid, self.mailbox[j])
            self._enqueue(self._item(pid, concatenate(parts), {
                "visit": "gossip", "expert": expert,
                "mix-sizes": ",".join(str(len(p.tensors)) for p in parts),
                "mix-weights": ",".join(repr(w) for w in weights.values()),
                "progress-round": self._progress()},
                {"expert": expert, "phase": self.phase + 1, "gossip_round": self.gossip_round}))
        self.pending = len(members)

    def _fold(self, work: Work, upload: Upload, res: FitRes) -> None:
        self.mailbox[work.pid] = res.parameters  # the reply, untouched
        self._settled()

    def _lost(self, work: Work, committed: bool) -> None:
        self._settled()  # its last model stays in the mailbox

    def _settled(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self._next_round()

    def _drop(self, pid: int) -> None:
        # Its remaining updates of the run are not made (this round's included: it failed),
        # so the budget shrinks by them.
        left = (self.rounds_per_phase - self.gossip_round + 1) * (
            pid in self.capable[self.phases[self.phase]])
        left += self.rounds_per_phase * sum(pid in self.capable[e]
                                            for e in self.phases[self.phase + 1:])
        self.budget -= left
        self.queue.pop(pid, None)
        super()._drop(pid)
        log(WARNING, "client %d left the gossip; the run now ends after %d updates", pid,
            self.budget)
