"""Opening the files flashnext reads: regular files only, and a file rewritten while read is noticed.

A FIFO or a device named where an input file belongs would block ``open()`` until some writer
appears, or stream forever; so every reader opens through :func:`open_regular`, which opens with
``O_NONBLOCK`` (opening a FIFO then returns at once instead of waiting for a writer), checks with
``fstat`` that what it opened is a regular file, and refuses anything else in one line.

A source that someone rewrites while flashnext reads it would mix two versions into one output.
:class:`FileIdentity` is what ``fstat`` says at open (device, inode, size, mtime in ns); a reader
that compares it again after reading, and a writer that compares it again before renaming its
output into place (:func:`check_unchanged`), turn such a rewrite into one line and no output. A
rewrite that keeps the inode, the size and the mtime (the same clock tick) is not seen: the clock's
granularity is the limit of what a ``stat`` can tell.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from flashnext.errors import FlashnextError

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


@dataclass(frozen=True)
class FileIdentity:
    """Which file, and which version of it: what a rewrite or a replacement changes."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileIdentity":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    @classmethod
    def of_open(cls, f: BinaryIO | int) -> "FileIdentity":
        return cls.of(os.fstat(f if isinstance(f, int) else f.fileno()))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: Path, what: str, follow_symlinks: bool = True, buffering: int = -1) -> BinaryIO:
    """``path`` opened for reading in binary, refused unless it is a regular file (``what`` it is
    meant to be, for the message). A directory raises :class:`IsADirectoryError`, as ``open()``
    does, so callers keep their own message for it; a missing file raises
    :class:`FileNotFoundError`. ``follow_symlinks=False`` refuses a symbolic link (for files that
    flashnext itself made, which are never links; a snapshot's files are links in the Hugging Face
    cache layout, so inputs follow them)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:
            raise FlashnextError(f"{path}: is a symbolic link, expected {what} that flashnext made; "
                                 "refusing to follow it") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(mode):
            raise FlashnextError(f"{path}: is {_kind(mode)}, not a regular file; expected {what} "
                                 "(flashnext reads inputs only from regular files)")
        # Reads of a regular file never block, but a later fcntl-aware reader should see plain flags.
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def read_regular_bytes(path: Path, what: str, follow_symlinks: bool = True) -> bytes:
    """The whole content of the regular file ``path``, refused if it changed while it was read."""
    return read_regular_version(path, what, follow_symlinks)[0]


def read_regular_version(path: Path, what: str, follow_symlinks: bool = True,
                         max_bytes: int | None = None) -> tuple[bytes, FileIdentity]:
    """:func:`read_regular_bytes`, and the version of the file that was read: what a writer passes
    to :func:`check_unchanged` before renaming an output made from it. A file of more than
    ``max_bytes`` is refused before a byte is read, and no more than that is ever read (one that
    grows meanwhile is a rewrite, which :func:`check_still` refuses)."""
    with open_regular(path, what, follow_symlinks) as f:
        opened = FileIdentity.of_open(f)
        if max_bytes is not None and opened.size > max_bytes:
            raise FlashnextError(f"{path}: {opened.size:,} bytes, more than {what} may be ({max_bytes:,} bytes)")
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        check_still(f, opened, path)
    return data, opened


def check_still(f: BinaryIO | int, expected: FileIdentity, path: Path) -> None:
    """The open file ``f`` is still the version ``expected`` describes (nobody wrote it meanwhile)."""
    _refuse_change(path, expected, FileIdentity.of_open(f))


def check_unchanged(path: Path, expected: FileIdentity) -> None:
    """``path`` still names the file, and the version of it, that ``expected`` describes: call
    before renaming an output made from ``path`` into place."""
    try:
        now = FileIdentity.of(os.stat(path))
    except FileNotFoundError:
        raise FlashnextError(f"{path}: removed while flashnext was reading it; nothing was written: "
                             "run again once it is no longer being changed") from None
    _refuse_change(path, expected, now)


def _refuse_change(path: Path, expected: FileIdentity, now: FileIdentity) -> None:
    if now == expected:
        return
    if (now.device, now.inode) != (expected.device, expected.inode):
        how = "replaced by another file"
    elif now.size != expected.size:
        how = f"rewritten ({expected.size} bytes, now {now.size})"
    else:
        how = "rewritten (its modification time changed)"
    raise FlashnextError(f"{path}: {how} while flashnext was reading it; nothing was written: "
                         "run again once it is no longer being changed")
