"""The asynchronous server loop (``server-loop = "async"``): no round barrier.

FedHe (Chan & Ngai, MSN 2021, Sec. III) lets every client loop on its own: fetch the server's
current knowledge, train, upload; the server folds each upload in the moment it arrives. Here:

- at most ``async-concurrency`` clients hold work at once; when an upload is folded in (the
  *commit*), the longest-idle client (with every client busy: the one that just uploaded) gets
  new work with the server's knowledge **as of that commit**;
- ``async-updates`` updates in all (default ``num-server-rounds x num-clients``, so that a
  "round" means num-clients updates); every ``async-eval-every`` commits an evaluation is called:
  each client is evaluated as soon as it holds no training work (a busy one after its current
  update), without stopping the others; the end of the run is always evaluated;
- one message in flight per node; a failed or timed-out update (``async-ttl``) is retried
  ``async-retries`` times, then the client is dropped, each with a logged reason;
- uploads go through the strategy's one validation path (:meth:`FedStrategy.accept_upload`) and
  the method's own server maths (:meth:`FedStrategy.aggregate` with one upload): nothing of a
  method is written twice.

Two clocks (``clock``): *virtual* commits uploads in the order of their virtual finish times
(``fedapp.runtime.speeds``), buffering replies that arrive early, so one seed gives one commit
order and bit-identical results; *arrival* commits them as they come, as a deployment does.

What is recorded: ``updates.jsonl`` (per update: client, its update number, virtual and wall
times, staleness = commits between its download and its upload, bytes both ways, status),
``rounds.jsonl`` (per evaluation: the usual accuracy block, the window's traffic and counts),
``summary.json`` (plus ``updates`` and ``staleness``) and ``timeline.png``.

The device-to-device loops (``fedapp.loops.relay``) are subclasses: they keep all of this and
change only who gets work next (``_plan``) and what a commit does (``_fold``, ``_lost``,
``_retry``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common import EvaluateIns, FitIns, FitRes
from flwr.common.logger import log
from flwr.server.client_proxy import ClientProxy
from flwr.serverapp import Grid

from fedapp.config import RunConfig
from fedapp.loops import grid_io
from fedapp.runtime.payload import PayloadError, WireSize, wire_size
from fedapp.runtime.results import Recorder, format_accuracy, plot_timeline, round_record
from fedapp.runtime.speeds import update_duration
from fedapp.runtime.strategy_base import (Encoder, FedStrategy, RoundFailed, Upload,
                                         finite_number, training_devices)


LOOP_NAMES = {"async": "asynchronous", "walk": "walk (D/D)", "gossip": "gossip (M/M)"}


@dataclass
class Work:
    """One update handed to a client: decided at a commit, sent when the node is free."""

    pid: int
    update: int               # the client's own update number, from 1: its 'server-round'
    committed_before: int     # commits when the knowledge was taken (for staleness)
    virtual_start: float
    virtual_end: float
    ins: FitIns
    down: WireSize
    wall_start: float = 0.0
    message_id: str | None = None  # None while held behind the node's evaluation
    meta: dict[str, Any] = field(default_factory=dict)  # what a relay loop needs of it


@dataclass
class Evaluation:
    """An evaluation called after ``updates`` commits: who still owes it, what came back, and
    the counters of the window of updates that led to it."""

    index: int
    updates: int
    virtual_time: float
    owed: set[int]
    window: dict[str, Any]
    results: dict[int, dict[str, Any]] = field(default_factory=dict)


def _new_window() -> dict[str, Any]:
    return {"bytes_up": 0, "bytes_down": 0, "framing_up": 0, "framing_down": 0,
            "eval_bytes_down": 0, "clients_fit": 0, "failures": 0, "rejected": 0,
            "clients_sampled": 0, "failed_clients": [], "rejected_clients": [], "losses": [],
            "client_seconds": 0.0}


class AsyncLoop:
    """Drives one asynchronous run over a Flower ``Grid`` (see the module docstring)."""

    def __init__(self, grid: Grid, strategy: FedStrategy, recorder: Recorder) -> None:
        self.grid, self.strategy, self.recorder = grid, strategy, recorder
        cfg: RunConfig = strategy.cfg
        self.cfg = cfg
        self.budget = cfg.async_updates or cfg.num_server_rounds * cfg.num_clients
        self.eval_every = cfg.async_eval_every or cfg.num_clients
        self.num_evaluations = self.evaluations_of(cfg)
        self.proxies: dict[int, ClientProxy] = {}
        self.idle: deque[int] = deque()
        self.training: dict[int, Work] = {}        # pid -> its update in progress (or held)
        self.evaluating: dict[int, str] = {}      # pid -> evaluate message id
        self.arrived: dict[int, Any] = {}          # pid -> training reply not yet committed
        self.updates_done: dict[int, int] = {}     # pid -> updates sent so far
        self.fails: dict[int, int] = {}            # pid -> consecutive failed updates
        self.evaluations: list[Evaluation] = []
        self.recorded = 0
        self.committed = 0
        self.now = 0.0                             # virtual time of the last commit
        self.window = _new_window()
        self.window_started = time.time()
        self.last_virtual = 0.0
        self.updates: list[dict[str, Any]] = []    # for the timeline and the summary

    @staticmethod
    def evaluations_of(cfg: RunConfig) -> int:
        """How many evaluations (the asynchronous loop's "rounds") a run records."""
        budget = cfg.async_updates or cfg.num_server_rounds * cfg.num_clients
        return math.ceil(budget / (cfg.async_eval_every or cfg.num_clients))

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        for proxy in self.strategy.list_clients(grid_io.GridClientManager(self.grid)):
            pid = self.strategy.clients[proxy.cid].partition_id
            self.proxies[pid] = proxy
            self.idle.append(pid)
            self.updates_done[pid] = 0
        self._start()
        self._hand_out()
        while self.recorded < self.num_evaluations:
            # A reply that came early waits in ``arrived``: never pull its id again.
            in_flight = {w.message_id: ("train", pid) for pid, w in self.training.items()
                         if w.message_id is not None and pid not in self.arrived}
            in_flight.update({mid: ("evaluate", pid) for pid, mid in self.evaluating.items()})
            if not in_flight:
                raise RoundFailed("the asynchronous loop has nothing in flight and "
                                  f"{self.num_evaluations - self.recorded} evaluations to go; "
                                  "every client was dropped (see the warnings above)")
            replies = grid_io.pull(self.grid, list(in_flight))
            if not replies:
                time.sleep(0.02)
                continue
            # Within one pull, in partition order: arrival order inside a batch is noise.
            for mid, reply in sorted(replies.items(), key=lambda kv: in_flight[kv[0]][1]):
                kind, pid = in_flight[mid]
                if kind == "evaluate":
                    self._take_evaluation(pid, reply)
                else:
                    self.arrived[pid] = reply
            self._commit_ready()
        return self._finish()

    def _start(self) -> None:
        """Before the first message, with every client known."""
        log(INFO, "[fedapp] asynchronous loop: %d updates, at most %d clients at once, "
            "evaluation every %d updates, %s clock", self.budget, self._concurrency(),
            self.eval_every, self.cfg.clock)

    def _concurrency(self) -> int:
        return min(self.cfg.async_concurrency or len(self.proxies), len(self.proxies))

    def _commit_ready(self) -> None:
        """Commit what may be committed now: with the virtual clock, the update that finishes
        first in virtual time, as long as its reply is here; with arrival, every reply."""
        while self.training:
            if self.cfg.clock == "virtual":
                work = min(self.training.values(), key=lambda w: (w.virtual_end, w.pid))
                if work.pid not in self.arrived:
                    return
            else:
                ready = sorted(p for p in self.arrived if p in self.training)
                if not ready:
                    return
                work = self.training[ready[0]]
            self._commit(work, self.arrived.pop(work.pid))
            self._hand_out()

    # -- one update ------------------------------------------------------------------------------
    def _plan(self) -> None:
        """Give work to idle clients (up to the concurrency and the budget), with the server's
        knowledge as of now. (The device-to-device loops, ``fedapp.loops.relay``, plan
        otherwise.)"""
        while (self.idle and len(self.training) < self._concurrency()
               and self.committed + len(self.training) < self.budget):
            pid = self.idle.popleft()
            payload = self.strategy.fit_payload(self.updates_done[pid] + 1,
                                                self.strategy.clients[self.proxies[pid].cid])
            params, size = Encoder()(payload)
            self._new_work(pid, params, size, {})

    def _new_work(self, pid: int, params: Any, size: WireSize, config: dict[str, Any],
                  start: float | None = None, meta: dict[str, Any] | None = None) -> Work:
        """Update number ``n + 1`` of ``pid``: ``params`` and the message config (plus
        ``config``), starting at virtual time ``start`` (default: now)."""
        self.updates_done[pid] += 1
        update = self.updates_done[pid]
        ins = FitIns(params, {**self.strategy.message_config(update), **config})
        start = self.now if start is None else start
        work = Work(pid, update, self.committed, start,
                    start + update_duration(self.cfg, pid, update), ins, size, meta=meta or {})
        self.training[pid] = work
        return work

    def _hand_out(self) -> None:
        """Plan new work, then send it; evaluate first the clients that owe an evaluation."""
        self._plan()
        for pid in sorted(self.proxies):
            if pid in self.evaluating:
                continue
            work = self.training.get(pid)
            if work is not None and work.message_id is not None:
                continue  # busy: evaluated after this update
            if self._owes(pid):
                self._send_evaluate(pid)
            elif work is not None:
                self._send_train(work)

    def _send_train(self, work: Work) -> None:
        work.wall_start = time.time()
        work.message_id = grid_io.push(self.grid, self.proxies[work.pid], work.ins,
                                       self.cfg.async_ttl, f"update-{work.update}")

    def _commit(self, work: Work, reply: Any) -> None:
        pid, proxy = work.pid, self.proxies[work.pid]
        del self.training[pid]
        wall_end = time.time()
        self.now = max(self.now, work.virtual_end)
        # Traffic is counted in the window in which the update ends, download included, so
        # that per-client figures divide by the same clients as in synchronous rounds.
        self.window["bytes_down"] += work.down.data
        self.window["framing_down"] += work.down.framing
        self.window["clients_sampled"] += 1
        status, reason, up, res = "ok", "", 0, None
        trained_on: dict[str, Any] = {}  # where an accepted update trained (its device, memory)
        try:
            res = grid_io.fit_result(reply)
            size = wire_size(res.parameters)
            up = size.total
            self.window["bytes_up"] += size.data
            self.window["framing_up"] += size.framing
            upload = self.strategy.accept_upload(proxy, res, seen=set())
        except grid_io.ClientFailed as exc:
            status, reason = "failed", str(exc)
        except PayloadError as exc:
            status, reason = "rejected", str(exc)
        if status == "failed":
            self.window["failures"] += 1
            self.window["failed_clients"].append(pid)
            self.fails[pid] = self.fails.get(pid, 0) + 1
            if self.fails[pid] > self.cfg.async_retries:
                log(WARNING, "client %d failed %d times in a row and is dropped: %s", pid,
                    self.fails[pid], reason)
                self._drop(pid)
                self._lost(work, committed=False)
            else:
                log(WARNING, "client %d's update %d failed (%s); it gets new work", pid,
                    work.update, reason)
                self._retry(work)
        else:
            self.committed += 1
            self.fails[pid] = 0
            if status == "rejected":
                self.window["rejected"] += 1
                self.window["rejected_clients"].append(pid)
                log(WARNING, "update %d: rejected the upload of client %d: %s", self.committed,
                    pid, reason)
                self._lost(work, committed=True)
            else:
                self._fold(work, upload, res)
                trained_on = {"device" if key == "devices" else key: values[str(pid)]
                              for key, values in training_devices([upload]).items()
                              if str(pid) in values}
                self.window["clients_fit"] += 1
                if (loss := finite_number(upload.metrics.get("train-loss"), low=0.0)) is not None:
                    self.window["losses"].append(loss)
                self.window["client_seconds"] += finite_number(
                    upload.metrics.get("train-seconds", 0.0), low=0.0) or 0.0
        record = {"update": self.committed if status != "failed" else None, "client": pid,
                  "client_update": work.update, "status": status,
                  "staleness": self.committed - 1 - work.committed_before
                  if status != "failed" else None,
                  "virtual_start": work.virtual_start, "virtual_end": work.virtual_end,
                  "wall_start": work.wall_start - self.recorder.started,
                  "wall_end": wall_end - self.recorder.started,
                  "bytes_down": work.down.total, "bytes_up": up, **trained_on,
                  **self._describe(work)}
        if reason:
            record["reason"] = reason
        self.updates.append(record)
        self.recorder.record_update(record)
        # Every eval_every commits and at the end of the budget (which a gossip drop can
        # reach with a failed update), once per commit count.
        due = (status != "failed" and self.committed % self.eval_every == 0) \
            or self.committed >= self.budget
        if due and (not self.evaluations or self.evaluations[-1].updates != self.committed):
            self._call_evaluation()

    # What a commit means: the asynchronous loop folds the upload into the method's server
    # state; the device-to-device loops (``fedapp.loops.relay``) pass the model on instead.
    def _fold(self, work: Work, upload: Upload, res: FitRes) -> None:
        """An accepted upload: the method's own server maths, with one upload."""
        self.strategy.aggregate(self.committed, [upload])
        self.idle.append(work.pid)

    def _lost(self, work: Work, committed: bool) -> None:
        """An update that came to nothing: rejected (``committed``: it counts in the budget),
        or failed and its client dropped."""
        if work.pid in self.proxies:
            self.idle.append(work.pid)

    def _retry(self, work: Work) -> None:
        """A failed update whose client is kept: it is sent new work first."""
        self.idle.appendleft(work.pid)

    def _describe(self, work: Work) -> dict[str, Any]:
        """What a loop adds to an update's line in ``updates.jsonl``."""
        return {}

    def _summary_extra(self) -> dict[str, Any]:
        """What a loop adds to ``summary.json``."""
        return {}

    def _drop(self, pid: int) -> None:
        self.proxies.pop(pid)
        for evaluation in self.evaluations:
            evaluation.owed.discard(pid)
        self._record_ready()

    # -- evaluation ------------------------------------------------------------------------------
    def _call_evaluation(self) -> None:
        window, self.window = self.window, _new_window()
        window["seconds"] = time.time() - self.window_started
        window["virtual_seconds"] = self.now - self.last_virtual
        self.window_started, self.last_virtual = time.time(), self.now
        self.evaluations.append(Evaluation(len(self.evaluations) + 1, self.committed, self.now,
                                           set(self.proxies), window))
        if self.committed >= self.budget:  # the last (a relay's budget shrinks with drops)
            self.num_evaluations = len(self.evaluations)

    def _owes(self, pid: int) -> bool:
        return any(pid in e.owed for e in self.evaluations[self.recorded:])

    def _send_evaluate(self, pid: int) -> None:
        client = self.strategy.clients[self.proxies[pid].cid]
        params, size = Encoder()(self.strategy.eval_payload(self.committed, client))
        self.window["eval_bytes_down"] += size.total
        ins = EvaluateIns(params, self.strategy.message_config(self.updates_done[pid]))
        self.evaluating[pid] = grid_io.push(self.grid, self.proxies[pid], ins,
                                            self.cfg.async_ttl, f"evaluate-{self.committed}")

    def _take_evaluation(self, pid: int, reply: Any) -> None:
        del self.evaluating[pid]
        metrics = None
        try:
            metrics = self.strategy.accept_evaluation(self.proxies[pid],
                                                      grid_io.evaluate_result(reply))
        except (grid_io.ClientFailed, PayloadError) as exc:
            log(WARNING, "ignored the evaluation of client %d: %s", pid, exc)
        for evaluation in self.evaluations[self.recorded:]:
            if pid in evaluation.owed:
                evaluation.owed.discard(pid)
                if metrics is not None:
                    evaluation.results[pid] = metrics
        self._record_ready()
        self._hand_out()  # its held update, if any

    def _record_ready(self) -> None:
        while self.recorded < len(self.evaluations) and not self.evaluations[self.recorded].owed:
            e = self.evaluations[self.recorded]
            w = e.window
            evals = [e.results[p] for p in sorted(e.results)]
            traffic = {k: w[k] for k in ("bytes_up", "bytes_down", "framing_up", "framing_down",
                                         "eval_bytes_down")}
            counts = {k: w[k] for k in ("clients_fit", "failures", "rejected", "clients_sampled",
                                        "failed_clients", "rejected_clients")}
            counts.update(evaluated=sorted(e.results), updates=e.updates,
                          virtual_time=e.virtual_time, virtual_seconds=w["virtual_seconds"],
                          train_loss=float(np.mean(w["losses"])) if w["losses"] else None,
                          **self.strategy.attack_record(evals))
            client_seconds = w["client_seconds"] + sum(
                finite_number(r.get("eval-seconds", 0.0), low=0.0) or 0.0 for r in evals)
            record = round_record(e.index, evals, traffic, counts, w["seconds"], client_seconds)
            log(INFO, self.recorder.record_round(record) + f" | {e.updates} updates")
            self.recorded += 1

    # -- the end ---------------------------------------------------------------------------------
    def _finish(self) -> dict[str, Any]:
        ok = [u for u in self.updates if u["status"] != "failed"]
        staleness = [u["staleness"] for u in ok]
        per_client: dict[str, int] = {}
        for u in self.updates:
            if u["status"] == "ok":
                per_client[str(u["client"])] = per_client.get(str(u["client"]), 0) + 1
        extra = {
            "loop": self.cfg.server_loop, "clock": self.cfg.clock,
            # Under the arrival clock commits follow real time, so no virtual time is kept.
            "virtual_seconds": self.now if self.cfg.clock == "virtual" else None,
            "updates": {"committed": self.committed, "budget": self.budget,
                        "per_client": dict(sorted(per_client.items(), key=lambda kv: int(kv[0]))),
                        "failed": sum(u["status"] == "failed" for u in self.updates),
                        "rejected": sum(u["status"] == "rejected" for u in self.updates)},
            "staleness": {"mean": float(np.mean(staleness)) if staleness else 0.0,
                          "median": float(np.median(staleness)) if staleness else 0.0,
                          "max": int(max(staleness, default=0))},
        }
        summary = self.recorder.finish({**extra, **self._summary_extra()})
        plot_timeline(self.updates, [e.virtual_time for e in self.evaluations],
                      self.recorder.run_dir / "timeline.png",
                      f"{self.cfg.method}, {LOOP_NAMES[self.cfg.server_loop]}, {self.cfg.clock} clock")
        acc = summary["accuracy"]
        log(INFO, "[fedapp] done: accuracy %s over %d clients after %d updates; results in %s",
            format_accuracy(acc["mean"], acc["std"]), len(acc["per_client"]), self.committed,
            self.recorder.run_dir)
        return summary
