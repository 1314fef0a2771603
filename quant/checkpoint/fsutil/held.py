"""Directories held open: the descriptor every create, rename and unlink of a writer goes through.

Whoever can write in an output's parent can plant or swap the temporary names beside it
(``.OUT.partial-PID``, ``.OUT.old-PID``, ``.OUT.lock``, ``.NAME.tmp-PID``). So the parent is opened
once (:class:`HeldDirectory`) and every create, rename and unlink goes through that descriptor;
every file is created with ``O_EXCL|O_NOFOLLOW``; a planted link is never followed, only removed
or refused.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Iterable

from flashnext.errors import FlashnextError


_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# Only looked up through (ancestors may be unreadable): O_PATH where the platform has it.
LOOKUP = getattr(os, "O_PATH", os.O_RDONLY) | os.O_CLOEXEC
_CREATE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def stat_identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _through_proc(fd: int) -> bool:
    try:
        return stat_identity(os.stat(f"/proc/self/fd/{fd}")) == stat_identity(os.fstat(fd))
    except OSError:
        return False


# What each held descriptor's directory is called, for messages: an OS error raised through a
# ``/proc/self/fd/N`` path names the directory as the user gave it. Kept after close (the error
# reaches the CLI layer after the ``with``); a reused descriptor number overwrites its entry.
_HELD_NAMES: dict[int, Path] = {}
_THROUGH_FD = re.compile(r"/proc/self/fd/(\d+)")


def display_path(text: str) -> str:
    """``text`` with every ``/proc/self/fd/N`` of a held directory replaced by that directory's name."""
    return _THROUGH_FD.sub(lambda m: str(_HELD_NAMES.get(int(m.group(1)), m.group(0))), text)


def _renameat2(fd: int, src: str, dst: str, flags: int) -> bool:
    """``renameat2(2)`` in ``fd``; False where the system or the filesystem does not have it."""
    import ctypes

    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if call(fd, os.fsencode(src), fd, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), dst)


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2  # renameat2(2)'s flags


class HeldDirectory:
    """A directory opened once. Names inside it are created, renamed and removed through its
    descriptor, so that a later swap of any component of its path (or of the directory itself)
    changes nothing; :meth:`through` gives code that only takes paths a path that resolves through
    the descriptor too."""

    def __init__(self, fd: int, path: Path):
        self.fd = fd
        self.path = Path(path)  # for messages: what the user named
        self._proc = _through_proc(fd)
        _HELD_NAMES[fd] = self.path

    @classmethod
    def open(cls, path: Path) -> "HeldDirectory":
        # The path resolves once, here, as the user gave it (a link of theirs, or a /proc/self/fd
        # path of a directory already held); from then on only the descriptor counts.
        try:
            fd = os.open(path, _DIRECTORY)
        except OSError as e:
            raise FlashnextError(f"cannot open the directory {path}: {e.strerror}") from None
        return cls(fd, path)

    def open_directory(self, name: str) -> "HeldDirectory":
        """A directory inside this one, never through a link."""
        return HeldDirectory(os.open(name, _DIRECTORY | os.O_NOFOLLOW, dir_fd=self.fd), self.path / name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "HeldDirectory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def identity(self) -> tuple[int, int]:
        return stat_identity(os.fstat(self.fd))

    def through(self, name: str = "") -> Path:
        """A path to ``name`` inside this directory that resolves through the descriptor (Linux's
        ``/proc/self/fd``; without /proc, the plain path). Only for this process's own opens."""
        base = Path(f"/proc/self/fd/{self.fd}") if self._proc else self.path
        return base / name if name else base

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def holds(self, name: str, identity: tuple[int, int]) -> bool:
        """Whether ``name`` here is still the very file or directory ``identity`` (not a link to it)."""
        st = self.lstat(name)
        return st is not None and stat_identity(st) == identity

    def create(self, name: str, flags: int = os.O_WRONLY, mode: int = 0o644) -> int:
        """A new file ``name``, created exclusively, never through a link."""
        return os.open(name, flags | _CREATE, mode, dir_fd=self.fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def rename_noreplace(self, src: str, dst: str) -> bool:
        """Rename ``src`` to ``dst`` in one step that refuses an existing ``dst`` (FileExistsError);
        False, and nothing done, where the system or the filesystem cannot."""
        return _renameat2(self.fd, src, dst, _RENAME_NOREPLACE)

    def exchange(self, src: str, dst: str) -> bool:
        """Swap ``src`` and ``dst`` in one step; False, and nothing done, where the system or the
        filesystem cannot."""
        return _renameat2(self.fd, src, dst, _RENAME_EXCHANGE)

    def read_regular(self, name: str) -> bytes:
        """The bytes of the regular file ``name`` here, never through a link (a FIFO is refused,
        not waited on)."""
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise FlashnextError(f"{self.path / name} is not a regular file")
            return f.read()

    def remove_tree(self, name: str) -> None:
        """Remove ``name`` here: a link or file by unlinking, a directory with all it holds (never
        following a link inside it)."""
        st = self.lstat(name)
        if st is None:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=self.fd)
        else:
            os.unlink(name, dir_fd=self.fd)


def write_new(path: Path, data: bytes | str) -> None:
    """A new file at ``path`` (inside an output being built), created exclusively and never through
    a link."""
    fd = os.open(path, os.O_WRONLY | _CREATE, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_parents(path: Path) -> list[Path]:
    """Create ``path``'s missing parent directories; returns those created, deepest last. Each is
    made inside the one above it as opened, so a swapped component cannot send the next elsewhere."""
    created = []
    chain = list(reversed(Path(path).absolute().parents))
    here = os.open(chain[0], LOOKUP | os.O_DIRECTORY)
    try:
        for parent in chain[1:]:
            try:
                below = os.open(parent.name, LOOKUP | os.O_DIRECTORY, dir_fd=here)
            except FileNotFoundError:
                try:
                    os.mkdir(parent.name, 0o777, dir_fd=here)
                    created.append(parent)
                except FileExistsError:
                    pass
                except OSError as e:
                    raise FlashnextError(f"cannot create {parent}: {e.strerror}") from None
                try:
                    below = os.open(parent.name, LOOKUP | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=here)
                except OSError as e:
                    raise FlashnextError(f"cannot create {parent}: {e.strerror}") from None
            except OSError as e:
                raise FlashnextError(f"cannot create {path}: {parent} is not a directory one can enter "
                                     f"({e.strerror})") from None
            os.close(here)
            here = below
    finally:
        os.close(here)
    return created


def remove_empty(directories: Iterable[Path]) -> None:
    for d in reversed(list(directories)):
        try:
            d.rmdir()
        except OSError:
            break
