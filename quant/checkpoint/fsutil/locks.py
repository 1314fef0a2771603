"""One writer per output at a time: an exclusive lock beside it (``.NAME.lock``)."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from flashnext.errors import FlashnextError
from flashnext.quant.checkpoint.fsutil.held import HeldDirectory, stat_identity
from flashnext.quant.checkpoint.fsutil.interrupts import interrupts_held


def _open_lock(parent: HeldDirectory, name: str, lock: Path) -> int | None:
    """The lock file, created exclusively, or the one a writer before us left (a regular file of
    ours with one link); None when it vanished between two looks."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=parent.fd)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, flags, dir_fd=parent.fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FlashnextError(f"the lock {lock} is a symbolic link, not flashnext's lock; remove it "
                                 "(someone else can write in that folder?)") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
        os.close(fd)
        raise FlashnextError(f"the lock {lock} is not flashnext's lock (a regular file of yours with one link); "
                             "remove it (someone else can write in that folder?)")
    return fd


def remove_stale_lock(out: Path) -> None:
    """Remove the lock of ``out`` that a writer left when it was killed between finishing ``out``
    and unlinking its lock, if no one holds it: a command that finds ``out`` made and refuses to
    replace it takes no lock, so nothing else would."""
    out = Path(out).absolute()
    name = f".{out.name}.lock"
    try:
        parent = HeldDirectory.open(out.parent)
    except OSError:
        return
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent.fd)
    except OSError:
        parent.close()
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
            return  # not flashnext's lock: _open_lock says so when a writer meets it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # a live writer holds it
        if parent.holds(name, stat_identity(st)):
            os.unlink(name, dir_fd=parent.fd)
    finally:
        os.close(fd)
        parent.close()


def _take_lock(parent: HeldDirectory, name: str, lock: Path, out: Path) -> tuple[int, tuple[int, int]]:
    """The lock ``name`` in ``parent`` created or opened and flocked: its descriptor and identity."""
    while True:
        fd = _open_lock(parent, name, lock)
        if fd is None:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise FlashnextError(f"another flashnext process is writing {out} (lock {lock}); "
                                     "wait for it to finish or stop it") from None
            raise
        # The holder before us may have unlinked the file between our open and our flock.
        mine = stat_identity(os.fstat(fd))
        if parent.holds(name, mine):
            return fd, mine
        os.close(fd)


@contextmanager
def output_lock(out: Path) -> Iterator[HeldDirectory]:
    """Hold an exclusive lock on ``out`` (a sibling ``.NAME.lock``); a second writer is refused.
    Yields ``out``'s parent, held open: write ``out`` and its temporary siblings through it."""
    out = Path(out).absolute()
    name = f".{out.name}.lock"
    lock = out.parent / name
    parent = HeldDirectory.open(out.parent)
    taken = None

    def release() -> None:
        if parent.holds(name, taken[1]):
            os.unlink(name, dir_fd=parent.fd)

    try:
        with interrupts_held():
            taken = _take_lock(parent, name, lock, out)
        yield parent
    finally:
        try:
            if taken is not None:
                try:
                    release()
                except KeyboardInterrupt:  # Ctrl-C or SIGTERM as the lock was let go (a second SIGTERM is ignored)
                    release()
                    raise
                finally:
                    os.close(taken[0])
        finally:
            parent.close()
