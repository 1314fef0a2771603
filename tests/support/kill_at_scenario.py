"""Run one flashnext command and kill it at its Nth file-system event: ``python kill_at_scenario.py
SIGNAL N COUNT_FILE -- ARGS...`` (SIGNAL ``KILL`` or ``TERM``; N 0: never, only count). Run by
tests/hostile/test_hostile_kills.py.

An event is a call that changes what a later run finds on disk or marks the progress of a write:
opening a file for writing or creating, ``fsync``, ``ftruncate``, ``pwrite``, ``mkdir``, ``rmdir``,
``unlink``, ``rename``, ``replace``, ``link``, ``symlink``, and a progress bar's ``update`` (a
chunk of data written or read). At event N the process signals itself before the call is made;
SIGKILL ends it there, SIGTERM goes through flashnext's own handler (cleanups, exit 143). The
number of events the run reached is written to COUNT_FILE at exit (for N 0).
"""
import atexit
import os
import signal
import sys

import numpy  # noqa: F401  (preloaded by the fork server, as torch is)
import torch  # noqa: F401

sig, target, count_file = getattr(signal, "SIG" + sys.argv[1]), int(sys.argv[2]), sys.argv[3]
args = sys.argv[5:]
events = 0
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def event() -> None:
    global events
    events += 1
    if events == target:
        os.kill(os.getpid(), sig)


def hooked(function, when=lambda *a, **k: True):
    def call(*a, **k):
        if when(*a, **k):
            event()
        return function(*a, **k)

    return call


for name in ("fsync", "ftruncate", "pwrite", "mkdir", "rmdir", "unlink", "rename", "replace", "link", "symlink"):
    setattr(os, name, hooked(getattr(os, name)))
os.open = hooked(os.open, lambda path, flags, *a, **k: bool(flags & WRITE_FLAGS))

from flashnext.progress import Progress  # noqa: E402

Progress.update = hooked(Progress.update)
atexit.register(lambda: open(count_file, "w").write(str(events)))

from flashnext.tools.cli import main  # noqa: E402

sys.argv = ["flashnext", *args]
main()
