"""A SuperExec whose ClientApp processes start warm: ``flower-superexec`` with a forking executor.

A SuperNode hands every message it receives to a ClientApp process that it does not run itself:
a SuperExec asks the node's Runtime API for work and starts the process. Flower 1.41's SuperExec
starts a fresh ``flwr-clientapp`` interpreter for every message (its subprocess executor), which
then imports torch, torchvision, Flower and the data libraries before it reads the message: 5 to
10 seconds on a 2-core machine, more than a small method's whole local training. Flower's
other executor, Kubernetes, keeps warm *pods*, not processes.

This module runs Flower's own SuperExec (its argument parsing, its polling loop, its task
handling) with one difference: the executor. :class:`ForkExecutor` imports the heavy libraries
once, in this process, and forks a child per message; the child runs Flower's own
``run_clientapp`` (what ``flwr-clientapp --token`` runs) and exits. A message therefore costs a
``fork`` instead of an interpreter start. Nothing of the app is imported before the fork: the
child loads the ClientApp from the run's FAB as ``flwr-clientapp`` does, so a new FAB version
is picked up by the next message. Torch is imported but never run in this process, so its
thread pools are created in each child after the fork (forking a process whose OpenMP pool
exists is what breaks).

It also polls for work every 0.05 s instead of Flower's 1 s (``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``,
which still wins when set). Other Flower releases keep Flower's subprocess executor: the executor
interface and ``run_clientapp``'s signature are 1.41's.

``fedapp deploy supernode`` starts it beside ``flower-supernode --isolation process``; by hand::

    flower-supernode --isolation process --port 9094 ...
    python -m fedapp.cli.warm_superexec --insecure --runtime-api-address 127.0.0.1:9094 \
        --parent-pid <the SuperNode's pid>
"""

from __future__ import annotations

import hashlib
import importlib
import os
import signal
import sys
import traceback
from typing import Callable

VERSION = "1.41.0"  # the Flower release whose executor interface this one implements
POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
POLL_SECONDS = "0.05"
KEEP_EXIT_CODES = 1000
INSTALLED_FABS = "fedapp-installed-fabs"  # under the node's FLWR_HOME: FABs installed, by SHA-256
# What a ClientApp of this project imports that costs seconds; each is imported if installed.
# torch._dynamo (with sympy) is what torch imports at the first optimizer step.
PRELOAD = ("numpy", "torch", "torch._dynamo", "torch.optim", "torchvision", "datasets",
           "flwr_datasets", "flwr.client", "flwr.clientapp", "flwr.server",
           "flwr.supernode.runtime.run_clientapp")


def preload(names=PRELOAD) -> list[str]:
    """Import the heavy libraries a ClientApp needs; the names imported."""
    done = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        done.append(name)
    return done


def _run_clientapp(spec) -> None:
    """What ``flwr-clientapp --token ...`` runs for ``spec`` (flwr 1.41)."""
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    from fedapp.runtime import timeline

    marks = _trace_clientapp() if timeline.enabled() else None
    try:
        run_clientapp(
            runtime_api_address=spec.runtime_api_address,
            token=spec.token,
            insecure=spec.insecure,
            certificates=validate_and_resolve_root_certificates(spec.root_certificates_path,
                                                                spec.insecure),
            parent_pid=spec.parent_pid,
            runtime_dependency_install=spec.runtime_dependency_install,
        )
    finally:
        if marks is not None:
            timeline.write("clientapp", **marks, exited=timeline.now())


def _trace_clientapp() -> dict:
    """Time the steps of Flower's ``run_clientapp`` in this (forked, so private) process: wrap
    the functions it calls, by their names in its module. The marks that
    ``fedapp.runtime.timeline`` describes, filled in as the steps end."""
    from flwr.supernode.runtime import run_clientapp as flower

    from fedapp.runtime.timeline import now
    marks = {"forked": now()}

    def after(name, step, note=None, before=None):
        def timed(*args, **kwargs):
            if before is not None:
                marks[before] = now()
            result = step(*args, **kwargs)
            marks[name] = now()
            if note is not None:
                note(result)
            return result
        return timed

    def loader(*args, **kwargs):
        load = flower_get_loader(*args, **kwargs)

        def timed_load(*a, **k):
            app = load(*a, **k)
            marks["loaded"] = now()
            return after("handled", app)
        return timed_load

    flower_get_loader = flower.get_load_client_app_fn
    flower.pull_task_input = after("pulled", flower.pull_task_input, before="connected",
                                   note=lambda r: marks.update(id=r[0].metadata.message_id))
    flower.pull_and_inflate_object_from_tree = after(
        "objects", flower.pull_and_inflate_object_from_tree, before="listed")
    flower.install_from_fab = after("installed", flower.install_from_fab)
    flower.get_load_client_app_fn = loader
    flower.push_message = after("pushed", flower.push_message)
    return marks


