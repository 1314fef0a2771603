"""What a killed writer left beside its output, removed by the next one by its exact temporary name."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from flashnext.quant.checkpoint.fsutil.held import HeldDirectory
from flashnext.quant.checkpoint.fsutil.markers import marker_at


def _temporary_names(name: str) -> re.Pattern:
    """flashnext's own temporary names for ``name``, exactly: ``.NAME.partial-PID``,
    ``.NAME.old-PID`` and ``.NAME.tmp-PID`` (not ``.NAME.partial-1x``, nor another output's)."""
    return re.compile(rf"\.{re.escape(name)}\.(?P<kind>partial|old|tmp)-(?P<pid>[1-9][0-9]{{0,9}})")


def writer_gone(pid: int) -> bool:
    """Whether the process that named a temporary file is over (our own earlier attempts are: we
    hold the output's lock). A live one's name is not ours to remove, whatever it looks like."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def remove_leftovers(out: Path, parent: HeldDirectory | None = None) -> Path | None:
    """Remove the temporary siblings of ``out`` that dead writers left, by their exact names: links
    (removing a link changes nothing it points at), files only by their ``.tmp-`` names, directories
    only when they carry flashnext's marker (or are empty). A previous output that a ``--force``
    replace had moved aside (``.OUT.old-PID``) when it was killed is put back when ``out`` is missing;
    returns its path then (only called under the output's lock)."""
    out = Path(out).absolute()
    if parent is None:
        with HeldDirectory.open(out.parent) as held:
            return remove_leftovers(out, held)
    pattern = _temporary_names(out.name)
    set_aside: list[tuple[int, str]] = []
    for name in sorted(os.listdir(parent.fd)):
        m = pattern.fullmatch(name)
        st = parent.lstat(name) if m else None
        if st is None or not writer_gone(int(m["pid"])):
            continue
        if stat.S_ISLNK(st.st_mode) or (stat.S_ISREG(st.st_mode) and m["kind"] == "tmp"):
            os.unlink(name, dir_fd=parent.fd)
        elif stat.S_ISDIR(st.st_mode) and marker_at(parent, name) is not None and m["kind"] == "old":
            set_aside.append((st.st_mtime_ns, name))
        elif stat.S_ISDIR(st.st_mode) and (marker_at(parent, name) is not None or _empty(parent, name)):
            parent.remove_tree(name)
    restored = None
    if set_aside and parent.lstat(out.name) is None:
        newest = max(set_aside)
        set_aside.remove(newest)
        parent.rename(newest[1], out.name)
        restored = out.parent / newest[1]
    for _, name in set_aside:
        parent.remove_tree(name)
    return restored


def _empty(parent: HeldDirectory, name: str) -> bool:
    try:
        with parent.open_directory(name) as d:
            return not os.listdir(d.fd)
    except OSError:
        return False
