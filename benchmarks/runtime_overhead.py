"""How much does the framework cost? The same local work three ways, timed.

Two settings (``--setting``):

- ``tenclients`` (the default): 10 clients on Fashion-MNIST (IID, the CNN-1..5 mix,
  round-robin); each round every client trains 1 epoch (batch 64, SGD with momentum) on its own
  shard and evaluates on its own test split; method ``standalone``, so the three variants do
  exactly the same arithmetic.
- ``htfllib``: FedGH on HtFLlib's Fashion-MNIST setting: 20 clients, all of them every round,
  Dirichlet 0.1 over the training set, batch 10, 1 local epoch, plain SGD with lr 0.01 (no
  momentum, weight decay or clipping), three CNNs with a 512-d representation (CNN-1..3 of
  FedGH's Table 2 with ``feature-dim`` 512). The bare loop times FedGH's own client pass (the
  representations' class means over the training data, after training: its LARs) apart from
  its training and evaluation, so a ratio can count that pass as overhead, as HtFLlib's figure
  does, or hold the Flower round against the bare loop doing the same work. FedGH's other own
  work (the server's header training, the global header's evaluation on features already
  computed) is counted as overhead in every ratio.

The variants:

1. bare:    a hand-written PyTorch loop over the clients (models kept in a list), with the same
            models, shards, optimizer arithmetic (weight decay, gradient clipping) and batch
            order (the same keyed generators) as the clients.
2. runtime: the project's client runtime in-process (``FedClient.fit``/``evaluate`` with a real
            Flower ``Context``: model restored from ``context.state`` every message, exactly as
            under Flower).
3. flwr:    ``fedapp run`` (a full ``flwr run`` simulation with Ray virtual clients); reported
            end to end (SuperLink start to stop), as the ServerApp's own ``wall_seconds``, and
            per round after the first (round 1 also starts the Ray actors).

Warm-up: the bare and in-process loops run ``--warmup-rounds`` rounds (default 1) untimed before
their timed rounds, as the Flower run's per-round figure leaves out its first round.

Threads: the bare and in-process loops use torch's threads on every core; the Flower run gets
``client-num-cpus`` equal to the core count, so one virtual client trains at a time with the
same threads, and the comparison measures the framework, not a different parallelism.

    .venv/bin/python benchmarks/runtime_overhead.py [--setting tenclients] [--rounds 20]
    .venv/bin/python benchmarks/runtime_overhead.py --setting htfllib --rounds 5
    .venv/bin/python benchmarks/runtime_overhead.py --setting htfllib --rounds 3 --flwr-only \
        --timeline     # where a message's seconds go between the ServerApp and the actors
    .venv/bin/python benchmarks/runtime_overhead.py --setting htfllib --rounds 6 --interleave

``--interleave`` runs a bare round after each of the Flower run's rounds, while the Flower run
waits, and reports each Flower round after the first against the bare rounds just before and
after it: the same training's speed moves by half within minutes on a shared 2-core machine,
and only a reference timed beside the measured round follows it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
from fedapp.data.partitions import ClientData, load_client_data  # noqa: E402
from fedapp.runtime import timeline  # noqa: E402
from fedapp.runtime.class_stats import class_means  # noqa: E402
from fedapp.runtime.training import pick_device  # noqa: E402
from fedapp.seeding import derive_seed  # noqa: E402
from strategies import METHODS, load_config  # noqa: E402

SETTINGS = {
    "tenclients": {"method": "standalone", "num-clients": 10, "partition": "iid",
                   "arch-mix": "cnn1,cnn2,cnn3,cnn4,cnn5", "batch-size": 64, "momentum": 0.9},
    "htfllib": {"method": "fedgh", "num-clients": 20, "partition": "dirichlet",
                "dirichlet-alpha": 0.1, "arch-mix": "cnn1,cnn2,cnn3", "feature-dim": 512,
                "batch-size": 10, "momentum": 0.0, "weight-decay": 0.0, "grad-clip": 0.0},
}


def settings(args: argparse.Namespace) -> dict:
    return {"dataset": "fmnist", "num-server-rounds": args.rounds,
            "max-samples-per-client": args.samples_per_client, "local-epochs": 1,
            "optimizer": "sgd", "lr": 0.01, "client-num-cpus": os.cpu_count() or 1,
            **SETTINGS[args.setting], **({"method": args.method} if args.method else {}),
            "client-state": args.client_state, **dict(args.set)}


def work_config(flat: dict):
    """The in-process loops' config: every setting of the work counts as set by the run, as
    the Flower run's ``--set`` flags do, so a method's recipe fills in only what the work
    leaves unset in both."""
    return load_config({**flat, "explicit-settings": ",".join(f"{key}=set" for key in flat)})


def key_value(text: str) -> tuple[str, object]:
    """``--set KEY=VALUE``: VALUE read as JSON where it parses (numbers, true/false, quoted
    strings), as a string otherwise."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


