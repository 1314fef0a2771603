"""Paths read from files stay inside their root, and what is built inside an output stays in it.

A path read from a file (an index's shard name, a manifest's file path) is untrusted: :func:`confined`
refuses one that leaves its root. The files of an output being built are created exclusively, never
through a link (:func:`output_file`, :func:`write_json`); the output itself is renamed into place
(:mod:`.directories`).
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from flashnext.errors import FlashnextError
from flashnext.quant.checkpoint.fsutil.held import write_new


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


def output_file(root: Path, relative: str) -> Path:
    """A new, empty file inside the output being built (created exclusively, never through a link),
    its parent directories created."""
    path = confined(root, relative, "output")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_new(path, b"")
    return path


def write_json(path: Path, obj) -> None:
    """A small new JSON file inside an output being built (the output itself is renamed into place)."""
    write_new(Path(path), (json.dumps(obj, indent=2) + "\n").encode())
