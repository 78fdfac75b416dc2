"""Seconds per round and GPU memory per client on a GPU, at several ``client-num-gpus``.

``client-num-gpus = f`` gives every virtual client (a Ray actor) a share f of one GPU, so Ray runs
1/f clients at once on it. For each work and each fraction this runs ``fedapp run`` for a few
rounds and reads back from ``rounds.jsonl``:

- round 1's seconds (it also starts the Ray actors and their CUDA contexts) and the mean of the
  later rounds;
- the device each client trained on (every client records it, ``devices``), so a run that fell
  back to the CPU shows;
- the most GPU memory one client's training held (``gpu_peak_mib``: PyTorch's peak of allocated
  memory in that message, per architecture), and the whole GPU's peak as ``nvidia-smi`` reads it
  once a second (this also holds each actor's CUDA context);
- the per-client mean accuracy after the last round.

``--repeat-seed`` runs the first fraction once more with the same seed and says whether every
client's accuracy after every round came out the same (determinism on CUDA, as measured).

Works: the FedClassAvg paper-backbones preset (ResNet-18, ShuffleNetV2, GoogLeNet, small AlexNet;
20 clients, Dirichlet 0.5, the whole of Fashion-MNIST) and FedGH with the zoo's ResNets
(resnet10..26, the same split). ``--fractions 0`` runs a work on the CPU instead.

    python benchmarks/gpu.py --data-dir /path/to/fashion-mnist --rounds 3 --fractions 1,0.5,0.25
    python benchmarks/gpu.py --works fedgh-resnets --fractions 0 --rounds 1 --max-samples 300

Run nothing else meanwhile: the times are the point.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fedapp.cli.run import toml_value  # noqa: E402

FEDAPP = [sys.executable, "-m", "fedapp.cli.main"]
SPLIT = {"num-clients": 20, "partition": "dirichlet", "dirichlet-alpha": 0.5,
         "max-samples-per-client": 0}
# name -> (preset, settings over it)
WORKS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "fedclassavg-paper-backbones": ("conf/fedclassavg-paper-backbones.toml", {}),
    "fedgh-resnets": (None, {"method": "fedgh", "dataset": "fmnist", **SPLIT,
                             "arch-mix": "resnet10,resnet14,resnet18,resnet22,resnet26"}),
}


class GpuMemorySampler(threading.Thread):
    """The GPU's used memory (MiB, all processes) once a second, by ``nvidia-smi``; its peak."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(1.0):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                                      "--format=csv,noheader,nounits"], capture_output=True,
                                     text=True, timeout=10).stdout
                self.peak = max([self.peak, *(int(v) for v in out.split() if v.isdigit())])
            except (OSError, subprocess.SubprocessError):
                return

    def stop(self) -> None:
        self._halt.set()
        self.join()