class ForkExecutor:
    """Flower 1.41's executor interface; a ClientApp task runs in a child forked from here.

    Other task types (a SuperNode only ever asks for ClientApps) go to Flower's subprocess
    executor. ``target(spec)`` is what the child runs (``run_clientapp`` unless a test says
    otherwise); its exit status is the child's."""

    def __init__(self, target: Callable = _run_clientapp):
        from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

        self.target = target
        self.fallback = SubprocessExecutor()
        self.children: dict[int, str] = {}  # pid -> task id, until reaped
        # task id -> exit status of its child, for the latest KEEP_EXIT_CODES tasks (a SuperNode
        # lives for many messages; the statuses are for inspection, not a growing log)
        self.exit_codes: dict[str, int] = {}

    def get_eligible_capacity(self, supported_task_types, *, insecure=False,
                              root_certificates_path=None):
        return self.fallback.get_eligible_capacity(
            supported_task_types, insecure=insecure,
            root_certificates_path=root_certificates_path)

    def wait_for_capacity(self, task_type=None, *, fab_hash=None, insecure=False,
                          root_certificates_path=None) -> None:
        """Forking has no capacity gate."""

    def launch(self, spec):
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor.types import LaunchResult

        if spec.task_type != TaskType.CLIENT_APP:
            return self.fallback.launch(spec)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: become the ClientApp, never return into the SuperExec loop
            code = 1
            try:
                # The SuperExec's handlers close *its* connections; the child's are its own.
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                if spec.suppress_output:
                    devnull = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(devnull, 1)
                    os.dup2(devnull, 2)
                self.target(spec)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # noqa: BLE001 - report it and exit non-zero
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self.children[pid] = str(spec.task_id)
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        """Reap the children that have exited (called by the SuperExec loop each poll)."""
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                self.exit_codes[self.children.pop(pid)] = os.waitstatus_to_exitcode(status)
                if len(self.exit_codes) > KEEP_EXIT_CODES:
                    del self.exit_codes[next(iter(self.exit_codes))]  # the oldest

    def close(self) -> None:
        """Stop the children still running (their SuperNode is going away) and reap them."""
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGTERM)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.children.pop(pid, None)


def install_fab_once(install_from_fab: Callable) -> Callable:
    """Flower's ``install_from_fab`` as ``run_clientapp`` calls it (the FAB's bytes, its default
    folder, no prompt), remembering what it installed: Flower extracts the whole FAB into a
    temporary folder and checks the hash of every file in it for every message, then finds the
    app's folder already there and returns it (0.04-0.07 s of a message on 2 cores). A FAB whose
    bytes have the same SHA-256 as one installed before is the same FAB, so its folder is
    returned at once. What was installed is noted under ``FLWR_HOME`` after Flower's install
    returned, so an interrupted install is never taken for a finished one."""

    def installed_once(fab_file, install_dir=None, skip_prompt=False):
        if not (isinstance(fab_file, bytes) and install_dir is None and skip_prompt):
            return install_from_fab(fab_file, install_dir, skip_prompt)
        from pathlib import Path

        from flwr.supercore.utils import get_flwr_home
        note = get_flwr_home() / INSTALLED_FABS / hashlib.sha256(fab_file).hexdigest()
        try:
            path = Path(note.read_text())
            if path.is_dir():
                return path
        except OSError:
            pass
        path = install_from_fab(fab_file, install_dir, skip_prompt)
        note.parent.mkdir(parents=True, exist_ok=True)
        partial = note.with_name(f"{note.name}.{os.getpid()}")
        partial.write_text(str(path))
        os.replace(partial, note)  # whole or absent, whichever ClientApp reads it
        return path
    installed_once.installs_once = True
    return installed_once


def install() -> bool:
    """Make Flower's SuperExec in this process use :class:`ForkExecutor` for the subprocess
    executor type, and its ClientApps install a FAB once (:func:`install_fab_once`), on the
    Flower release it was written for only. Returns whether it did."""
    import flwr
    from flwr.supercore.constant import ExecutorType
    from flwr.supercore.superexec import run_superexec
    from flwr.supernode.runtime import run_clientapp

    if flwr.__version__ != VERSION:
        return False
    if not getattr(run_clientapp.install_from_fab, "installs_once", False):
        run_clientapp.install_from_fab = install_fab_once(run_clientapp.install_from_fab)
    flower_get_executor = run_superexec.get_executor

    def get_executor(executor_type, executor_config=None, **kwargs):
        if executor_type == ExecutorType.SUBPROCESS:
            return ForkExecutor()
        return flower_get_executor(executor_type, executor_config, **kwargs)

    run_superexec.get_executor = get_executor
    return True


def main() -> None:
    os.environ.setdefault(POLL_ENV, POLL_SECONDS)
    if install():
        preload()
        from fedapp.runtime.object_pulls import (NODE_LOCAL_CAP_SECONDS,
                                                 NODE_LOCAL_PULL_SECONDS, prompt_object_pulls)
        prompt_object_pulls(NODE_LOCAL_PULL_SECONDS, NODE_LOCAL_CAP_SECONDS)
    else:
        import flwr
        print(f"fedapp: flwr {flwr.__version__} is not {VERSION}; its own SuperExec starts "
              "a fresh ClientApp process for each message", file=sys.stderr, flush=True)
    from flwr.supercore.cli import flower_superexec

    sys.argv[0] = "flower-superexec"
    flower_superexec()


if __name__ == "__main__":
    main()
