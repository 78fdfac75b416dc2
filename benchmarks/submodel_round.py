"""What does a width slice cost? HeteroFL's (or FedRolex's) client round at each rate against
a bare PyTorch loop training the same slice, and the server's peak memory for one round's
aggregate.

1. **Seconds per rate** (``--rates``, default HeteroFL's levels a-e: 1, 1/2, 1/4, 1/8, 1/16):
   one client on the CPU (partition 0 of ``--num-clients``, IID Fashion-MNIST, at most
   ``--samples`` training samples, 1000 by default) trains its slice of ``--global-arch`` for 1
   local epoch with the method's recipe otherwise (HeteroFL's: batch 10, SGD lr 0.01 with
   momentum 0.9, weight decay 5e-4, gradient-norm clip 1, the label-masked cross-entropy). Two
   variants, run round by round in alternation so that both see the same machine:

   - bare:    a hand-written loop over the slice model, built by the kit at the rate
              (:func:`slice_model`, the client's own builder) and kept between rounds, with the
              same optimizer arithmetic, masked loss and batch order (the generator keyed like
              the client's) on the same shard.
   - runtime: the method's ``FedClient.fit`` in process with a real Flower ``Context``, as
              ``runtime_overhead.py``'s ``runtime`` variant: the client gets its rate from
              ``<method>.rates`` as in a run, receives the server's slice of the global model
              as the message's arrays, builds its slice model, trains, uploads and saves its
              state.

   ``--warmup-rounds`` rounds (default 1) untimed, then ``--rounds`` timed (default 5); the
   medians are reported.

2. **The server's peak memory for ``--server-clients`` clients** (default 100) at the mix
   ``--server-mix`` (default ``a1-b1-c1-d1-e1``: 20 clients at each level): the strategy's
   server step (``aggregate``: Σ values and Σ counts per coordinate over the round's uploads)
   on one upload per client (each a copy of its slice of the global model), traced with
   tracemalloc (numpy's buffers are traced), beside the sum of the uploads' bytes and the
   global model's. The uploads and the strategy's caches of the clients' classes exist before
   the trace starts, as they do in a run's later rounds; the peak is what the step adds.

    .venv/bin/python benchmarks/submodel_round.py                       # both parts
    .venv/bin/python benchmarks/submodel_round.py --global-arch heterofl-resnet18 --skip-server
    .venv/bin/python benchmarks/submodel_round.py --method fedrolex --skip-server
    .venv/bin/python benchmarks/submodel_round.py --skip-rates          # the memory only

FjORD (ordered dropout draws a width per batch) and DepthFL (depth prefixes with exits) train
differently and are not covered.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import tracemalloc
from fractions import Fraction
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flwr.app import Context, RecordDict  # noqa: E402

from benchmarks.runtime_overhead import key_value, ratio_range, work_config  # noqa: E402
from client_models.width import parameter_count  # noqa: E402
from fedapp.data import setup  # noqa: E402
from fedapp.data.local_data import expected_input  # noqa: E402
from fedapp.data.partitions import load_client_data  # noqa: E402
from fedapp.runtime.payload import to_ndarrays  # noqa: E402
from fedapp.runtime.strategy_base import ClientInfo, Upload  # noqa: E402
from fedapp.runtime.submodel_settings import LEVELS, width_rate  # noqa: E402
from fedapp.runtime.submodels import label_mask, masked_logits  # noqa: E402
from fedapp.runtime.training import recipe_optimizer  # noqa: E402
from fedapp.seeding import derive_seed  # noqa: E402
from strategies import METHODS  # noqa: E402
from strategies.heterofl.maths import width_model  # noqa: E402

# The methods whose client trains the slice it receives with HeteroFL's loss (one code path).
SLICE_METHODS = ("heterofl", "fedrolex")
PARTITION = 0  # the client timed


def rate_of(token: str) -> Fraction:
    """A level name (a-e) or a number in (0, 1]."""
    return LEVELS[token] if token in LEVELS else width_rate(token)


def round_config(method: str, rate: Fraction, rounds: int, flat: dict):
    """The run config of the client's rounds at ``rate``: every client of the method at that
    rate (``<method>.rates``, as a run gives it), 1 local epoch, ``rounds`` rounds."""
    return work_config({"method": method, "dataset": "fmnist", "partition": "iid",
                        "local-epochs": 1, "num-server-rounds": rounds, "client-state": "memory",
                        **flat, f"{method}.rates": str(rate)})


def slice_model(cfg, rate: Fraction) -> torch.nn.Module:
    """The slice model at ``rate``, built as the method's client builds it."""
    return width_model(cfg, rate, *expected_input(cfg))


