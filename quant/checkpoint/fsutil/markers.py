"""flashnext's marker in what it made, and the one rule of ``--force`` it vouches for.

``--force`` replaces only what flashnext made, and only the same command's: a directory holding
:data:`OUTPUT_MARKER` whose ``made_by`` is that command (:func:`require_flashnext_output`).
"""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

from flashnext.errors import FlashnextError, named
from flashnext.quant.checkpoint.fsutil.held import HeldDirectory, write_new
from flashnext.quant.records.inputs import open_regular


OUTPUT_MARKER = ".flashnext-output.json"
MARKER_LIMIT = 1 << 16  # a marker is a few lines; what is longer is read only this far (and is no marker)


def _parse_marker(text: str) -> dict | None:
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) and isinstance(data.get("made_by"), str) else None


def read_output_marker(directory: Path) -> dict | None:
    """The marker of a directory flashnext made, or None."""
    marker = Path(directory) / OUTPUT_MARKER
    try:
        # Opened once, never through a link, and refused unless regular: a marker swapped for a
        # FIFO after a check would block the read.
        with open_regular(marker, "flashnext's output marker", follow_symlinks=False) as f:
            return _parse_marker(f.read(MARKER_LIMIT).decode())
    except (FlashnextError, OSError, ValueError):
        return None


def marker_at(parent: HeldDirectory, name: str) -> dict | None:
    """The marker of the directory ``name`` in ``parent`` (None for a link, a file, or a directory
    flashnext did not make)."""
    try:
        directory = parent.open_directory(name)
    except OSError:
        return None
    try:
        fd = os.open(OUTPUT_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory.fd)
    except OSError:
        return None
    finally:
        directory.close()
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        try:
            return _parse_marker(f.read(MARKER_LIMIT).decode())
        except (OSError, ValueError):
            return None


def refuse_unless_replaceable(out: Path, marker: dict | None, made_by: str | None) -> None:
    """The one rule of ``--force``, given the marker of the existing ``out`` (None: no directory
    flashnext made): it replaces only what flashnext made, and of that only what the same command
    (``made_by``) made. One command's ``--force`` never takes another's output: a snapshot
    ``demo-checkpoint`` wrote is not the selftest's report to replace, nor an overlay a view.
    ``made_by`` None: the command is not known yet (an early check), only flashnext's marker is."""
    if marker is None:
        _not_flashnexts(out)
    if made_by is not None and marker["made_by"] != made_by:
        # The marker is a file anyone could edit: its text is quoted, and only so far.
        raise FlashnextError(f"{out} was made by {marker['made_by'][:80]!r}, not by {made_by}; {named('force')} only "
                             f"replaces {made_by}'s own output: remove it yourself or choose another {named('out')}")


def require_flashnext_output(out: Path, made_by: str | None) -> None:
    """``--force`` may replace ``out`` only when it is a directory the command ``made_by`` made."""
    marker = None if out.is_symlink() or not out.is_dir() else read_output_marker(out)
    refuse_unless_replaceable(out, marker, made_by)


def already_exists(out: Path, how: str = "") -> FlashnextError:
    return FlashnextError(f"{out} already exists{how}: choose another {named('out')} or pass {named('force')}")


def _not_flashnexts(out: Path):
    raise FlashnextError(f"{out} exists and was not made by flashnext (no {OUTPUT_MARKER}); {named('force')} only "
                         f"replaces flashnext's own output: remove it yourself or choose another {named('out')}")


def where_pids_count() -> dict:
    """Where a process id names one process: this host and this PID namespace (a container numbers
    its processes apart from the host's, and a temporary folder can be shared between them)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = None
    return {"host": socket.gethostname(), "pid_namespace": namespace}


def write_marker(directory: Path, made_by: str, pid: int | None = None) -> None:
    """Mark ``directory`` as made by the command ``made_by``. ``pid``: the process whose scratch it
    is (:func:`scratch_directory`), and where that id counts, so that a later run can tell when
    that process is gone."""
    from flashnext import __version__

    marker = {"made_by": made_by, "flashnext_version": __version__}
    if pid is not None:
        marker |= {"pid": pid, **where_pids_count()}
    write_new(Path(directory) / OUTPUT_MARKER, (json.dumps(marker) + "\n").encode())
