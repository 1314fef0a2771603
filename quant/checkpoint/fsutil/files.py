"""Atomic output files: written to a temporary sibling through the held parent, then renamed into
place (or, for a file never replaced, given its name only if that name is free)."""

from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

from flashnext.errors import FlashnextError, named
from flashnext.quant.checkpoint.fsutil.held import HeldDirectory, make_parents, remove_empty, stat_identity
from flashnext.quant.checkpoint.fsutil.interrupts import interrupts_held
from flashnext.quant.checkpoint.fsutil.leftovers import remove_leftovers
from flashnext.quant.checkpoint.fsutil.locks import output_lock
from flashnext.quant.checkpoint.fsutil.markers import already_exists
from flashnext.quant.checkpoint.fsutil.overlap import refuse_overlap, refuse_overlap_open
from flashnext.quant.checkpoint.fsutil.space import name_the_full_disk


def _write_durably(fd: int, text: str) -> None:
    """``text`` into the new file open at ``fd`` (closed after), on the disk before it returns."""
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _create_temporary(parent: HeldDirectory, name: str) -> tuple[str, int]:
    """A new file beside ``name`` in the held ``parent`` to write it in, under this process's
    temporary name ``.NAME.tmp-PID``: that name and the file's descriptor. Whatever already has
    the name is a leftover of an earlier attempt, or a link or file someone planted to block or
    redirect the write: removing the name changes nothing it points at, so it goes, and the file is
    created exclusively, never through a link. Anything else there is refused, named."""
    tmp = f".{name}.tmp-{os.getpid()}"
    try:
        return tmp, parent.create(tmp)
    except FileExistsError:
        st = parent.lstat(tmp)
    if st is not None and not (stat.S_ISLNK(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise FlashnextError(f"{parent.path / tmp} exists and is not a leftover of flashnext's; remove it")
    try:
        os.unlink(tmp, dir_fd=parent.fd)
    except FileNotFoundError:
        pass
    try:
        return tmp, parent.create(tmp)
    except FileExistsError:
        raise FlashnextError(f"{parent.path / tmp} came back as soon as it was removed; is someone else "
                             "writing in that folder?") from None


def write_text_at(parent: HeldDirectory, name: str, text: str) -> None:
    """Write the small file ``name`` in the held ``parent`` via a temporary sibling and a rename."""
    mine = None
    try:
        with interrupts_held():
            tmp, fd = _create_temporary(parent, name)
            mine = stat_identity(os.fstat(fd))
        _write_durably(fd, text)
        parent.rename(tmp, name)
    except BaseException:
        if mine is not None and parent.holds(tmp, mine):
            os.unlink(tmp, dir_fd=parent.fd)
        raise


def write_new_file(path: Path, text: str) -> None:
    """A new small file ``path``, for a command whose output is one file it never replaces: written
    to a temporary sibling through the held parent, then given its name only if that name is free
    (``renameat2`` RENAME_NOREPLACE, else a hard link, each refusing an existing name, a link
    included). So the name is created exclusively, never through a link, and holds the whole text
    or nothing; an existing ``path`` is one line."""
    path = Path(path)
    try:
        parent = HeldDirectory.open(path.parent)
    except FlashnextError:
        raise FlashnextError(f"{path.parent} is not a directory to write {path.name} in") from None
    with parent:
        if parent.lstat(path.name) is not None:
            raise FlashnextError(f"{path} already exists: choose another name (it is never replaced)")
        mine = None
        try:
            with interrupts_held():
                tmp, fd = _create_temporary(parent, path.name)
                mine = stat_identity(os.fstat(fd))
            _write_durably(fd, text)
            try:
                if not parent.rename_noreplace(tmp, path.name):
                    os.link(tmp, path.name, src_dir_fd=parent.fd, dst_dir_fd=parent.fd, follow_symlinks=False)
            except FileExistsError:
                raise FlashnextError(f"{path} already exists: choose another name (it is never replaced)") from None
            os.fsync(parent.fd)
        finally:
            if mine is not None and parent.holds(tmp, mine):
                os.unlink(tmp, dir_fd=parent.fd)


def check_file_destination(path: Path, field: str, inputs: dict[str, Path | None] | None = None) -> None:
    """Refuse up front, before any work, a file output (the input ``field``: ``report``) that could
    only fail once the work is done, minutes of it on the real model: one that is, contains or lies
    inside one of ``inputs`` (:func:`refuse_overlap`), a directory, or one whose nearest existing
    folder is no directory or takes no new file (read-only, not permitted): that is found as the write
    will find it, by creating the file's temporary name there exclusively and removing it at once.
    The folders missing on the way are made when it is written (:func:`make_parents`)."""
    path = Path(path)
    refuse_overlap(path, inputs or {})
    if path.is_dir():
        raise FlashnextError(f"{path} is a directory; name a file", field=field)
    where = path.absolute().parent
    while not os.path.lexists(where):
        where = where.parent
    try:
        held = HeldDirectory.open(where)
    except FlashnextError as e:
        raise FlashnextError(f"{path} cannot be written: {e}; choose another file", field=field) from None
    with held:
        with interrupts_held():
            try:
                tmp, fd = _create_temporary(held, path.name)
            except OSError as e:
                raise FlashnextError(f"{path} cannot be written: cannot create a file in {where} "
                                     f"({e.strerror}); choose another file", field=field) from None
            try:
                os.close(fd)
            finally:
                os.unlink(tmp, dir_fd=held.fd)


def write_text_atomic(path: Path, text: str, inputs: dict[str, Path | None] | None = None) -> None:
    """Write a small file via a temporary sibling and rename, through its parent held open;
    ``inputs`` it may not be, contain or lie inside (checked on what is open)."""
    path = Path(path)
    with HeldDirectory.open(path.parent) as parent:
        if inputs:
            refuse_overlap_open(parent, path.name, inputs)
        write_text_at(parent, path.name, text)


class OutputFile:
    """An output file being written under its lock (what :func:`atomic_file` yields): new names
    beside it are created through its held parent, and the finished partial is renamed into place."""

    def __init__(self, path: Path, parent: HeldDirectory, inputs: dict[str, Path | None]):
        self.path = path
        self.parent = parent
        self.inputs = inputs

    def through(self) -> Path:
        """The output's own name, resolved through the held parent (for this process's opens)."""
        return self.parent.through(self.path.name)

    def create(self, name: str, flags: int = os.O_RDWR) -> int:
        """A new file ``name`` beside the output, created exclusively, never through a link."""
        return self.parent.create(name, flags)

    def check(self, partial: str, written: os.stat_result) -> None:
        """``partial`` is still the very file whose stat is ``written`` (not one swapped in), and
        the output still overlaps no input: before anything is written beside it, and at the commit."""
        if not self.parent.holds(partial, stat_identity(written)):
            raise FlashnextError(f"{self.path.parent / partial} was replaced while it was being written (is someone "
                                 "else writing in that folder?); nothing was written to the output: run again")
        refuse_overlap_open(self.parent, self.path.name, self.inputs)

    def commit(self, partial: str, written: os.stat_result) -> None:
        """Rename the complete ``partial`` to the output, once :meth:`check` holds."""
        self.check(partial, written)
        self.parent.rename(partial, self.path.name)
        os.fsync(self.parent.fd)


@contextmanager
def atomic_file(out: Path, force: bool, inputs: dict[str, Path | None], is_ours: Callable[[Path], bool],
                maker: str, companions: Iterable[Path] = (), what: str = "the file") -> Iterator[OutputFile]:
    """The file counterpart of :func:`atomic_directory`: the output's lock held, its leftovers (and
    those of its ``companions``, the files written beside it) removed, and an existing ``out``
    refused unless ``force`` and ``is_ours(path)`` says flashnext made it (``maker`` names who, for
    the refusal; a file carries no marker, so its maker's own record vouches for it). ``out`` must
    not be, contain or lie inside any of ``inputs``, checked by path, on what is open, and again at
    the commit. The yielded :class:`OutputFile` creates the partial and commits it.

    On an exception the parent directories this call created (and left empty) are removed; a
    partial file is the caller's to keep (a resumable build) or remove."""
    out = Path(out).absolute()
    refuse_overlap(out, inputs)
    if out.is_dir():
        raise FlashnextError(f"{out} is a directory; {named('out')} names {what} to write")
    created = []
    try:
        with interrupts_held():
            created = make_parents(out)
        with output_lock(out) as parent:
            refuse_overlap_open(parent, out.name, inputs)
            for name in (out, *companions):
                remove_leftovers(Path(name), parent)
            existing = parent.lstat(out.name)
            if existing is not None:
                if not force:
                    raise already_exists(out)
                if stat.S_ISDIR(existing.st_mode) or not is_ours(parent.through(out.name)):
                    raise FlashnextError(f"{out} exists and was not made by {maker}; {named('force')} only replaces "
                                         f"flashnext's own output: remove it yourself or choose another {named('out')}")
            yield OutputFile(out, parent, inputs)
    except BaseException as e:
        remove_empty(created)
        name_the_full_disk(e, out)
        raise
