"""The ``fedapp`` command line: one parser over the run and compare commands (``fedapp.cli``)
and the deployment steps (``fedapp.deploy``), which both build on ``fedapp.cli``'s helpers."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from fedapp import cli, deploy


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedapp", description=cli.__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run an experiment through Flower (simulation)")
    run.add_argument("preset", nargs="?", default=None,
                     help="a preset name in conf/ (e.g. smoke) or a .toml path; "
                          "default: the defaults in pyproject.toml")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help='override a setting (TOML value: --set method="fedavg")')
    run.add_argument("--output-dir", help="results root (default: ./results)")
    run.add_argument("--verbose", action="store_true", help="show Flower's whole log")
    run.add_argument("--resume", metavar="RUN_DIR",
                     help="continue a run started with checkpoint-every > 0 after its last "
                          "checkpoint (its own settings, same folder)")
    run.set_defaults(func=cli.cmd_run)
    compare = sub.add_parser("compare", help="plot and tabulate several finished runs")
    compare.add_argument("runs", nargs="+", help="run folders (each with a summary.json)")
    compare.add_argument("--output", default="compare.png", help="plot path")
    compare.set_defaults(func=cli.cmd_compare)
    sub.add_parser("settings", help="list every setting with its default").set_defaults(
        func=cli.cmd_settings)
    sub.add_parser("methods", help="list the methods").set_defaults(func=cli.cmd_methods)
    sub.add_parser("models", help="list the architectures").set_defaults(func=cli.cmd_models)
    deploy.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
