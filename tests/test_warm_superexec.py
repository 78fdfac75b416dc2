"""The forking SuperExec executor (fedapp/cli/warm_superexec.py): each ClientApp task runs in
a child forked from the warm process, its exit status is kept, and Flower's SuperExec uses it
once installed. A real SuperNode served by it: tests/test_deploy.py."""

import os
import sys
import time

import pytest

from flwr.supercore.constant import ExecutorType, TaskType  # noqa: E402
from flwr.supercore.superexec import run_superexec  # noqa: E402
from flwr.supercore.superexec.executor.types import ExecutionSpec  # noqa: E402

from fedapp.cli import warm_superexec  # noqa: E402
from fedapp.cli.warm_superexec import ForkExecutor  # noqa: E402


def spec(task_id: int, task_type=TaskType.CLIENT_APP, token: str = "ab" * 8) -> ExecutionSpec:
    return ExecutionSpec(task_type=task_type, runtime_api_address="127.0.0.1:1", token=token,
                         insecure=True, root_certificates_path=None,
                         runtime_dependency_install=False, parent_pid=None,
                         suppress_output=False, task_id=task_id)


def reap(executor: ForkExecutor, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while executor.children and time.monotonic() < deadline:
        executor.reconcile()
        time.sleep(0.02)
    assert not executor.children, "a forked ClientApp did not exit"


def test_each_task_runs_in_a_forked_child_with_the_preloaded_modules(tmp_path):
    warm_superexec.preload(("json",))

    def target(s):
        # In the child: another process, which has what the parent imported, and the task.
        (tmp_path / f"{s.task_id}").write_text(
            f"{os.getpid()} {os.getppid()} {'json' in sys.modules} {s.token}")
        if s.task_id == 2:
            raise SystemExit(3)
        if s.task_id == 3:
            raise RuntimeError("the ClientApp crashed")

    executor = ForkExecutor(target)
    for task_id in (1, 2, 3):
        assert executor.launch(spec(task_id)).status == "accepted"
    reap(executor)
    assert executor.exit_codes == {"1": 0, "2": 3, "3": 1}
    for task_id in (1, 2, 3):
        pid, parent, preloaded, token = (tmp_path / str(task_id)).read_text().split()
        assert int(pid) != os.getpid() and int(parent) == os.getpid()
        assert preloaded == "True" and token == "ab" * 8


def test_other_task_types_go_to_flowers_subprocess_executor():
    executor = ForkExecutor(lambda s: pytest.fail("forked a task that is no ClientApp"))
    launched = []
    executor.fallback.launch = launched.append
    executor.launch(spec(5, TaskType.SERVER_APP))
    assert [s.task_id for s in launched] == [5] and not executor.children


def test_close_stops_running_children():
    executor = ForkExecutor(lambda s: time.sleep(600))
    executor.launch(spec(9))
    (pid,) = executor.children
    executor.close()
    assert not executor.children
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_install_makes_flowers_superexec_fork(monkeypatch):
    from flwr.supernode.runtime import run_clientapp
    monkeypatch.setattr(run_superexec, "get_executor", run_superexec.get_executor)
    monkeypatch.setattr(run_clientapp, "install_from_fab", run_clientapp.install_from_fab)
    assert warm_superexec.install()
    assert isinstance(run_superexec.get_executor(ExecutorType.SUBPROCESS, None, insecure=True,
                                                 root_certificates_path=None), ForkExecutor)


def test_a_fab_is_installed_once_per_node(tmp_path, monkeypatch):
    # Flower's install (here a stand-in that makes the app's folder) runs for a FAB not seen
    # before, or whose folder is gone; the same bytes again get the folder without it.
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    calls = []

    def flower_install(fab, install_dir=None, skip_prompt=False):
        calls.append(fab)
        folder = tmp_path / "apps" / f"app.{len(calls)}"
        folder.mkdir(parents=True)
        return folder

    install = warm_superexec.install_fab_once(flower_install)
    first = install(b"fab one", skip_prompt=True)
    assert install(b"fab one", skip_prompt=True) == first and calls == [b"fab one"]
    assert install(b"fab two", skip_prompt=True) != first and len(calls) == 2
    first.rmdir()
    assert install(b"fab one", skip_prompt=True).is_dir() and len(calls) == 3
    # Another folder or a prompt: Flower's own install every time.
    install(b"fab one", tmp_path / "elsewhere", True)
    install(b"fab one")
    assert len(calls) == 5


def test_install_makes_the_clientapp_install_a_fab_once(monkeypatch):
    from flwr.cli.install import install_from_fab as flowers
    from flwr.supernode.runtime import run_clientapp
    monkeypatch.setattr(run_superexec, "get_executor", run_superexec.get_executor)
    monkeypatch.setattr(run_clientapp, "install_from_fab", flowers)
    assert warm_superexec.install()
    once = run_clientapp.install_from_fab
    assert once is not flowers and once.installs_once
    assert warm_superexec.install() and run_clientapp.install_from_fab is once  # not twice
