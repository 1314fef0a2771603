"""An output never is, contains or lies inside an input, nor in the part of a Hugging Face hub cache
that huggingface_hub alone writes: checked on the paths before any work (:func:`refuse_overlap`) and on
the directories actually opened (:func:`refuse_overlap_open`)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from flashnext.errors import FlashnextError
from flashnext.quant.checkpoint.fsutil.held import LOOKUP, HeldDirectory, stat_identity


# A Hugging Face hub cache holds one folder per repository (``models--ORG--NAME``, ``datasets--…``,
# ``spaces--…``); in it, what huggingface_hub alone writes: the content-addressed files, the
# snapshots that link to them, the refs naming the snapshots.
HUB_REPO_FOLDER = re.compile(r"(?:models|datasets|spaces)--.+")
HUB_OWN_FOLDERS = ("blobs", "snapshots", "refs")


def hub_caches() -> list[Path]:
    """Where huggingface_hub keeps its download cache, as it finds it: HF_HUB_CACHE, else
    HF_HOME/hub, else XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    from flashnext.envs import HF_HOME, HF_HUB_CACHE, XDG_CACHE_HOME

    home = HF_HOME.get() or os.path.join(XDG_CACHE_HOME.get() or os.path.join("~", ".cache"), "huggingface")
    return [Path(os.path.expanduser(HF_HUB_CACHE.get() or os.path.join(home, "hub"))).resolve()]


def refuse_hub_cache(out: Path) -> None:
    """Refuse an output that is or lies inside a Hugging Face hub cache repository's ``blobs/``,
    ``snapshots/`` or ``refs/``: a snapshot there is huggingface_hub's (its files are links into
    ``blobs/``, shared by every revision), so a file written there changes or shadows the model
    everyone loads from it, and ``hf cache`` deletes it with the revision. The cache is known by its
    layout wherever it is (``models--*/snapshots/...``), and in the configured cache
    (:func:`hub_caches`) whatever its repository folders are called."""
    o = Path(out).resolve()
    caches = hub_caches()
    for here in (o, *o.parents):
        repo = here.parent
        if here.name in HUB_OWN_FOLDERS and (HUB_REPO_FOLDER.fullmatch(repo.name) or repo.parent in caches):
            raise FlashnextError(f"{out} lies inside the Hugging Face cache's {repo.name}/{here.name}, which "
                                 "only huggingface_hub writes; write somewhere else")


def refuse_overlap(out: Path, inputs: dict[str, Path | None]) -> None:
    """Refuse an output that is, contains or lies inside one of the named inputs (by path, before
    any work; :func:`refuse_overlap_open` checks again what is actually opened), or that lies in a
    Hugging Face hub cache's own folders (:func:`refuse_hub_cache`): the one check of every output's
    path, which every writer makes before its work."""
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
    refuse_hub_cache(out)


def _ancestry(fd: int) -> set[tuple[int, int]]:
    """The identities of the directory open as ``fd`` and of every directory above it."""
    seen: set[tuple[int, int]] = set()
    here = os.open(".", LOOKUP | os.O_DIRECTORY, dir_fd=fd)
    try:
        while True:
            ident = stat_identity(os.fstat(here))
            if ident in seen:  # "/" is its own parent
                return seen
            seen.add(ident)
            up = os.open("..", LOOKUP | os.O_DIRECTORY, dir_fd=here)
            os.close(here)
            here = up
    finally:
        os.close(here)


def _input_identity(path: Path) -> tuple[tuple[int, int], set[tuple[int, int]]] | None:
    """An input's identity (what reading it opens) and its ancestors'; None when it does not exist
    (its reader refuses it)."""
    try:
        fd = os.open(path, LOOKUP)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return stat_identity(st), _ancestry(fd)
    finally:
        os.close(fd)
    try:
        parent = os.open(os.path.dirname(os.path.realpath(path)), LOOKUP | os.O_DIRECTORY)
    except OSError:
        return stat_identity(st), set()
    try:
        return stat_identity(st), _ancestry(parent)
    finally:
        os.close(parent)


def refuse_overlap_open(parent: HeldDirectory, name: str, inputs: dict[str, Path | None]) -> None:
    """:func:`refuse_overlap` for what is open: the output ``name`` written in the held ``parent``
    must not be, contain or lie inside an input, by device and inode, whatever the paths now say."""
    out = parent.path / name
    where = _ancestry(parent.fd)
    existing = parent.lstat(name)
    existing = stat_identity(existing) if existing is not None else None
    for label, path in inputs.items():
        if path is None:
            continue
        found = _input_identity(path)
        if found is None:
            continue
        ident, above = found
        if existing == ident:
            raise FlashnextError(f"{out} is {label} itself; write somewhere else")
        if ident in where:
            raise FlashnextError(f"{out} lies inside {label} {path}, which flashnext never writes into; "
                                 "write somewhere else")
        if existing is not None and existing in above:
            raise FlashnextError(f"{out} contains {label} {path}; replacing it would delete the input: "
                                 "write somewhere else")
