"""The folder a cross-check hands to both sides: one run config's partition, written as
ready-made per-client files, so that a reference implementation outside this repository and
our runs train and test on the very same tensors.

The layout is the one ``dataset = "federation"``, ``partition = "files"`` reads
(fedapp/data/files.py, docs/data.md)::

    DIR/config.json     {"num_clients": K, "num_classes": C, "source": {the settings cut}}
    DIR/train/<k>.npz   client k's training data: x (N, C, H, W) float32, already
                        normalised as our loaders normalise it; y (N,) int64
    DIR/test/<k>.npz    client k's local test set, the same arrays
    DIR/public.npz      the public set (x, y), where the source run has one

Floats are read back unchanged, so a run of ours on DIR sees exactly the tensors the source
run's partition gives each client; the peer reads the same arrays. A cross-check script adds
what its method needs (FedMD's alignment sets, HeteroFL's initial global model).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
from common import mean_std, quick_folder, write_generated

from fedapp.cli.run import resolve_settings
from fedapp.config import RunConfig
from fedapp.data import setup
from fedapp.data.partitions import load_client_data
from strategies import load_config


def source_config(preset: str | None, overrides: Mapping[str, Any]) -> RunConfig:
    """The run config of ``fedapp run [preset] --set k=v ...``, validated as a run's."""
    flat, _ = resolve_settings(preset, [], list(overrides.items()))
    return load_config(flat)


def export_federation(cfg: RunConfig, out: Path, source: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``cfg``'s partition (and its public set, if it has one) into ``out``; what
    ``config.json`` says, with each client's sample counts."""
    data, spec = setup.dataset(cfg), setup.partition_spec(cfg)
    for split in ("train", "test"):
        (out / split).mkdir(parents=True, exist_ok=True)
    sizes = []
    for k in range(cfg.num_clients):
        shard = load_client_data(data, spec, k)
        if len(shard.val_y):
            raise SystemExit(f"client {k} has a validation split: export a config with "
                             "val-fraction = 0 (the peer would never see those samples)")
        for split, (x, y) in {"train": (shard.train_x, shard.train_y),
                              "test": (shard.test_x, shard.test_y)}.items():
            np.savez(out / split / f"{k}.npz", x=x.numpy().astype(np.float32),
                     y=y.numpy().astype(np.int64))
        sizes.append({"train": len(shard.train_y), "test": len(shard.test_y)})
    config = {"num_clients": cfg.num_clients, "num_classes": data.num_classes,
              "source": dict(source), "sizes": sizes}
    if cfg.public_source != "none":
        public = setup.public_set(cfg)
        np.savez(out / "public.npz", x=public.x.numpy().astype(np.float32),
                 y=public.y.numpy().astype(np.int64))
        config["public_size"] = len(public)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return config


def read_config(data_dir: Path) -> dict[str, Any]:
    """``config.json`` of an exported folder, with a clear message where there is none."""
    path = data_dir / "config.json"
    if not path.is_file():
        raise SystemExit(f"{data_dir} has no config.json: write the folder first with the "
                         "script's --export (docs/crosscheck.md)")
    return json.loads(path.read_text())


def federation_settings(data_dir: Path, public: bool) -> dict[str, Any]:
    """The settings that make a run of ours read an exported folder."""
    return {"dataset": "federation", "partition": "files", "data-dir": str(data_dir),
            "val-fraction": 0.0,
            **({"public-source": "npz", "public-file": str(data_dir / "public.npz")}
               if public else {"public-source": "none"})}


def peer_result(peer_dir: Path, seed: int) -> dict[str, Any] | None:
    """The peer's ``seed<s>/result.json`` (what its driver or patched code writes), or None
    where that seed has not been run."""
    path = peer_dir / f"seed{seed}" / "result.json"
    return json.loads(path.read_text()) if path.is_file() else None


def cell(values: list[float]) -> str:
    """mean ± std over runs, "(one run)", or "not run yet"."""
    if not values:
        return "not run yet"
    mean, std = mean_std(values)
    return f"{mean:.4f} ± {std:.4f}" if len(values) > 1 else f"{mean:.4f} (one run)"


def main(description: str, rounds: int, out: Path, doc: Path, script: str,
         export: Callable[[Path, list[int], int, bool], None],
         table: Callable[[Path, Path, list[int], int, Path, bool], str]) -> None:
    """A cross-check's three steps: ``--export DIR`` writes the work's folder; the peer runs
    outside (docs/crosscheck.md); ``--data-dir DIR --peer-dir PEER`` runs ours on the folder and
    writes ``table``'s text into the doc between the script's markers (with ``--quick``, a
    pipeline check, into the results folder's quick/ instead, never into docs/)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--export", type=Path, help="write the work's folder here and stop")
    parser.add_argument("--data-dir", type=Path, help="the folder --export wrote")
    parser.add_argument("--peer-dir", type=Path,
                        help="the peer's results: seed<s>/result.json per seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=rounds, help=f"default {rounds}")
    parser.add_argument("--quick", action="store_true",
                        help="pipeline check on small shards; give it to --export and to the "
                        "table step alike")
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--doc", type=Path, default=doc)
    args = parser.parse_args()
    out, doc = args.out.resolve(), args.doc
    if args.quick:
        out = quick_folder(out)
        doc = out / "crosscheck.md"
    if args.export:
        export(args.export.resolve(), args.seeds, args.rounds, args.quick)
        return
    if not args.data_dir or not args.peer_dir:
        parser.error("give --export DIR, or --data-dir and --peer-dir")
    data_dir = args.data_dir.resolve()
    read_config(data_dir)
    text = table(data_dir, args.peer_dir.resolve(), args.seeds, args.rounds, out, args.quick)
    write_generated(doc, script, text)
    print(f"[reproduce] wrote {doc}")
