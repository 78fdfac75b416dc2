"""What does a sub-model cost? A sub-model method's client round at each rate (or depth)
against a bare PyTorch loop training the same sub-model, and the server's peak memory for one
round's aggregate.

1. **Seconds per level** (``--levels``: HeteroFL's and FedRolex's levels a-e, i.e. rates 1, 1/2,
   1/4, 1/8, 1/16; FjORD's tiers p_max 0.2-1; DepthFL's depths 1-4): one client on the CPU
   (partition 0 of ``--num-clients``, IID Fashion-MNIST, at most ``--samples`` training
   samples, 1000 by default) trains its sub-model for 1 local epoch with the method's recipe
   otherwise. What a batch costs is the method's (:class:`Work`):

   - HeteroFL, FedRolex: the width slice, the label-masked cross-entropy (HeteroFL's recipe:
     batch 10, SGD lr 0.01 with momentum 0.9, weight decay 5e-4, gradient-norm clip 1);
   - FjORD: the slice of width p_max, a width p <= p_max drawn per batch (ordered dropout, its
     per-width BatchNorm), plain cross-entropy (batch 32, SGD lr 0.1);
   - DepthFL: the depth-d prefix, every exit's cross-entropy plus the exits' mutual
     distillation and FedDyn's terms (batch 50, SGD lr 0.1 x 0.998 per round).

   Two variants, run round by round in alternation so that both see the same machine:

   - bare:    a hand-written loop over the sub-model, built as the client builds it and kept
              between rounds, with the same optimizer arithmetic, loss and batch order (the
              generators keyed like the client's) on the same shard.
   - runtime: the method's ``FedClient.fit`` in process with a real Flower ``Context``, as
              ``runtime_overhead.py``'s ``runtime`` variant: the client gets its level from the
              method's settings as in a run, receives the server's sub-model of the global
              model as the message's arrays, builds its model, trains, uploads and saves its
              state.

   ``--warmup-rounds`` rounds (default 1) untimed, then ``--rounds`` timed (default 5); the
   medians are reported.

2. **The server's peak memory for ``--server-clients`` clients** (default 100) at
   ``--server-mix`` (default: the method's own mix; HeteroFL's and FedRolex's
   ``a1-b1-c1-d1-e1`` is 20 clients at each level): the strategy's server step (``aggregate``:
   Σ values and Σ counts per coordinate over the round's uploads) on one upload per client
   (each a copy of what the server sent it), traced with tracemalloc (numpy's buffers are
   traced), beside the sum of the uploads' bytes and the global model's. The uploads and the
   strategy's caches of the clients' classes exist before the trace starts, as they do in a
   run's later rounds; the peak is what the step adds.

    .venv/bin/python benchmarks/submodel_round.py                       # HeteroFL, both parts
    .venv/bin/python benchmarks/submodel_round.py --global-arch heterofl-resnet18 --skip-server
    .venv/bin/python benchmarks/submodel_round.py --method fedrolex --skip-server
    .venv/bin/python benchmarks/submodel_round.py --method fjord
    .venv/bin/python benchmarks/submodel_round.py --method depthfl --global-arch cnn4
    .venv/bin/python benchmarks/submodel_round.py --skip-rates          # the memory only
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
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flwr.app import Context, RecordDict  # noqa: E402

from benchmarks.runtime_overhead import key_value, ratio_range, work_config  # noqa: E402
from client_models.width import parameter_count, set_width  # noqa: E402
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
from strategies.depthfl.maths import (depth_model, distillation_weight, exit_losses,  # noqa: E402
                                      feddyn_penalty)
from strategies.fjord.maths import draw_widths  # noqa: E402
from strategies.heterofl.maths import width_model  # noqa: E402

PARTITION = 0  # the client timed
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Work:
    """What differs between the sub-model methods timed here, each as its client does it: the
    level a client is given (a width rate here), the model it trains, its loss over one round's
    batches, its learning rate, and what the server sends it."""

    levels_setting = "rates"  # <method>.<this>: every client's level
    arch_setting = "global-arch"  # <method>.<this>: the global model
    default_levels = "a,b,c,d,e"
    default_server_mix: str | None = "a1-b1-c1-d1-e1"

    def level(self, token: str) -> Fraction:
        """A level name (a-e) or a number in (0, 1]."""
        return LEVELS[token] if token in LEVELS else width_rate(token)

    def label(self, token: str, level) -> str:
        return f"{token} ({level})" if token in LEVELS else str(level)

    def model(self, cfg, level) -> torch.nn.Module:
        return width_model(cfg, level, *expected_input(cfg))

    def round_loss(self, cfg, model, shard, num_classes: int, rnd: int, kept: dict
                   ) -> tuple[Loss, Callable[[], None]]:
        """The loss of each batch of round ``rnd``, and what ends the round (``kept``: what
        the client keeps from one round to the next)."""
        mask = label_mask(shard.train_y, num_classes) if cfg.settings.mask else None

        def loss(x, y):
            logits = model(x)
            return F.cross_entropy(masked_logits(logits, mask) if mask is not None
                                   else logits, y)
        return loss, lambda: None

    def lr(self, cfg, rnd: int) -> float:
        return cfg.lr * cfg.lr_factor(rnd)

    def sent(self, strategy, partition_id: int, rnd: int) -> dict:
        return strategy.slice_for(partition_id, rnd)

    def before_server_step(self, strategy, clients: list[ClientInfo]) -> None:
        for client in clients:  # the clients' classes, which the server caches from round 1 on
            strategy.label_rows(client)
        strategy._slices = (0, {})  # the round's slices are not kept through the aggregate


class FjORDWork(Work):
    """The slice of width p_max; each batch at a width drawn from those <= p_max."""

    default_levels = "0.2,0.4,0.6,0.8,1"
    default_server_mix = None  # FjORD's own: five uniform tiers

    def level(self, token: str) -> Fraction:
        return width_rate(token)

    def round_loss(self, cfg, model, shard, num_classes, rnd, kept):
        rng = np.random.default_rng(derive_seed(cfg.seed, "fjord-width", PARTITION, rnd))
        widths, top = cfg.settings.width_set(), cfg.settings.client_rates(cfg, rnd)[PARTITION]

        def loss(x, y):
            p = draw_widths(rng, widths, top, 1)[0]
            set_width(model, p if p < top else None)
            return F.cross_entropy(model(x), y)
        return loss, lambda: set_width(model, None)

    def before_server_step(self, strategy, clients):
        strategy._slices = (0, {})


class DepthFLWork(Work):
    """The depth-d prefix; every exit's loss with distillation and FedDyn's terms."""

    levels_setting = "depths"
    arch_setting = "model"
    default_levels = "1,2,3,4"
    default_server_mix = None  # DepthFL's own: depths 1-4 in blocks

    def level(self, token: str) -> int:
        return int(token)

    def label(self, token, level):
        return f"depth {level}"

    def model(self, cfg, level):
        return depth_model(cfg, level, *expected_input(cfg), "client", level)

    def round_loss(self, cfg, model, shard, num_classes, rnd, kept):
        s = cfg.settings
        weight = distillation_weight(rnd, s.kd_ramp_rounds)
        anchor = {k: p.detach().clone() for k, p in model.named_parameters()}
        if "feddyn-h" not in kept:  # h_k starts at zeros, as the client's first message
            kept["feddyn-h"] = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
        h = kept["feddyn-h"]

        def loss(x, y):
            total = exit_losses(model.exit_logits(x), y, weight, s)
            if s.feddyn:
                total = total + feddyn_penalty(model, anchor, h, s.feddyn_alpha)
            return total

        def finish():
            if s.feddyn:  # h_k <- h_k - alpha (theta - theta_g), kept to the next round
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        h[name] -= s.feddyn_alpha * (p - anchor[name])
        return loss, finish

    def lr(self, cfg, rnd):
        return cfg.lr * cfg.settings.lr_round_decay ** (rnd - 1) * cfg.lr_factor(rnd)

    def sent(self, strategy, partition_id, rnd):
        return strategy.fit_payload(rnd, ClientInfo(partition_id,
                                                    strategy.architectures[partition_id]))

    def before_server_step(self, strategy, clients):
        strategy._prefixes = (0, {})


WORKS: dict[str, Work] = {"heterofl": Work(), "fedrolex": Work(), "fjord": FjORDWork(),
                          "depthfl": DepthFLWork()}


def round_config(method: str, level, rounds: int, flat: dict):
    """The run config of the client's rounds at ``level``: every client of the method at that
    level (as a run gives it), 1 local epoch, ``rounds`` rounds."""
    return work_config({"method": method, "dataset": "fmnist", "partition": "iid",
                        "local-epochs": 1, "num-server-rounds": rounds, "client-state": "memory",
                        **flat, f"{method}.{WORKS[method].levels_setting}": str(level)})


def slice_model(cfg, level) -> torch.nn.Module:
    """The sub-model at ``level``, built as the method's client builds it."""
    return WORKS[cfg.method].model(cfg, level)