def one_run(work: str, fraction: float, args: argparse.Namespace, out: Path, name: str
            ) -> dict[str, Any]:
    preset, settings = WORKS[work]
    settings = {**settings, "num-server-rounds": args.rounds, "seed": args.seed,
                "client-num-gpus": fraction, "run-name": name,
                **({"data-dir": str(args.data_dir)} if args.data_dir else {}),
                **({"max-samples-per-client": args.max_samples} if args.max_samples else {})}
    cmd = [*FEDAPP, "run", *([str(ROOT / preset)] if preset else []),
           "--output-dir", str(out)]
    for key, value in settings.items():
        cmd += ["--set", f"{key}={toml_value(value)}"]
    sampler = GpuMemorySampler() if shutil.which("nvidia-smi") else None
    if sampler:
        sampler.start()
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    end_to_end = time.perf_counter() - start
    if sampler:
        sampler.stop()
    if proc.returncode != 0:
        print(proc.stdout[-6000:], file=sys.stderr)
        raise SystemExit(f"{name}: fedapp run failed with exit status {proc.returncode}")
    run_dir = out / name
    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    archs = json.loads((run_dir / "partition.json").read_text())["architectures"]
    peaks: dict[str, float] = {}
    for record in rounds:
        for pid, mib in record.get("gpu_peak_mib", {}).items():
            peaks[archs[int(pid)]] = max(peaks.get(archs[int(pid)], 0.0), mib)
    later = [r["seconds"] for r in rounds[1:]]
    return {"work": work, "fraction": fraction, "round1": rounds[0]["seconds"],
            "later": sum(later) / len(later) if later else float("nan"),
            "devices": sorted({d for r in rounds for d in r.get("devices", {}).values()}),
            "peak_mib": peaks, "gpu_peak_mib": sampler.peak if sampler else None,
            "accuracy": rounds[-1]["accuracy_mean"], "end_to_end": end_to_end,
            "history": [r["per_client"] for r in rounds]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--works", default=",".join(WORKS),
                        help=f"comma-separated, of: {', '.join(WORKS)}")
    parser.add_argument("--fractions", default="1,0.5,0.25",
                        help="client-num-gpus values, one run each (0: on the CPU)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="a folder with Fashion-MNIST's four IDX files (default: the "
                             "Debian package's)")
    parser.add_argument("--max-samples", type=int, default=0,
                        help="cap each client's training samples (default: all)")
    parser.add_argument("--repeat-seed", action="store_true",
                        help="run the first fraction of the first work again with the same "
                             "seed and compare every client's accuracy after every round")
    parser.add_argument("--output-dir", default="",
                        help="where the runs go (default: a fresh temporary folder)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    unknown = set(args.works.split(",")) - set(WORKS)
    if unknown:
        parser.error(f"unknown work(s) {', '.join(sorted(unknown))}; known: {', '.join(WORKS)}")
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="fedapp-gpu-")).resolve()
    rows = []
    for work in args.works.split(","):
        for fraction in (float(f) for f in args.fractions.split(",")):
            rows.append(one_run(work, fraction, args, out, f"{work}-gpus{fraction:g}"))
            print(f"[gpu] {json.dumps({k: v for k, v in rows[-1].items() if k != 'history'})}",
                  flush=True)
    repeat = None
    if args.repeat_seed:
        first = rows[0]
        again = one_run(first["work"], first["fraction"], args, out,
                        f"{first['work']}-gpus{first['fraction']:g}-again")
        pairs = [(before[pid], after[pid])
                 for before, after in zip(first["history"], again["history"]) for pid in before]
        repeat = (first["work"], first["fraction"], first["history"] == again["history"],
                  max(abs(a - b) for a, b in pairs))
    print(f"\n{args.rounds} rounds, seed {args.seed}"
          + (f", at most {args.max_samples} samples per client" if args.max_samples else "")
          + f"; runs in {out}\n")
    print("| work | client-num-gpus | clients at once | round 1 s | later rounds s | "
          "devices | peak GPU memory of one client's training (MiB) | GPU's peak (MiB, "
          "nvidia-smi) | accuracy | end to end s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        at_once = f"{int(1 / r['fraction'])}" if r["fraction"] else "CPU"
        peaks = ", ".join(f"{a} {m:.0f}" for a, m in sorted(r["peak_mib"].items())) or "—"
        print(f"| {r['work']} | {r['fraction']:g} | {at_once} | {r['round1']:.1f} | "
              f"{r['later']:.1f} | {', '.join(r['devices'])} | {peaks} | "
              f"{r['gpu_peak_mib'] if r['gpu_peak_mib'] is not None else '—'} | "
              f"{r['accuracy']:.4f} | {r['end_to_end']:.0f} |")
    if repeat:
        work, fraction, same, diff = repeat
        print(f"\nSame seed twice ({work}, client-num-gpus {fraction:g}): every client's "
              f"accuracy after every round {'identical' if same else 'differs'} "
              f"(largest difference {diff:.6f}).")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "repeat": repeat}, indent=1))


if __name__ == "__main__":
    main()
