"""A watchdog between ``fedapp`` and the SuperLink it starts: nothing outlives the run.

``python -m fedapp.cli.watchdog -- CMD ...`` starts CMD as its child, makes itself the *child
subreaper* of everything CMD spawns (Linux ``PR_SET_CHILD_SUBREAPER``: a process whose parent
dies is re-parented to the watchdog rather than to init, so that every descendant can always be
found), and waits. It ends every descendant — SIGTERM, then SIGKILL after ``GRACE`` seconds —
and exits with CMD's status when

- it gets SIGTERM or SIGINT (``fedapp`` stopping its SuperLink),
- its parent is gone (``fedapp`` killed, even with SIGKILL, which no handler can catch: the
  watchdog is then re-parented, and ``os.getppid()`` changes), or
- CMD exits (whatever it left behind goes with it).

Why it is needed: Flower's SuperLink starts the SuperExec, and the SuperExec the simulation
(Ray and its workers), each in a session of its own, and none of them ends when its parent
dies. Killing the SuperLink's process group does not reach them; this does.

Standard library only, so that it starts in a blink and holds a few MB.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
# SIGTERM first, SIGKILL after this long: less than the 10 s ``stop_process_group`` gives the
# watchdog's own group before it kills it (and with it the watchdog, mid-cleanup).
GRACE = 5.0
POLL = 0.2


def descendants(root: int) -> list[int]:
    """Live descendants of ``root`` (zombies excluded), read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # Fields after the command name "(...)": state, ppid, ...
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue  # exited meanwhile
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _reap() -> None:
    """Collect every exited child (as a subreaper, orphans' exits come to us too)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_descendants(grace: float = GRACE) -> None:
    """SIGTERM every descendant (also those that appear meanwhile), SIGKILL whatever is left
    after ``grace`` seconds, and return once none is left (or 5 s after the SIGKILL)."""
    me = os.getpid()
    termed: set[int] = set()
    start = time.monotonic()
    while time.monotonic() < start + grace + 5.0:
        _reap()
        pids = descendants(me)
        if not pids:
            return
        late = time.monotonic() >= start + grace
        for pid in pids:
            if late or pid not in termed:
                try:
                    os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
                except ProcessLookupError:
                    pass
                termed.add(pid)
        time.sleep(0.05)


def _become_subreaper() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: descendants still found while their parents live


def main(argv: Sequence[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: python -m fedapp.cli.watchdog -- CMD [ARG ...]", file=sys.stderr)
        return 2
    cmd = list(argv[argv.index("--") + 1:])
    parent = os.getppid()
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    _become_subreaper()
    child = subprocess.Popen(cmd)
    while not stop and os.getppid() == parent and child.poll() is None:
        time.sleep(POLL)
    end_descendants()
    child.poll()
    return child.returncode if child.returncode is not None and child.returncode >= 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
