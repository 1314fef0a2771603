"""Atomic output directories, hashing and disk-space checks."""

from __future__ import annotations

import hashlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from flashnext.quant.errors import FlashnextError

HASH_CHUNK = 16 << 20


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


def is_within(path: Path, root: Path) -> bool:
    path, root = Path(path).resolve(), Path(root).resolve()
    return path == root or root in path.parents


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


@contextmanager
def atomic_directory(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` to build in; rename it to ``out`` only on success.

    On any exception the temporary directory is removed and ``out`` is left as it was. An existing
    ``out`` is refused unless ``force``; with ``force`` it is replaced only after the new one is
    complete.
    """
    out = Path(out).absolute()
    if out.exists() and not force:
        raise FlashnextError(f"{out} already exists: choose another --out or pass --force")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FlashnextError(f"cannot create {out.parent}: {e.strerror}") from None
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
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
