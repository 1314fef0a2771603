"""Where flashnext may write, and how: path confinement, output guards, locks and atomic outputs.

Every writer goes through this module, so that the rules hold for every command:

* a path read from a file (an index's shard name, a manifest's file path) is untrusted and must stay
  inside its root (:func:`confined`);
* an output never is, contains or lies inside an input (:func:`refuse_overlap`);
* ``--force`` replaces only what flashnext made: a directory holding :data:`OUTPUT_MARKER`
  (:func:`require_flashnext_output`);
* one writer per output at a time (:func:`output_lock`), and the output appears whole or not at all
  (:func:`atomic_directory`, :func:`write_text_atomic`); what a killed writer left behind is
  removed by the next one.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Iterable, Iterator

from flashnext.errors import FlashnextError

HASH_CHUNK = 16 << 20
OUTPUT_MARKER = ".flashnext-output.json"


def sha256_file(path: Path, progress=None) -> str:
    """Hex sha256 of a file's content; ``progress(n)`` is called with each chunk's byte count."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def confined(root: Path, relative: object, source: str) -> Path:
    """``root / relative`` for a relative path read from ``source`` (a file), refused unless it stays
    inside ``root``: no absolute path, no ``..``, no empty or ``.`` parts, no NUL or backslash."""
    if not isinstance(relative, str) or not relative:
        raise FlashnextError(f"{source}: file path {relative!r} is not a non-empty string")
    parts = relative.split("/")
    if (relative.startswith("/") or "\\" in relative or "\0" in relative
            or any(p in ("", ".", "..") for p in parts)):
        raise FlashnextError(f"{source}: file path {relative!r} does not stay inside {root}; refusing it")
    return Path(root) / PurePosixPath(relative)


def refuse_overlap(out: Path, inputs: dict[str, Path | None]) -> None:
    """Refuse an output that is, contains or lies inside one of the named inputs."""
    o = Path(out).resolve()
    for label, path in inputs.items():
        if path is None:
            continue
        r = Path(path).resolve()
        if o == r:
            raise FlashnextError(f"{out} is {label} itself; write somewhere else")
        if r in o.parents:
            raise FlashnextError(f"{out} lies inside {label} {path}, which flashnext never writes into; "
                                 "write somewhere else")
        if o in r.parents:
            raise FlashnextError(f"{out} contains {label} {path}; replacing it would delete the input: "
                                 "write somewhere else")


def read_output_marker(directory: Path) -> dict | None:
    """The marker of a directory flashnext made, or None."""
    marker = Path(directory) / OUTPUT_MARKER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("made_by"), str) else None


def require_flashnext_output(out: Path) -> None:
    """``--force`` may replace ``out`` only when it is a directory flashnext made."""
    if out.is_symlink() or not out.is_dir() or read_output_marker(out) is None:
        raise FlashnextError(f"{out} exists and was not made by flashnext (no {OUTPUT_MARKER}); --force only "
                             "replaces flashnext's own output: remove it yourself or choose another --out")


def output_file(root: Path, relative: str) -> Path:
    """A file path inside the output being built, its parent directories created."""
    path = confined(root, relative, "output")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, obj) -> None:
    """A small JSON file inside an output being built (the output itself is renamed into place)."""
    Path(path).write_text(json.dumps(obj, indent=2) + "\n")


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest existing parent: where its free space is counted."""
    path = Path(path).absolute()
    return next(p for p in (path, *path.parents) if p.exists())


def check_free_space(directory: Path, needed: int, what: str) -> None:
    """Refuse to start when ``directory``'s filesystem has less than ``needed`` bytes free."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise FlashnextError(
            f"not enough disk space for {what}: need {needed / 2**30:.2f} GiB in {directory}, "
            f"{free / 2**30:.2f} GiB free")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_parents(path: Path) -> list[Path]:
    """Create ``path``'s missing parent directories; returns those created, deepest last."""
    created = []
    for parent in reversed(Path(path).absolute().parents):
        if not parent.exists():
            try:
                parent.mkdir()
            except FileExistsError:
                continue
            except OSError as e:
                raise FlashnextError(f"cannot create {parent}: {e.strerror}") from None
            created.append(parent)
    return created


def remove_empty(directories: Iterable[Path]) -> None:
    for d in reversed(list(directories)):
        try:
            d.rmdir()
        except OSError:
            break


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``out`` (a sibling ``.NAME.lock``); a second writer is refused."""
    out = Path(out).absolute()
    lock = out.parent / f".{out.name}.lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise FlashnextError(f"another flashnext process is writing {out} (lock {lock}); "
                                     "wait for it to finish or stop it") from None
            raise
        # The holder before us may have unlinked the file between our open and our flock.
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


def _leftovers(out: Path) -> list[Path]:
    """What killed writers of ``out`` left beside it (only called under the output's lock)."""
    prefixes = (f".{out.name}.partial-", f".{out.name}.old-", f".{out.name}.tmp-")
    return [p for p in out.parent.iterdir() if p.name.startswith(prefixes)]


def remove_leftovers(out: Path) -> None:
    """Remove the temporary siblings of ``out`` that dead writers left: directories only when they
    carry flashnext's marker (or are empty), files only by their temporary names."""
    for p in _leftovers(out):
        if p.is_symlink() or p.is_file():
            if ".tmp-" in p.name:
                p.unlink(missing_ok=True)
        elif p.is_dir() and (read_output_marker(p) is not None or not any(p.iterdir())):
            shutil.rmtree(p, ignore_errors=True)


def write_marker(directory: Path, made_by: str) -> None:
    from flashnext import __version__

    (Path(directory) / OUTPUT_MARKER).write_text(
        json.dumps({"made_by": made_by, "flashnext_version": __version__}) + "\n")


@contextmanager
def atomic_directory(out: Path, force: bool = False, inputs: dict[str, Path | None] | None = None,
                     made_by: str = "flashnext") -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` to build in; rename it to ``out`` only on success.

    ``out`` must not be, contain or lie inside any of ``inputs``. An existing ``out`` is refused
    unless ``force``, and even then only if flashnext made it; it is replaced only once the new one
    is complete. On any exception the temporary directory is removed and ``out`` is left as it was.
    """
    out = Path(out).absolute()
    refuse_overlap(out, inputs or {})
    created = make_parents(out)
    try:
        with output_lock(out):
            remove_leftovers(out)
            if out.exists() or out.is_symlink():
                if not force:
                    raise FlashnextError(f"{out} already exists: choose another --out or pass --force")
                require_flashnext_output(out)
            tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
            tmp.mkdir()
            try:
                write_marker(tmp, made_by)
                yield tmp
                fsync_dir(tmp)
                if out.exists():
                    old = out.parent / f".{out.name}.old-{os.getpid()}"
                    os.rename(out, old)
                    os.rename(tmp, out)
                    shutil.rmtree(old)
                else:
                    os.rename(tmp, out)
                fsync_dir(out.parent)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except BaseException:
        remove_empty(created)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write a small file via a temporary sibling and rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