# A method's own client work that the bare loop can do too, with the function its client calls:
# FedGH's clients upload their representations' class means over the training data.
OWN_PASS = {"fedgh": lambda model, shard, num_classes: class_means(
    model.features, model, shard.train_x, shard.train_y, num_classes)}


def bare(cfg) -> Iterator[tuple[float, float, float]]:
    """The reference: the plainest loop that does the same training and evaluation.

    Yields (training seconds, evaluation seconds, seconds of the method's own client pass in
    :data:`OWN_PASS`, 0 for a method without one) of each round (set-up is not timed)."""
    # On the device the clients pick (a GPU where there is one), so that both loops do the
    # same work where they would run; its queued kernels are waited for before each clock.
    device = pick_device()
    data = setup.dataset(cfg)
    shards = [ClientData(*(t.to(device) for t in load_client_data(
                  data, setup.partition_spec(cfg), k).tensors()))
              for k in range(cfg.num_clients)]
    models = [setup.new_model(cfg, arch, data.input_shape, data.num_classes,
                              *setup.own_key(cfg, k)).to(device)
              for k, arch in enumerate(setup.architectures(cfg))]
    own_pass = OWN_PASS.get(cfg.method)

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    for rnd in range(1, cfg.num_server_rounds + 1):
        train = evaluate = own = 0.0
        for k, (model, shard) in enumerate(zip(models, shards)):
            start = clock()
            opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                  weight_decay=cfg.weight_decay)
            model.train()
            # The clients' batch order: one shuffle from the generator keyed like theirs.
            order = torch.randperm(len(shard.train_y), generator=torch.Generator().manual_seed(
                derive_seed(cfg.seed, "batches", k, rnd))).to(device)
            for i in range(0, len(order), cfg.batch_size):
                idx = order[i:i + cfg.batch_size]
                loss = F.cross_entropy(model(shard.train_x[idx]), shard.train_y[idx])
                opt.zero_grad()
                loss.backward()
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
            middle = clock()
            if own_pass is not None:
                own_pass(model, shard, data.num_classes)
            after_pass = clock()
            model.eval()
            with torch.no_grad():
                for i in range(0, len(shard.test_y), 512):
                    model(shard.test_x[i:i + 512]).argmax(1)
            train += middle - start
            own += after_pass - middle
            evaluate += clock() - after_pass
        yield train, evaluate, own


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
        client_cls(ctx, cfg).data
    for rnd in range(1, cfg.num_server_rounds + 1):
        start = time.perf_counter()
        for ctx in contexts:
            client_cls(ctx, cfg).fit([], {"server-round": rnd})
            client_cls(ctx, cfg).evaluate([], {"server-round": rnd})
        yield time.perf_counter() - start


