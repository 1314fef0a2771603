"""Atomic output directories: built as a partial sibling under the output's lock, renamed into place
whole, or not at all.

An existing output is replaced only once the new one is complete, and at no moment is there no
complete copy (:func:`_commit`).
"""

from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from flashnext.errors import FlashnextError
from flashnext.quant.checkpoint.fsutil.held import HeldDirectory, make_parents, remove_empty
from flashnext.quant.checkpoint.fsutil.interrupts import interrupts_held
from flashnext.quant.checkpoint.fsutil.leftovers import remove_leftovers
from flashnext.quant.checkpoint.fsutil.locks import output_lock, remove_stale_lock
from flashnext.quant.checkpoint.fsutil.markers import (already_exists, marker_at, refuse_unless_replaceable,
                                                       require_flashnext_output, write_marker)
from flashnext.quant.checkpoint.fsutil.overlap import refuse_overlap, refuse_overlap_open
from flashnext.quant.checkpoint.fsutil.space import name_the_full_disk


def refuse_existing_output(out: Path, force: bool, inputs: dict[str, Path | None] | None = None,
                           made_by: str | None = None) -> None:
    """:func:`atomic_directory`'s refusals of ``out`` (one that overlaps ``inputs``, an existing one
    unless ``force`` and the command ``made_by`` made it), made up front: a command calls it before
    its slow part (importing torch, minutes of checks), so that a wrong ``--out`` costs nothing.
    ``atomic_directory`` checks again, under its lock; there a command whose name comes only with
    its slow imports (``repack-int6``'s builder imports torch) is held to its own output."""
    out = Path(out)
    refuse_overlap(out, inputs or {})
    if out.exists() or out.is_symlink():
        if not force:
            remove_stale_lock(out)
            raise already_exists(out.absolute())
        require_flashnext_output(out, made_by)


def _commit(parent: HeldDirectory, partial: str, name: str, replacing: bool) -> None:
    """Put the complete ``partial`` in ``name``'s place. At no moment is there no complete copy:
    the old output and the new one swap in one step where the filesystem can; elsewhere the old
    one is moved aside as ``.NAME.old-PID``, which the next writer puts back if this one dies."""
    if not replacing:
        if not parent.rename_noreplace(partial, name):
            parent.rename(partial, name)
        return
    if parent.exchange(partial, name):
        parent.remove_tree(partial)  # now the old output
        return
    old = f".{name}.old-{os.getpid()}"
    parent.rename(name, old)
    parent.rename(partial, name)
    parent.remove_tree(old)


class OutputDirectory:
    """An output directory being built under its lock (what :func:`output_directory` yields): its
    partial sibling is made, found again, committed and removed through the held parent."""

    def __init__(self, path: Path, parent: HeldDirectory, inputs: dict[str, Path | None], replacing: bool):
        self.path = path
        self.parent = parent
        self.inputs = inputs
        self.replacing = replacing  # an existing output (flashnext's, with --force) is replaced at the commit

    def make_partial(self, name: str, made_by: str) -> HeldDirectory:
        """A new partial directory ``name`` beside the output, made exclusively, held open, with
        flashnext's marker in it."""
        where = self.path.parent / name
        try:
            os.mkdir(name, 0o777, dir_fd=self.parent.fd)
        except FileExistsError:
            raise FlashnextError(f"{where} exists and is not a leftover of flashnext's; remove it") from None
        try:
            partial = self.parent.open_directory(name)
        except OSError:
            raise FlashnextError(f"{where} was replaced as it was made; is someone else writing in that "
                                 "folder?") from None
        try:
            write_marker(partial.through(), made_by)
        except BaseException:
            self.discard(name, partial)
            partial.close()
            raise
        return partial

    def open_partial(self, name: str, identity: tuple[int, int]) -> HeldDirectory | None:
        """The partial directory ``name`` held open again, if it is the very directory ``identity``
        (device and inode; never a link to it) and carries flashnext's marker; else None."""
        if not self.parent.holds(name, identity) or marker_at(self.parent, name) is None:
            return None
        try:
            partial = self.parent.open_directory(name)
        except OSError:
            return None
        if partial.identity() != identity:  # swapped between the look and the open
            partial.close()
            return None
        return partial

    def remove_partial(self, name: str) -> bool:
        """Remove ``name`` beside the output if it is a link or a directory flashnext made (the rule
        of :func:`remove_leftovers`); False, and nothing removed, for anything else."""
        st = self.parent.lstat(name)
        if st is None:
            return True
        if stat.S_ISLNK(st.st_mode):
            os.unlink(name, dir_fd=self.parent.fd)
            return True
        if stat.S_ISDIR(st.st_mode) and marker_at(self.parent, name) is not None:
            self.parent.remove_tree(name)
            return True
        return False

    def commit(self, name: str, partial: HeldDirectory) -> None:
        """Rename the complete ``partial`` (still the very directory made as ``name``) to the
        output, once it still overlaps no input."""
        os.fsync(partial.fd)
        if not self.parent.holds(name, partial.identity()):
            raise FlashnextError(f"{self.path.parent / name} was replaced while it was being written; "
                                 "is someone else writing in that folder?")
        refuse_overlap_open(self.parent, self.path.name, self.inputs)
        _commit(self.parent, name, self.path.name, replacing=self.replacing)
        os.fsync(self.parent.fd)

    def discard(self, name: str, partial: HeldDirectory) -> None:
        """Remove the partial ``name``, if it is still the very directory held as ``partial``."""
        if self.parent.holds(name, partial.identity()):
            self.parent.remove_tree(name)


