"""Scratch directories: what a command needs only while it runs.

They live in the system's temporary folder, and the command removes them when it ends
(:func:`scratch_directory`); the next run removes one whose run was killed first: by the marker
naming the process that made it, once that process is gone.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from flashnext.errors import FlashnextError
from flashnext.quant.checkpoint.fsutil.held import HeldDirectory
from flashnext.quant.checkpoint.fsutil.interrupts import interrupts_held
from flashnext.quant.checkpoint.fsutil.leftovers import writer_gone
from flashnext.quant.checkpoint.fsutil.markers import OUTPUT_MARKER, marker_at, where_pids_count, write_marker


# What each command that keeps scratch calls its directories in the system's temporary folder:
# ``flashnext-KIND-`` and tempfile.mkdtemp's eight random characters. Only names of exactly this
# form, holding flashnext's marker, are ever taken for a dead run's scratch.
SCRATCH_KINDS = ("selftest", "patches", "probes", "upload")
_SCRATCH_NAME = re.compile(rf"flashnext-(?:{'|'.join(SCRATCH_KINDS)})-[a-z0-9_]{{8}}")


def _scratch_abandoned(marker: dict) -> bool:
    """Whether the process that a scratch directory's marker names is gone. A process of another
    host or PID namespace (a temporary folder shared by containers) cannot be looked up from here,
    so it never is; nor is this process's own."""
    pid = marker.get("pid")
    here = where_pids_count()
    return (type(pid) is int and pid > 0 and pid != os.getpid() and all(marker.get(k) == v for k, v in here.items())
            and writer_gone(pid))


def remove_abandoned_scratch(temporary: Path) -> None:
    """Remove from ``temporary`` the scratch directories that runs killed before their cleanup (a
    SIGKILL, a power loss) left: this user's directories named as :data:`SCRATCH_KINDS` say, that
    carry flashnext's marker and whose process is gone. Best effort: a directory another run
    removes first, or one holding what this user cannot remove, is left, and the command goes on."""
    try:
        held = HeldDirectory.open(temporary)
    except FlashnextError:
        return
    with held:
        for name in sorted(os.listdir(held.fd)):
            if not _SCRATCH_NAME.fullmatch(name):
                continue
            st = held.lstat(name)
            if st is None or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            marker = marker_at(held, name)
            if marker is not None and _scratch_abandoned(marker):
                try:
                    held.remove_tree(name)
                except OSError:
                    pass  # what is left waits for the next run; this one's work does not depend on it


@contextmanager
def scratch_directory(kind: str, made_by: str, keep: bool = False) -> Iterator[Path]:
    """A new private directory ``flashnext-KIND-XXXXXXXX`` in the system's temporary folder, for what
    the command ``made_by`` needs only while it runs, removed when the block ends however it ends
    (SIGTERM included: it raises as Ctrl-C does, tools/_common.py). Only SIGKILL or a power loss can
    leave it; so it carries flashnext's marker naming this process, and each new scratch directory
    is made after :func:`remove_abandoned_scratch` has removed those whose process is gone. With
    ``keep`` it stays for the user, its marker removed: no later run takes it for a leftover."""
    if kind not in SCRATCH_KINDS:
        raise ValueError(f"scratch kind {kind!r} is not one of SCRATCH_KINDS")
    temporary = Path(tempfile.gettempdir())
    remove_abandoned_scratch(temporary)
    path = None
    try:
        with interrupts_held():
            path = Path(tempfile.mkdtemp(prefix=f"flashnext-{kind}-", dir=temporary))
        write_marker(path, made_by, pid=os.getpid())
        yield path
    finally:
        if path is not None and keep:
            (path / OUTPUT_MARKER).unlink(missing_ok=True)
        elif path is not None:
            shutil.rmtree(path, ignore_errors=True)