def bare(cfg, level) -> Iterator[float]:
    """The plainest loop training the sub-model: yields each round's seconds (set-up untimed)."""
    work = WORKS[cfg.method]
    data = setup.dataset(cfg)
    shard = load_client_data(data, setup.partition_spec(cfg), PARTITION)
    if cfg.local_steps or cfg.drop_last or cfg.batch_order != "shuffled":
        raise SystemExit("submodel_round: the bare loop does whole shuffled epochs only "
                         "(local-steps 0, drop-last false, batch-order shuffled)")
    model, kept = slice_model(cfg, level), {}
    for rnd in range(1, cfg.num_server_rounds + 1):
        start = time.perf_counter()
        # The client's optimizer: the recipe's (a new one each round), at the round's lr.
        opt = recipe_optimizer(model.parameters(), cfg, lr=work.lr(cfg, rnd))
        model.train()
        loss_fn, finish = work.round_loss(cfg, model, shard, data.num_classes, rnd, kept)
        # The client's batch order: one shuffle from the generator keyed like its own.
        order = torch.randperm(len(shard.train_y), generator=torch.Generator().manual_seed(
            derive_seed(cfg.seed, "batches", PARTITION, rnd)))
        for i in range(0, len(order), cfg.batch_size):
            idx = order[i:i + cfg.batch_size]
            loss = loss_fn(shard.train_x[idx], shard.train_y[idx])
            opt.zero_grad()
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
        finish()
        yield time.perf_counter() - start