@contextmanager
def output_directory(out: Path, force: bool, inputs: dict[str, Path | None],
                     made_by: str) -> Iterator[OutputDirectory]:
    """The rules of every output directory, for a caller that manages its partial itself (a
    resumable build): the output's lock held, its leftovers removed (a previous output that an
    interrupted ``--force`` replace had set aside put back), an existing ``out`` refused unless
    ``force`` and the command ``made_by`` made it, and ``out`` never, inside or around one of
    ``inputs`` (by path, on what is open, and again at the commit). On an exception the parent
    directories this call created (and left empty) are removed."""
    out = Path(out).absolute()
    refuse_overlap(out, inputs)
    created = []
    try:
        with interrupts_held():
            created = make_parents(out)
        with output_lock(out) as parent:
            refuse_overlap_open(parent, out.name, inputs)
            restored = remove_leftovers(out, parent)
            existing = parent.lstat(out.name)
            if existing is not None:
                if not force:
                    how = f" (put back from {restored.name}, left by a --force replace that was interrupted)" \
                        if restored else ""
                    raise already_exists(out, how)
                marker = marker_at(parent, out.name) if stat.S_ISDIR(existing.st_mode) else None
                refuse_unless_replaceable(out, marker, made_by)
            yield OutputDirectory(out, parent, inputs, replacing=existing is not None)
    except BaseException as e:
        remove_empty(created)
        name_the_full_disk(e, out)
        raise


@contextmanager
def atomic_directory(out: Path, force: bool = False, inputs: dict[str, Path | None] | None = None, *,
                     made_by: str, held: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` to build in; rename it to ``out`` only on success.

    ``out`` must not be, contain or lie inside any of ``inputs`` (checked by path first, then on
    the directories opened, again before the rename). An existing ``out`` is refused unless
    ``force``, and even then only if the same command (``made_by``) made it; it is replaced only
    once the new one is complete. On any exception the temporary directory is removed and ``out``
    is left as it was.

    With ``held`` the yielded path resolves through the temporary directory's descriptor, so that
    swapping it or its parent for a link changes nothing; it is good for this process's own opens
    only (not for a child process's command line).
    """
    out = Path(out).absolute()
    with output_directory(out, force, inputs or {}, made_by) as output:
        name = f".{out.name}.partial-{os.getpid()}"
        partial = None
        try:
            with interrupts_held():
                partial = output.make_partial(name, made_by)
            yield partial.through() if held else out.parent / name
            output.commit(name, partial)
        except BaseException:
            if partial is not None:
                output.discard(name, partial)
            raise
        finally:
            if partial is not None:
                partial.close()