def full_run(args: argparse.Namespace) -> dict[str, float]:
    """Seconds of `fedapp run`: end to end, the ServerApp's own wall_seconds, the mean wall
    seconds of its rounds after the first (``round``), the clients' own compute in them (the
    seconds their fit's training and their evaluation took inside the actors, summed over the
    round's clients), and the strategy's own work in them (``server_seconds``: its four calls
    of a round). With ``--timeline`` also the ClientApp's whole handling of the round's
    messages (``round-handled``: the clients' compute, the method's other client work such as
    FedGH's class means, the model's restore and save, the payloads), and it prints where a
    message of the later rounds spends its seconds."""
    out = Path(tempfile.mkdtemp(prefix="fedapp-bench-"))
    trace = out / "timeline"
    env = {**os.environ, **({timeline.ENV: str(trace)} if args.timeline else {})}
    start = time.perf_counter()
    subprocess.run(flwr_command(args, out), check=True, env=env)
    end_to_end = time.perf_counter() - start
    summary = json.loads((out / "bench" / "summary.json").read_text())
    rounds = flwr_rounds(out)
    later = rounds[1:] or rounds
    t = {"end-to-end": end_to_end, "server": summary["wall_seconds"],
         "first": rounds[0]["seconds"], "first-clients": rounds[0]["client_seconds"],
         "first-strategy": rounds[0]["server_seconds"],
         **{name: sum(r[key] for r in later) / len(later)
            for name, key in (("round", "seconds"), ("round-clients", "client_seconds"),
                              ("round-strategy", "server_seconds"))}}
    if args.timeline:
        messages = sum(r["clients_fit"] + len(r.get("evaluated") or []) for r in later)
        print("\n".join(timeline.breakdown(trace, last=messages,
                                           way=timeline.SIMULATED_PHASES)), flush=True)
        t["round-handled"] = timeline.handled_seconds(timeline.read(trace), messages) / len(later)
    return t


def flwr_command(args: argparse.Namespace, out: Path) -> list[str]:
    """``fedapp run`` on the setting, its run named ``bench`` under ``out``."""
    sets = [f"--set={k}={json.dumps(v) if isinstance(v, str) else v}"
            for k, v in settings(args).items()]
    return [sys.executable, "-m", "fedapp.cli.main", "run", *sets,
            "--set", 'run-name="bench"', "--output-dir", str(out)]


def flwr_rounds(out: Path) -> list[dict]:
    return [json.loads(line)
            for line in (out / "bench" / "rounds.jsonl").read_text().splitlines()]


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds every process of the machine has used, those stolen by its hypervisor),
    from /proc/stat; (nan, nan) where there is none."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except OSError:
        return float("nan"), float("nan")
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq) / tick, steal / tick


def interleaved(args: argparse.Namespace) -> list[dict[str, float]]:
    """The Flower run's rounds and the bare loop's in alternation, each bare round run while
    the Flower run stands still after one of its rounds (``FEDAPP_PAUSE_BETWEEN_ROUNDS``,
    :func:`fedapp.runtime.timeline.between_rounds`), so that a Flower round is timed between
    two bare rounds, minutes apart at most.

    Returns one row per Flower round: its seconds, and the bare round run after it (training,
    training + evaluation, and with the method's own pass: the same work), with the CPU seconds
    that other processes (the paused Flower run's included) and the hypervisor took from the
    machine meanwhile."""
    loops = work_config({**settings(args), "client-state": "memory",
                         "num-server-rounds": args.rounds + args.warmup_rounds})
    bare_rounds = bare(loops)
    for _ in range(args.warmup_rounds):  # the bare loop's cold round(s), untimed
        next(bare_rounds)
    out = Path(tempfile.mkdtemp(prefix="fedapp-bench-"))
    pause = out / "pause"
    pause.mkdir()
    proc = subprocess.Popen(flwr_command(args, out),
                            env={**os.environ, timeline.PAUSE_ENV: str(pause)})
    rows = []
    try:
        for rnd in range(1, args.rounds + 1):
            while not (pause / f"round-{rnd}.done").exists():
                if proc.poll() is not None:
                    raise SystemExit(f"runtime_overhead: the Flower run ended (exit "
                                     f"{proc.returncode}) before its round {rnd}")
                time.sleep(0.05)
            busy, stolen, own_cpu = *cpu_seconds(), time.process_time()
            train, evaluate, own_pass = next(bare_rounds)
            busy2, stolen2 = cpu_seconds()
            rows.append({"bare-train": train, "bare": train + evaluate,
                         "bare-same": train + evaluate + own_pass,
                         "others-cpu": busy2 - busy - (time.process_time() - own_cpu),
                         "stolen": stolen2 - stolen})
            (pause / f"round-{rnd}.go").touch()
        if proc.wait() != 0:
            raise SystemExit(f"runtime_overhead: the Flower run failed (exit {proc.returncode})")
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    for row, record in zip(rows, flwr_rounds(out)):
        row.update({"round": record["seconds"], "round-clients": record["client_seconds"]})
    return rows


