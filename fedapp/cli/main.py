"""The ``fedapp`` command line: one parser over the run commands (``fedapp.cli.run``), the
comparison of finished runs (``fedapp.cli.compare``) and the deployment steps
(``fedapp.cli.deploy``); running and deploying both build on the Flower process control in
``fedapp.cli.flower``."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from fedapp.cli import compare as compare_command
from fedapp.cli import deploy, run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedapp", description=run.__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="run an experiment through Flower (simulation)")
    run_parser.add_argument("preset", nargs="?", default=None,
                            help="a preset name in conf/ (e.g. smoke) or a .toml path; "
                                 "default: the defaults in pyproject.toml")
    run_parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                            help='override a setting (TOML value: --set method="fedavg")')
    run_parser.add_argument("--output-dir", help="results root (default: ./results)")
    run_parser.add_argument("--verbose", action="store_true", help="show Flower's whole log")
    run_parser.add_argument("--resume", metavar="RUN_DIR",
                            help="continue a run started with checkpoint-every > 0 after its last "
                                 "checkpoint (its own settings, same folder)")
    run_parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                            help="one run per value (per combination, if repeated), all on "
                                 "one SuperLink; fails if any run fails (e.g. --sweep "
                                 "seed=0,1,2)")
    run_parser.add_argument("--ray-address", metavar="HOST:PORT",
                            help="run the virtual clients on this running Ray cluster (as `ray "
                                 "start --head` printed it; default: $RAY_ADDRESS if set, else "
                                 "a private Ray instance on this machine; docs/usage.md)")
    run_parser.set_defaults(func=run.cmd_run)
    compare = sub.add_parser("compare", help="plot and tabulate several finished runs, name "
                             "the training settings that differ between them (and the command "
                             "that opens their TensorBoard event files)")
    compare.add_argument("runs", nargs="+", help="run folders (each with a summary.json)")
    compare.add_argument("--output", default="compare.png", help="plot path")
    compare.set_defaults(func=compare_command.cmd_compare)
    for name, func, what, example in [
            ("settings", run.cmd_settings, "every setting's effective value and where it comes "
             "from (default, the method's recipe, a preset, --set)", 'method="fedhe"'),
            ("methods", run.cmd_methods, "list the methods (with --set method-packages=\"mypkg\": "
             "also your own package's method folders)", 'method-packages="mypkg"')]:
        command = sub.add_parser(name, help=what)
        command.add_argument("preset", nargs="?", default=None,
                             help="a preset name in conf/ or a .toml path")
        command.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                             help=f"a setting as fedapp run takes it (--set {example})")
        if name == "settings":
            command.add_argument(
                "--check", action="store_true",
                help="also apply every check fedapp run makes before it starts: the rules "
                     "across settings and the method's, the data, the partition and the "
                     "models (loads the data and builds the models; trains nothing)")
        command.set_defaults(func=func)
    sub.add_parser("models", help="list the architectures").set_defaults(func=run.cmd_models)
    deploy.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
