"""How much does the framework cost? The same local work three ways, timed.

Work: 10 clients on Fashion-MNIST (the CNN-1..5 mix, round-robin), each round every client
trains 1 epoch (batch 64, SGD) on its own shard and evaluates on its own test split; R rounds.

1. bare:    a hand-written PyTorch loop over the clients (models kept in a dict).
2. runtime: the project's client runtime in-process (``FedClient.fit``/``evaluate`` with a real
            Flower ``Context``: model rebuilt and restored from ``context.state`` every message,
            exactly as under Flower), method ``standalone``.
3. flwr:    ``fedapp run`` (a full ``flwr run`` simulation with Ray virtual clients), method
            ``standalone``; reported both end to end (SuperLink start to stop) and as the
            ServerApp's own ``wall_seconds``.

Threads: the bare and in-process loops use torch's threads on every core; the Flower run gets
``client-num-cpus`` equal to the core count, so one virtual client trains at a time with the
same threads, and the comparison measures the framework, not a different parallelism.

    .venv/bin/python benchmarks/runtime_overhead.py [--rounds 20] [--samples-per-client 0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flwr.app import Context, RecordDict  # noqa: E402

from fedapp.data import setup  # noqa: E402
from fedapp.data.partitions import load_client_data  # noqa: E402
from strategies import METHODS, load_config  # noqa: E402


def settings(args: argparse.Namespace) -> dict:
    return {"method": "standalone", "dataset": "fmnist", "num-clients": 10,
            "num-server-rounds": args.rounds, "arch-mix": "cnn1,cnn2,cnn3,cnn4,cnn5",
            "partition": "iid", "max-samples-per-client": args.samples_per_client,
            "local-epochs": 1, "batch-size": 64, "optimizer": "sgd", "lr": 0.01,
            "momentum": 0.9, "client-num-cpus": os.cpu_count() or 1}


def bare(cfg) -> Iterator[float]:
    """The reference: the plainest loop that does the same training and evaluation.

    Yields the seconds of each round (set-up is not timed)."""
    data = setup.dataset(cfg)
    shards = [load_client_data(data, setup.partition_spec(cfg), k)
              for k in range(cfg.num_clients)]
    models = [setup.new_model(cfg, arch, data.input_shape, data.num_classes, k)
              for k, arch in enumerate(setup.architectures(cfg))]
    for _ in range(cfg.num_server_rounds):
        start = time.perf_counter()
        for model, shard in zip(models, shards):
            opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
            model.train()
            order = torch.randperm(len(shard.train_y))
            for i in range(0, len(order), cfg.batch_size):
                idx = order[i:i + cfg.batch_size]
                loss = F.cross_entropy(model(shard.train_x[idx]), shard.train_y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
            model.eval()
            with torch.no_grad():
                for i in range(0, len(shard.test_y), 512):
                    model(shard.test_x[i:i + 512]).argmax(1)
        yield time.perf_counter() - start


def runtime(cfg) -> Iterator[float]:
    """The client runtime without Flower's transport: fit + evaluate per client per round.

    Yields the seconds of each round (set-up is not timed)."""
    client_cls = METHODS[cfg.method].client
    run_config = {k.replace("_", "-"): v for k, v in cfg.to_flat().items()}
    contexts = [Context(run_id=1, node_id=k, node_config={"partition-id": k,
                                                          "num-partitions": cfg.num_clients},
                        state=RecordDict(), run_config=run_config)
                for k in range(cfg.num_clients)]
    for ctx in contexts:  # load data and warm caches outside the timing, as `bare` does
        client_cls(ctx, cfg)
    for rnd in range(1, cfg.num_server_rounds + 1):
        start = time.perf_counter()
        for ctx in contexts:
            client_cls(ctx, cfg).fit([], {"server-round": rnd})
            client_cls(ctx, cfg).evaluate([], {"server-round": rnd})
        yield time.perf_counter() - start


def full_run(args: argparse.Namespace) -> tuple[float, float]:
    """(end-to-end seconds of `fedapp run`, the ServerApp's own wall_seconds)."""
    out = Path(tempfile.mkdtemp(prefix="fedapp-bench-"))
    sets = [f"--set={k}={json.dumps(v) if isinstance(v, str) else v}"
            for k, v in settings(args).items()]
    start = time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "fedapp"), "run", *sets,
                    "--set", 'run-name="bench"', "--output-dir", str(out)], check=True)
    end_to_end = time.perf_counter() - start
    summary = json.loads((out / "bench" / "summary.json").read_text())
    return end_to_end, summary["wall_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--samples-per-client", type=int, default=0,
                        help="cap per client (0 = the client's whole IID shard, 6000)")
    parser.add_argument("--skip-flwr", action="store_true")
    args = parser.parse_args()
    cfg = load_config(settings(args))
    torch.set_num_threads(os.cpu_count() or 1)
    # The two in-process loops run round by round in alternation, so both see the same
    # machine (warm caches, noisy neighbours) and neither profits from going second.
    t_bare = t_runtime = 0.0
    for b, r in zip(bare(cfg), runtime(cfg)):
        t_bare, t_runtime = t_bare + b, t_runtime + r
    print(f"bare PyTorch loop      {t_bare:8.1f} s   1.00x")
    print(f"client runtime         {t_runtime:8.1f} s   {t_runtime / t_bare:.2f}x")
    if not args.skip_flwr:
        t_e2e, t_server = full_run(args)
        print(f"flwr run (ServerApp)   {t_server:8.1f} s   {t_server / t_bare:.2f}x")
        print(f"flwr run (end to end)  {t_e2e:8.1f} s   {t_e2e / t_bare:.2f}x")
    cap = args.samples_per_client or "all"
    print(f"work: {cfg.num_clients} clients x {cfg.num_server_rounds} rounds x 1 epoch, "
          f"samples per client: {cap}, batch {cfg.batch_size}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")


if __name__ == "__main__":
    main()
