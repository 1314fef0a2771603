"""Disk space: checked before a long write starts, and named when a write finds the disk full."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from flashnext.errors import FlashnextError
from flashnext.sizes import format_size


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest existing parent: where its free space is counted."""
    path = Path(path).absolute()
    return next(p for p in (path, *path.parents) if p.exists())


def check_free_space(directory: Path, needed: int, what: str) -> None:
    """Refuse to start when ``directory``'s filesystem has less than ``needed`` bytes free."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise FlashnextError(
            f"not enough disk space for {what}: need {format_size(needed)} in {directory}, "
            f"{format_size(free)} free")


# A full disk (or quota) is met by a write: through a descriptor (pwrite, fsync, a file object) the
# error names no file, and through the held parent only a name relative to it.
_FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


def name_the_full_disk(error: BaseException, out: Path) -> None:
    """Make a full disk met while ``out`` was written name where: the output, or the name beside it
    (relative to its held parent) that the write was making, so that its one line says which disk."""
    if isinstance(error, OSError) and error.errno in _FULL_DISK:
        name = error.filename
        if name is None:
            error.filename = str(out)
        elif isinstance(name, str) and not os.path.isabs(name):
            error.filename = str(out.parent / name)