def bare(cfg, rate: Fraction) -> Iterator[float]:
    """The plainest loop training the slice: yields each round's seconds (set-up untimed)."""
    data = setup.dataset(cfg)
    shard = load_client_data(data, setup.partition_spec(cfg), PARTITION)
    if cfg.local_steps or cfg.drop_last or cfg.batch_order != "shuffled":
        raise SystemExit("submodel_round: the bare loop does whole shuffled epochs only "
                         "(local-steps 0, drop-last false, batch-order shuffled)")
    model = slice_model(cfg, rate)
    mask = label_mask(shard.train_y, data.num_classes) if cfg.settings.mask else None
    for rnd in range(1, cfg.num_server_rounds + 1):
        start = time.perf_counter()
        # The client's optimizer: the recipe's (a new one each round), at the round's lr.
        opt = recipe_optimizer(model.parameters(), cfg, lr=cfg.lr * cfg.lr_factor(rnd))
        model.train()
        # The client's batch order: one shuffle from the generator keyed like its own.
        order = torch.randperm(len(shard.train_y), generator=torch.Generator().manual_seed(
            derive_seed(cfg.seed, "batches", PARTITION, rnd)))
        for i in range(0, len(order), cfg.batch_size):
            idx = order[i:i + cfg.batch_size]
            logits = model(shard.train_x[idx])
            if mask is not None:
                logits = masked_logits(logits, mask)
            loss = F.cross_entropy(logits, shard.train_y[idx])
            opt.zero_grad()
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
        yield time.perf_counter() - start


def server_strategy(cfg):
    return METHODS[cfg.method].strategy(cfg, None, input_shape=expected_input(cfg)[0],
                                        num_classes=expected_input(cfg)[1])


def runtime(cfg) -> Iterator[float]:
    """The method's client in process: each round the server's slice arrives as the
    message's arrays and ``fit`` trains it. Yields each round's seconds (the server's slicing
    and the set-up untimed)."""
    client_cls = METHODS[cfg.method].client
    server = server_strategy(cfg)
    run_config = {k.replace("_", "-"): v for k, v in cfg.to_flat().items()}
    # On the CPU, as the bare loop, even where a GPU is visible.
    ctx = Context(run_id=1, node_id=PARTITION,
                  node_config={"partition-id": PARTITION, "num-partitions": cfg.num_clients,
                               "device": "cpu"},
                  state=RecordDict(), run_config=run_config)
    client_cls(ctx, cfg).data  # load the data outside the timing, as `bare` does
    for rnd in range(1, cfg.num_server_rounds + 1):
        arrays = to_ndarrays(server.slice_for(PARTITION, rnd))
        start = time.perf_counter()
        client_cls(ctx, cfg).fit(arrays, {"server-round": rnd})
        yield time.perf_counter() - start