def report_interleaved(rows: list[dict[str, float]], cfg, warmup_rounds: int) -> None:
    """A Flower round r (r > 1) against the mean of the bare rounds run just before it and
    just after it; the median of those ratios is the sitting's figure."""
    print("\n| Flower round | its seconds | of it the clients' training and evaluation | bare "
          "training before / after it | round / bare training | round / bare training + "
          "evaluation | round / bare training + evaluation + the method's own pass | clients' "
          "training and evaluation / bare's | other processes' CPU during the bare round "
          "after it |\n|---|---|---|---|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {"train": [], "both": [], "same": [], "clients": []}
    for r in range(1, len(rows)):
        before, after = rows[r - 1], rows[r]
        mean = {key: (before[key] + after[key]) / 2 for key in ("bare-train", "bare", "bare-same")}
        ratios["train"].append(after["round"] / mean["bare-train"])
        ratios["both"].append(after["round"] / mean["bare"])
        ratios["same"].append(after["round"] / mean["bare-same"])
        ratios["clients"].append(after["round-clients"] / mean["bare"])
        print(f"| {r + 1} | {after['round']:.1f} | {after['round-clients']:.1f} | "
              f"{before['bare-train']:.1f} / {after['bare-train']:.1f} | "
              + " | ".join(f"{v[-1]:.2f}x" for v in ratios.values())
              + f" | {after['others-cpu']:.1f} s (stolen {after['stolen']:.1f} s) in "
              f"{after['bare-same']:.1f} s |")
    if len(rows) > 1:
        median = {key: statistics.median(v) for key, v in ratios.items()}
        print(f"\nmedians over rounds 2-{len(rows)}: a round {median['train']:.2f}x the bare "
              f"training, {median['both']:.2f}x the bare training + evaluation, "
              f"{median['same']:.2f}x the bare training + evaluation + the method's own pass "
              f"({'none' if cfg.method not in OWN_PASS else cfg.method + ': class means'}); "
              f"the clients' training and evaluation {median['clients']:.2f}x the bare loop's")
    print(f"work: method {cfg.method}, {cfg.num_clients} clients, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}; the bare loop's first {warmup_rounds} "
          "round(s) untimed")


def one_sitting(args: argparse.Namespace, cfg) -> dict[str, float]:
    """Every variant once; seconds (per run, and per round where it says so)."""
    # The two in-process loops run round by round in alternation, so both see the same
    # machine (noisy neighbours). They share one process, whose first round is its cold one
    # (first allocations, torch's first calls for each layer shape), and the bare loop goes
    # first: both run --warmup-rounds rounds untimed before the timed ones, as the Flower
    # run's "round after the first" leaves its own cold round out.
    t = {}
    if not args.flwr_only:
        t = {"bare-train": 0.0, "bare": 0.0, "bare-same": 0.0, "runtime": 0.0}
        loops = work_config({**settings(args), "client-state": "memory",
                             "num-server-rounds": args.rounds + args.warmup_rounds})
        per_round = []
        for rnd, ((train, evaluate, own), r) in enumerate(zip(bare(loops), runtime(loops)), 1):
            per_round.append(f"{train + evaluate + own:.1f}/{r:.1f}")
            if rnd <= args.warmup_rounds:
                continue
            t["bare-train"] += train
            t["bare"] += train + evaluate
            t["bare-same"] += train + evaluate + own
            t["runtime"] += r
        print("seconds per round, bare / client runtime (the first "
              f"{args.warmup_rounds} untimed): " + ", ".join(per_round), flush=True)
    if not args.skip_flwr:
        t.update(full_run(args))
    return t


def ratio_range(values: list[float]) -> str:
    return (f"{values[0]:.2f}x" if len(values) == 1
            else f"{min(values):.2f}-{max(values):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setting", default="tenclients", choices=sorted(SETTINGS))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--samples-per-client", type=int, default=0,
                        help="cap per client (0 = the client's whole shard)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="sittings; the ratios are reported as their range")
    parser.add_argument("--skip-flwr", action="store_true")
    parser.add_argument("--method", default="",
                        help="another method on the setting's work (e.g. standalone: the "
                             "client runtime without any method's own extra work)")
    parser.add_argument("--set", action="append", type=key_value, default=[],
                        metavar="KEY=VALUE",
                        help="a further setting of the work (repeatable), e.g. "
                             "--set public-source=train-holdout for the public-data methods")
    parser.add_argument("--warmup-rounds", type=int, default=1,
                        help="rounds the two in-process loops run untimed first")
    parser.add_argument("--client-state", default="memory", choices=("memory", "disk"),
                        help="where the Flower run's clients keep their models between "
                        "messages: in the Context that travels with every call (memory, the "
                        "default) or in a file each (disk)")
    parser.add_argument("--timeline", action="store_true",
                        help="the Flower run records each message's way "
                        "(fedapp.runtime.timeline) and prints where it spends its seconds")
    parser.add_argument("--flwr-only", action="store_true",
                        help="only the Flower run (seconds, no ratios): a variant of it beside "
                             "a sitting that has the bare loop")
    parser.add_argument("--interleave", action="store_true",
                        help="the bare loop's rounds between the Flower run's, each Flower "
                             "round against the bare rounds just before and after it "
                             "(no in-process runtime row)")
    args = parser.parse_args()
    cfg = work_config(settings(args))
    torch.set_num_threads(os.cpu_count() or 1)
    if args.interleave:
        if args.repeat != 1 or args.skip_flwr or args.flwr_only or args.timeline:
            parser.error("--interleave is one sitting of its own: without --repeat, "
                         "--skip-flwr, --flwr-only or --timeline")
        report_interleaved(interleaved(args), cfg, args.warmup_rounds)
        return
    sittings = []
    for i in range(args.repeat):
        sittings.append(one_sitting(args, cfg))
        print(f"sitting {i + 1}: " + ", ".join(f"{k} {v:.1f} s" for k, v in sittings[-1].items()),
              flush=True)
    rounds = cfg.num_server_rounds
    rows = [("bare PyTorch loop: training only", "bare-train", 1),
            ("bare PyTorch loop: training + evaluation", "bare", 1),
            ("bare PyTorch loop: the same work (training + evaluation + the method's own "
             "pass, if any)", "bare-same", 1),
            ("client runtime (in-process)", "runtime", 1),
            ("flwr run (ServerApp)", "server", 1),
            ("flwr run (end to end)", "end-to-end", 1),
            ("flwr run, its first round", "first", rounds),
            ("  of it the clients' own compute", "first-clients", rounds),
            ("  of it the strategy's own work", "first-strategy", rounds),
            ("flwr run, one round after the first", "round", rounds),
            ("  of it the ClientApp handling its messages (--timeline)", "round-handled",
             rounds),
            ("  of it the clients' own compute (inside the actors)", "round-clients", rounds),
            ("  of it the strategy's own work (configure, aggregate)", "round-strategy",
             rounds)]
    print("\n| variant | seconds | ratio to bare (training + evaluation) | ratio to bare "
          "training | ratio to bare (the same work: training + evaluation + the method's own "
          "pass) |\n|---|---|---|---|---|")
    for label, key, scale in rows:
        if key not in sittings[0]:
            continue
        seconds = [s[key] * scale for s in sittings]
        shown = " / ".join(f"{v / scale:.{1 if scale == 1 else 2}f}" for v in seconds)
        if args.flwr_only:
            print(f"| {label} | {shown} | | | |")
            continue
        print(f"| {label} | {shown} | "
              + ratio_range([v / s["bare"] for v, s in zip(seconds, sittings)]) + " | "
              + ratio_range([v / s["bare-train"] for v, s in zip(seconds, sittings)]) + " | "
              + ratio_range([v / s["bare-same"] for v, s in zip(seconds, sittings)]) + " |")
    cap = args.samples_per_client or "all"
    print(f"\nwork ({args.setting}): method {cfg.method}, {cfg.num_clients} clients x {rounds} "
          f"rounds x 1 epoch, samples per client: {cap}, batch {cfg.batch_size}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{args.repeat} sitting(s), seconds per sitting separated by /")


if __name__ == "__main__":
    main()