def server_strategy(cfg):
    return METHODS[cfg.method].strategy(cfg, None, input_shape=expected_input(cfg)[0],
                                        num_classes=expected_input(cfg)[1])


def runtime(cfg) -> Iterator[float]:
    """The method's client in process: each round the server's sub-model arrives as the
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
        arrays = to_ndarrays(WORKS[cfg.method].sent(server, PARTITION, rnd))
        start = time.perf_counter()
        client_cls(ctx, cfg).fit(arrays, {"server-round": rnd})
        yield time.perf_counter() - start


def time_rates(args: argparse.Namespace) -> None:
    work = WORKS[args.method]
    rounds = args.warmup_rounds + args.rounds
    print("\n| level | parameters | bare s | runtime s | ratio |\n|---|---|---|---|---|")
    for token in (args.levels or work.default_levels).split(","):
        level = work.level(token.strip())
        cfg = round_config(args.method, level, rounds, flat_settings(args))
        bare_s, runtime_s = [], []
        for rnd, (b, r) in enumerate(zip(bare(cfg, level), runtime(cfg)), 1):
            if rnd > args.warmup_rounds:
                bare_s.append(b)
                runtime_s.append(r)
        b, r = statistics.median(bare_s), statistics.median(runtime_s)
        print(f"| {work.label(token.strip(), level)} | "
              f"{parameter_count(slice_model(cfg, level)):,} | {b:.3f} | {r:.3f} | "
              f"{ratio_range([r / b])} |", flush=True)
    print(f"\nwork: {args.method} on {getattr(cfg.settings, work.arch_setting.replace('-', '_'))}"
          f", partition {PARTITION} of {cfg.num_clients} (IID Fashion-MNIST, at most "
          f"{args.samples} samples), 1 epoch of batch {cfg.batch_size}; median of "
          f"{args.rounds} rounds after {args.warmup_rounds} untimed; "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")


def server_memory(cfg, server_round: int = 1) -> dict[str, int]:
    """Bytes: the traced peak of the strategy's server step on one upload per client (each a
    copy of what it was sent), the uploads' sum, and the global model's."""
    work = WORKS[cfg.method]
    strategy = server_strategy(cfg)
    clients = [ClientInfo(pid, arch) for pid, arch in enumerate(strategy.architectures)]
    uploads = [Upload(client, strategy.train_sizes[client.partition_id],
                      {k: v.copy() for k, v in
                       work.sent(strategy, client.partition_id, server_round).items()}, {})
               for client in clients]
    work.before_server_step(strategy, clients)
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
    work = WORKS[args.method]
    mix = args.server_mix or work.default_server_mix
    cfg = work_config({"method": args.method, "dataset": "fmnist", "partition": "iid",
                       **flat_settings(args), "num-clients": args.server_clients,
                       **({f"{args.method}.{work.levels_setting}": mix} if mix else {})})
    m = server_memory(cfg)
    mib = 1024 ** 2
    print(f"\nserver step ({args.method}.aggregate) for {args.server_clients} clients at "
          f"{getattr(cfg.settings, work.levels_setting)} on "
          f"{getattr(cfg.settings, work.arch_setting.replace('-', '_'))}: peak "
          f"{m['peak'] / mib:.1f} MiB traced above what was held before it (tracemalloc); the "
          f"round's uploads {m['uploads'] / mib:.1f} MiB in all (held before the step); the "
          f"global model {m['global'] / mib:.1f} MiB; peak / uploads "
          f"{m['peak'] / m['uploads']:.2f}x")


def flat_settings(args: argparse.Namespace) -> dict:
    arch = ({f"{args.method}.{WORKS[args.method].arch_setting}": args.global_arch}
            if args.global_arch else {})
    return {"num-clients": args.num_clients, "max-samples-per-client": args.samples, **arch,
            **dict(args.set)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="heterofl", choices=sorted(WORKS))
    parser.add_argument("--global-arch", default=None,
                        help="the global model (default: the method's own; <method>.global-arch"
                             ", DepthFL's depthfl.model)")
    parser.add_argument("--levels", "--rates", default=None,
                        help="comma-separated levels: rates (a-e or numbers in (0, 1]), FjORD's "
                             "tiers, DepthFL's depths (default: the method's whole range)")
    parser.add_argument("--samples", type=int, default=1000,
                        help="training samples of the timed client's shard")
    parser.add_argument("--num-clients", type=int, default=10,
                        help="the partition the timed client's shard comes from")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--server-clients", type=int, default=100)
    parser.add_argument("--server-mix", default=None,
                        help="the levels setting of the memory part (default: HeteroFL's and "
                             "FedRolex's a1-b1-c1-d1-e1, the others' own default)")
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