def time_rates(args: argparse.Namespace) -> None:
    rounds = args.warmup_rounds + args.rounds
    print("\n| rate | slice params | bare s | runtime s | ratio |\n|---|---|---|---|---|")
    for token in args.rates.split(","):
        rate = rate_of(token.strip())
        cfg = round_config(args.method, rate, rounds, flat_settings(args))
        bare_s, runtime_s = [], []
        for rnd, (b, r) in enumerate(zip(bare(cfg, rate), runtime(cfg)), 1):
            if rnd > args.warmup_rounds:
                bare_s.append(b)
                runtime_s.append(r)
        b, r = statistics.median(bare_s), statistics.median(runtime_s)
        name = f"{token.strip()} ({rate})" if token.strip() in LEVELS else str(rate)
        print(f"| {name} | {parameter_count(slice_model(cfg, rate)):,} | {b:.3f} | {r:.3f} | "
              f"{ratio_range([r / b])} |", flush=True)
    print(f"\nwork: {args.method} on {cfg.settings.global_arch}, partition {PARTITION} of "
          f"{cfg.num_clients} (IID Fashion-MNIST, at most {args.samples} samples), 1 epoch of "
          f"batch {cfg.batch_size}; median of {args.rounds} rounds after {args.warmup_rounds} "
          f"untimed; {torch.get_num_threads()} threads, torch {torch.__version__}")


def server_memory(cfg, server_round: int = 1) -> dict[str, int]:
    """Bytes: the traced peak of the strategy's server step on one upload per client (each a
    copy of its slice), the uploads' sum, and the global model's."""
    strategy = server_strategy(cfg)
    clients = [ClientInfo(pid, arch) for pid, arch in enumerate(strategy.architectures)]
    for client in clients:  # the clients' classes, which the server caches from round 1 on
        strategy.label_rows(client)
    uploads = [Upload(client, strategy.train_sizes[client.partition_id],
                      {k: v.copy() for k, v in
                       strategy.slice_for(client.partition_id, server_round).items()}, {})
               for client in clients]
    strategy._slices = (0, {})  # the round's slices are not kept through the aggregate
    global_bytes = sum(v.nbytes for v in strategy.global_model.values())
    upload_bytes = sum(v.nbytes for u in uploads for v in u.payload.values())
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        strategy.aggregate(server_round, uploads)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return {"peak": peak, "uploads": upload_bytes, "global": global_bytes}


def report_memory(args: argparse.Namespace) -> None:
    cfg = work_config({"method": args.method, "dataset": "fmnist", "partition": "iid",
                       **flat_settings(args), "num-clients": args.server_clients,
                       f"{args.method}.rates": args.server_mix})
    m = server_memory(cfg)
    mib = 1024 ** 2
    print(f"\nserver step ({args.method}.aggregate) for {args.server_clients} clients at "
          f"{args.server_mix} on {cfg.settings.global_arch}: peak {m['peak'] / mib:.1f} MiB "
          f"traced above what was held before it (tracemalloc); the round's uploads "
          f"{m['uploads'] / mib:.1f} MiB in all (held before the step); the global model "
          f"{m['global'] / mib:.1f} MiB; peak / uploads {m['peak'] / m['uploads']:.2f}x")


def flat_settings(args: argparse.Namespace) -> dict:
    return {"num-clients": args.num_clients, "max-samples-per-client": args.samples,
            f"{args.method}.global-arch": args.global_arch, **dict(args.set)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="heterofl", choices=SLICE_METHODS)
    parser.add_argument("--global-arch", default="heterofl-conv")
    parser.add_argument("--rates", default="a,b,c,d,e",
                        help="comma-separated levels (a-e) or numbers in (0, 1]")
    parser.add_argument("--samples", type=int, default=1000,
                        help="training samples of the timed client's shard")
    parser.add_argument("--num-clients", type=int, default=10,
                        help="the partition the timed client's shard comes from")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--server-clients", type=int, default=100)
    parser.add_argument("--server-mix", default="a1-b1-c1-d1-e1")
    parser.add_argument("--skip-rates", action="store_true")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--set", action="append", type=key_value, default=[],
                        metavar="KEY=VALUE", help="a further setting of the work (repeatable)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    if not args.skip_rates:
        time_rates(args)
    if not args.skip_server:
        report_memory(args)


if __name__ == "__main__":
    main()
