"""The Flower ServerApp: validate the run config, prepare the results folder, build the method's
Strategy, then run the loop the config names: synchronous rounds (Flower's own driver calling
the Strategy, ``fedapp.runtime.strategy_base``), the asynchronous loop
(``fedapp.loops.asynchronous``) or a device-to-device relay (``fedapp.loops.relay``)."""

from __future__ import annotations

from logging import INFO

from flwr.app import Context
from flwr.common.logger import log
from flwr.server import Server, ServerAppComponents, ServerConfig, SimpleClientManager
from flwr.server.compat import start_grid
from flwr.serverapp import Grid, ServerApp

from fedapp.config import ConfigError, default_run_name
from fedapp.data import setup
from fedapp.loops.asynchronous import AsyncLoop
from fedapp.loops.grid_io import PromptGrid
from fedapp.loops.relay import GossipLoop, WalkLoop
from fedapp.runtime import checkpoint, linkstate
from fedapp.runtime.privacy import PrivacyBudgetSpent
from fedapp.runtime.results import Recorder
from fedapp.runtime.strategy_base import RoundFailed
from strategies import get_method, load_config, recipe_line, settings_report


def server_fn(context: Context) -> ServerAppComponents:
    cfg = load_config(context.run_config)
    settings = settings_report(context.run_config)  # every effective value and its layer
    log(INFO, "[fedapp] %s", recipe_line(settings))
    data, partition = setup.prepare(cfg)  # bad data or settings fail here, not later
    run_dir = cfg.results_root() / (cfg.run_name or default_run_name(cfg.method, cfg.dataset))
    summary = partition.summary(data.train_y.numpy(), data.test_y.numpy(), data.num_classes)
    summary["architectures"] = setup.architectures(cfg)
    for client, arch in zip(summary["clients"], summary["architectures"]):
        client["arch"] = arch
    done, method_state = 0, None
    if cfg.resume:
        try:
            done, method_state = checkpoint.load_server(run_dir / "checkpoint")
        except FileNotFoundError:
            raise ConfigError(f"resume = true, but {run_dir} holds no checkpoint (was the run "
                              "started with checkpoint-every > 0?)") from None
        if (run_dir / "summary.json").exists():
            raise ConfigError(f"the run in {run_dir} has finished (summary.json is there); "
                              "nothing to resume")
    # A "round" of the asynchronous loop is one evaluation (every async-eval-every updates).
    rounds = cfg.num_server_rounds if cfg.server_loop == "rounds" else \
        AsyncLoop.evaluations_of(cfg)
    recorder = Recorder(run_dir, method=cfg.method, dataset=cfg.dataset,
                        num_clients=cfg.num_clients, num_rounds=rounds,
                        config=settings, partition=summary, resume_after=done,
                        tensorboard=cfg.tensorboard)
    log(INFO, "[fedapp] %s on %s: %d clients, %d rounds%s; results in %s", cfg.method,
        cfg.dataset, cfg.num_clients, cfg.num_server_rounds,
        f" (resumed after round {done})" if done else "", run_dir)
    strategy = get_method(cfg.method).strategy(cfg, recorder, input_shape=data.input_shape,
                                               num_classes=data.num_classes)
    if method_state is not None:
        strategy.restore(done, method_state)
    if done >= cfg.num_server_rounds:  # killed after its last round, before its summary
        recorder.finish()
    return ServerAppComponents(strategy=strategy, config=ServerConfig(
        num_rounds=cfg.num_server_rounds - done, round_timeout=cfg.round_timeout or None))


# Threads of the synchronous driver in a deployment, at most: each one only waits for a reply.
MAX_DRIVER_THREADS = 256


def deployed_server(grid: Grid, components: ServerAppComponents) -> Server | None:
    """The Server that Flower's synchronous driver runs in a deployment; None (Flower's own) in
    a simulation. Flower sends a round's messages from a thread pool of Python's default size,
    min(32, cores + 4) — 6 on 2 cores — and each thread waits for one node's reply, so a
    deployment of more nodes than threads ran each round in waves. Here the pool has a thread
    per client (at most ``MAX_DRIVER_THREADS``). A simulation keeps Flower's pool: its virtual
    clients run only as many at once as the machine has Ray actors."""
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    if isinstance(grid, InMemoryGrid):
        return None
    strategy = components.strategy
    server = Server(client_manager=components.client_manager or SimpleClientManager(),
                    strategy=strategy)
    server.set_max_workers(max(1, min(MAX_DRIVER_THREADS, strategy.cfg.num_clients)))
    return server


# The loops that are not Flower's synchronous rounds, by their server-loop name.
LOOPS = {"async": AsyncLoop, "walk": WalkLoop, "gossip": GossipLoop}

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    # In a simulation this process also holds the link state: let it find a node's messages
    # without checking every other node's (fedapp.runtime.linkstate).
    linkstate.install()
    from fedapp.runtime.object_pulls import prompt_object_pulls
    prompt_object_pulls()
    # One ServerApp, two loops: Flower runs ``main`` whenever it exists, so the synchronous
    # path is spelled out here exactly as ServerApp(server_fn=...) would run it.
    components = server_fn(context)
    strategy = components.strategy
    strategy.node_partitions = linkstate.node_partitions(grid)
    loop = LOOPS.get(strategy.cfg.server_loop)
    try:
        if loop is not None:
            loop(grid, strategy, strategy.recorder).run()
            return
        start_grid(grid=PromptGrid(grid), server=deployed_server(grid, components),
                   config=components.config, strategy=strategy,
                   client_manager=components.client_manager)
    except PrivacyBudgetSpent as exc:
        # Not a failure: the next round would pass dp-target-epsilon, so the run ends here with
        # its summary, the rounds so far and the privacy they spent (fedapp.runtime.privacy).
        log(INFO, "[fedapp] privacy budget: %s", exc)
        if strategy.recorder is not None:
            strategy.recorder.finish({"stopped": {"kind": "privacy-budget", "reason": str(exc)}})
    except RoundFailed as exc:
        # Flower records only that the run failed: the results folder says why.
        if strategy.recorder is not None:
            strategy.recorder.record_failure(exc.kind, str(exc))
        raise
