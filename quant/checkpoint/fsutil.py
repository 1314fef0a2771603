"""Where flashnext may write, and how: path confinement, output guards, locks and atomic outputs.

Every writer goes through this module, so that the rules hold for every command:

* a path read from a file (an index's shard name, a manifest's file path) is untrusted and must stay
  inside its root (:func:`confined`);
* an output never is, contains or lies inside an input (:func:`refuse_overlap` on the paths before
  any work, :func:`refuse_overlap_open` on the directories actually opened), nor lies inside the
  part of a Hugging Face hub cache that huggingface_hub alone writes (:func:`refuse_hub_cache`);
* ``--force`` replaces only what flashnext made, and only the same command's: a directory holding
  :data:`OUTPUT_MARKER` whose ``made_by`` is that command (:func:`require_flashnext_output`);
* one writer per output at a time (:func:`output_lock`), and the output appears whole or not at all
  (:func:`atomic_directory`, :func:`write_text_atomic`); what a killed writer left behind is
  removed by the next one, by its exact temporary name (:func:`remove_leftovers`);
* what a command needs only while it runs lives in a scratch directory of the system's temporary
  folder that it removes when it ends (:func:`scratch_directory`), and that the next run removes if
  it was killed first: by the marker naming the process that made it, once that process is gone.

Whoever can write in an output's parent can plant or swap the temporary names beside it
(``.OUT.partial-PID``, ``.OUT.old-PID``, ``.OUT.lock``, ``.NAME.tmp-PID``). So the parent is opened
once (:class:`HeldDirectory`) and every create, rename and unlink goes through that descriptor;
every file is created with ``O_EXCL|O_NOFOLLOW``; a planted link is never followed, only removed
or refused.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Callable, Iterable, Iterator

from flashnext.errors import FlashnextError
from flashnext.quant.records.inputs import open_regular
from flashnext.sizes import format_size

HASH_CHUNK = 16 << 20
OUTPUT_MARKER = ".flashnext-output.json"
MARKER_LIMIT = 1 << 16  # a marker is a few lines; what is longer is read only this far (and is no marker)

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# Only looked up through (ancestors may be unreadable): O_PATH where the platform has it.
_LOOKUP = getattr(os, "O_PATH", os.O_RDONLY) | os.O_CLOEXEC
_CREATE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def sha256_file(path: Path, progress=None, what: str = "a file to hash") -> str:
    """Hex sha256 of a regular file's content (``what`` it is, for the refusal of anything else);
    ``progress(n)`` is called with each chunk's byte count."""
    digest = hashlib.sha256()
    with open_regular(path, what) as f:
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


# --- directories held open ------------------------------------------------------------------------

def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _through_proc(fd: int) -> bool:
    try:
        return _identity(os.stat(f"/proc/self/fd/{fd}")) == _identity(os.fstat(fd))
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
        return _identity(os.fstat(self.fd))

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
        return st is not None and _identity(st) == identity

    def create(self, name: str, flags: int = os.O_WRONLY, mode: int = 0o644) -> int:
        """A new file ``name``, created exclusively, never through a link."""
        return os.open(name, flags | _CREATE, mode, dir_fd=self.fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

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


# --- overlap of outputs and inputs ----------------------------------------------------------------

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
    here = os.open(".", _LOOKUP | os.O_DIRECTORY, dir_fd=fd)
    try:
        while True:
            ident = _identity(os.fstat(here))
            if ident in seen:  # "/" is its own parent
                return seen
            seen.add(ident)
            up = os.open("..", _LOOKUP | os.O_DIRECTORY, dir_fd=here)
            os.close(here)
            here = up
    finally:
        os.close(here)


def _input_identity(path: Path) -> tuple[tuple[int, int], set[tuple[int, int]]] | None:
    """An input's identity (what reading it opens) and its ancestors'; None when it does not exist
    (its reader refuses it)."""
    try:
        fd = os.open(path, _LOOKUP)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return _identity(st), _ancestry(fd)
    finally:
        os.close(fd)
    try:
        parent = os.open(os.path.dirname(os.path.realpath(path)), _LOOKUP | os.O_DIRECTORY)
    except OSError:
        return _identity(st), set()
    try:
        return _identity(st), _ancestry(parent)
    finally:
        os.close(parent)


def refuse_overlap_open(parent: HeldDirectory, name: str, inputs: dict[str, Path | None]) -> None:
    """:func:`refuse_overlap` for what is open: the output ``name`` written in the held ``parent``
    must not be, contain or lie inside an input, by device and inode, whatever the paths now say."""
    out = parent.path / name
    where = _ancestry(parent.fd)
    existing = parent.lstat(name)
    existing = _identity(existing) if existing is not None else None
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


# --- markers --------------------------------------------------------------------------------------

def _parse_marker(text: str) -> dict | None:
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) and isinstance(data.get("made_by"), str) else None


def read_output_marker(directory: Path) -> dict | None:
    """The marker of a directory flashnext made, or None."""
    marker = Path(directory) / OUTPUT_MARKER
    try:
        # Opened once, never through a link, and refused unless regular: a marker swapped for a
        # FIFO after a check would block the read.
        with open_regular(marker, "flashnext's output marker", follow_symlinks=False) as f:
            return _parse_marker(f.read(MARKER_LIMIT).decode())
    except (FlashnextError, OSError, ValueError):
        return None


def _marker_at(parent: HeldDirectory, name: str) -> dict | None:
    """The marker of the directory ``name`` in ``parent`` (None for a link, a file, or a directory
    flashnext did not make)."""
    try:
        directory = parent.open_directory(name)
    except OSError:
        return None
    try:
        fd = os.open(OUTPUT_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory.fd)
    except OSError:
        return None
    finally:
        directory.close()
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        try:
            return _parse_marker(f.read(MARKER_LIMIT).decode())
        except (OSError, ValueError):
            return None


def _refuse_unless_replaceable(out: Path, marker: dict | None, made_by: str | None) -> None:
    """The one rule of ``--force``, given the marker of the existing ``out`` (None: no directory
    flashnext made): it replaces only what flashnext made, and of that only what the same command
    (``made_by``) made. One command's ``--force`` never takes another's output: a snapshot
    ``demo-checkpoint`` wrote is not the selftest's report to replace, nor an overlay a view.
    ``made_by`` None: the command is not known yet (an early check), only flashnext's marker is."""
    if marker is None:
        _not_flashnexts(out)
    if made_by is not None and marker["made_by"] != made_by:
        # The marker is a file anyone could edit: its text is quoted, and only so far.
        raise FlashnextError(f"{out} was made by {marker['made_by'][:80]!r}, not by {made_by}; --force only "
                             f"replaces {made_by}'s own output: remove it yourself or choose another --out")


def require_flashnext_output(out: Path, made_by: str | None) -> None:
    """``--force`` may replace ``out`` only when it is a directory the command ``made_by`` made."""
    marker = None if out.is_symlink() or not out.is_dir() else read_output_marker(out)
    _refuse_unless_replaceable(out, marker, made_by)


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
            raise _already_exists(out.absolute())
        require_flashnext_output(out, made_by)


def _already_exists(out: Path, how: str = "") -> FlashnextError:
    return FlashnextError(f"{out} already exists{how}: choose another --out or pass --force")


def _not_flashnexts(out: Path):
    raise FlashnextError(f"{out} exists and was not made by flashnext (no {OUTPUT_MARKER}); --force only "
                         "replaces flashnext's own output: remove it yourself or choose another --out")


def write_new(path: Path, data: bytes | str) -> None:
    """A new file at ``path`` (inside an output being built), created exclusively and never through
    a link."""
    fd = os.open(path, os.O_WRONLY | _CREATE, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def _where_pids_count() -> dict:
    """Where a process id names one process: this host and this PID namespace (a container numbers
    its processes apart from the host's, and a temporary folder can be shared between them)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = None
    return {"host": socket.gethostname(), "pid_namespace": namespace}


def write_marker(directory: Path, made_by: str, pid: int | None = None) -> None:
    """Mark ``directory`` as made by the command ``made_by``. ``pid``: the process whose scratch it
    is (:func:`scratch_directory`), and where that id counts, so that a later run can tell when
    that process is gone."""
    from flashnext import __version__

    marker = {"made_by": made_by, "flashnext_version": __version__}
    if pid is not None:
        marker |= {"pid": pid, **_where_pids_count()}
    write_new(Path(directory) / OUTPUT_MARKER, (json.dumps(marker) + "\n").encode())


# --- files inside an output being built -----------------------------------------------------------

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
    here = os.open(chain[0], _LOOKUP | os.O_DIRECTORY)
    try:
        for parent in chain[1:]:
            try:
                below = os.open(parent.name, _LOOKUP | os.O_DIRECTORY, dir_fd=here)
            except FileNotFoundError:
                try:
                    os.mkdir(parent.name, 0o777, dir_fd=here)
                    created.append(parent)
                except FileExistsError:
                    pass
                except OSError as e:
                    raise FlashnextError(f"cannot create {parent}: {e.strerror}") from None
                try:
                    below = os.open(parent.name, _LOOKUP | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=here)
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


# --- the lock -------------------------------------------------------------------------------------

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
        if parent.holds(name, _identity(st)):
            os.unlink(name, dir_fd=parent.fd)
    finally:
        os.close(fd)
        parent.close()


@contextmanager
def output_lock(out: Path) -> Iterator[HeldDirectory]:
    """Hold an exclusive lock on ``out`` (a sibling ``.NAME.lock``); a second writer is refused.
    Yields ``out``'s parent, held open: write ``out`` and its temporary siblings through it."""
    out = Path(out).absolute()
    name = f".{out.name}.lock"
    lock = out.parent / name
    parent = HeldDirectory.open(out.parent)
    try:
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
            mine = _identity(os.fstat(fd))
            if parent.holds(name, mine):
                break
            os.close(fd)
        def release() -> None:
            if parent.holds(name, mine):
                os.unlink(name, dir_fd=parent.fd)

        try:
            yield parent
        finally:
            try:
                release()
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM as the lock was let go (a second SIGTERM is ignored)
                release()
                raise
            finally:
                os.close(fd)
    finally:
        parent.close()


# --- leftovers ------------------------------------------------------------------------------------

def _temporary_names(name: str) -> re.Pattern:
    """flashnext's own temporary names for ``name``, exactly: ``.NAME.partial-PID``,
    ``.NAME.old-PID`` and ``.NAME.tmp-PID`` (not ``.NAME.partial-1x``, nor another output's)."""
    return re.compile(rf"\.{re.escape(name)}\.(?P<kind>partial|old|tmp)-(?P<pid>[1-9][0-9]{{0,9}})")


def _writer_gone(pid: int) -> bool:
    """Whether the process that named a temporary file is over (our own earlier attempts are: we
    hold the output's lock). A live one's name is not ours to remove, whatever it looks like."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def remove_leftovers(out: Path, parent: HeldDirectory | None = None) -> Path | None:
    """Remove the temporary siblings of ``out`` that dead writers left, by their exact names: links
    (removing a link changes nothing it points at), files only by their ``.tmp-`` names, directories
    only when they carry flashnext's marker (or are empty). A previous output that a ``--force``
    replace had moved aside (``.OUT.old-PID``) when it was killed is put back when ``out`` is missing;
    returns its path then (only called under the output's lock)."""
    out = Path(out).absolute()
    if parent is None:
        with HeldDirectory.open(out.parent) as held:
            return remove_leftovers(out, held)
    pattern = _temporary_names(out.name)
    set_aside: list[tuple[int, str]] = []
    for name in sorted(os.listdir(parent.fd)):
        m = pattern.fullmatch(name)
        st = parent.lstat(name) if m else None
        if st is None or not _writer_gone(int(m["pid"])):
            continue
        if stat.S_ISLNK(st.st_mode) or (stat.S_ISREG(st.st_mode) and m["kind"] == "tmp"):
            os.unlink(name, dir_fd=parent.fd)
        elif stat.S_ISDIR(st.st_mode) and _marker_at(parent, name) is not None and m["kind"] == "old":
            set_aside.append((st.st_mtime_ns, name))
        elif stat.S_ISDIR(st.st_mode) and (_marker_at(parent, name) is not None or _empty(parent, name)):
            parent.remove_tree(name)
    restored = None
    if set_aside and parent.lstat(out.name) is None:
        newest = max(set_aside)
        set_aside.remove(newest)
        parent.rename(newest[1], out.name)
        restored = out.parent / newest[1]
    for _, name in set_aside:
        parent.remove_tree(name)
    return restored


def _empty(parent: HeldDirectory, name: str) -> bool:
    try:
        with parent.open_directory(name) as d:
            return not os.listdir(d.fd)
    except OSError:
        return False


# --- scratch --------------------------------------------------------------------------------------

# What each command that keeps scratch calls its directories in the system's temporary folder:
# ``flashnext-KIND-`` and tempfile.mkdtemp's eight random characters. Only names of exactly this
# form, holding flashnext's marker, are ever taken for a dead run's scratch.
SCRATCH_KINDS = ("selftest", "patches", "probes", "upload")
_SCRATCH_NAME = re.compile(rf"flashnext-(?:{'|'.join(SCRATCH_KINDS)})-[a-z0-9_]{{8}}")


def _scratch_abandoned(marker: dict) -> bool:
    """Whether the process that a scratch directory's marker names is gone. A process of another
    host or PID namespace (a temporary folder shared by containers) cannot be looked up from here,
    so it never is; nor is this process's own."""
    pid = marker.get("pid")
    here = _where_pids_count()
    return (type(pid) is int and pid > 0 and pid != os.getpid() and all(marker.get(k) == v for k, v in here.items())
            and _writer_gone(pid))


def remove_abandoned_scratch(temporary: Path) -> None:
    """Remove from ``temporary`` the scratch directories that runs killed before their cleanup (a
    SIGKILL, a power loss) left: this user's directories named as :data:`SCRATCH_KINDS` say, that
    carry flashnext's marker and whose process is gone. Best effort: a directory another run
    removes first, or one holding what this user cannot remove, is left, and the command goes on."""
    try:
        held = HeldDirectory.open(temporary)
    except FlashnextError:
        return
    with held:
        for name in sorted(os.listdir(held.fd)):
            if not _SCRATCH_NAME.fullmatch(name):
                continue
            st = held.lstat(name)
            if st is None or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            marker = _marker_at(held, name)
            if marker is not None and _scratch_abandoned(marker):
                try:
                    held.remove_tree(name)
                except OSError:
                    pass  # what is left waits for the next run; this one's work does not depend on it


@contextmanager
def scratch_directory(kind: str, made_by: str, keep: bool = False) -> Iterator[Path]:
    """A new private directory ``flashnext-KIND-XXXXXXXX`` in the system's temporary folder, for what
    the command ``made_by`` needs only while it runs, removed when the block ends however it ends
    (SIGTERM included: it raises as Ctrl-C does, tools/_common.py). Only SIGKILL or a power loss can
    leave it; so it carries flashnext's marker naming this process, and each new scratch directory
    is made after :func:`remove_abandoned_scratch` has removed those whose process is gone. With
    ``keep`` it stays for the user, its marker removed: no later run takes it for a leftover."""
    if kind not in SCRATCH_KINDS:
        raise ValueError(f"scratch kind {kind!r} is not one of SCRATCH_KINDS")
    temporary = Path(tempfile.gettempdir())
    remove_abandoned_scratch(temporary)
    path = Path(tempfile.mkdtemp(prefix=f"flashnext-{kind}-", dir=temporary))
    try:
        write_marker(path, made_by, pid=os.getpid())
        yield path
    finally:
        if keep:
            (path / OUTPUT_MARKER).unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)


# --- atomic outputs -------------------------------------------------------------------------------

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


RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


def _commit(parent: HeldDirectory, partial: str, name: str, replacing: bool) -> None:
    """Put the complete ``partial`` in ``name``'s place. At no moment is there no complete copy:
    the old output and the new one swap in one step where the filesystem can; elsewhere the old
    one is moved aside as ``.NAME.old-PID``, which the next writer puts back if this one dies."""
    if not replacing:
        if not _renameat2(parent.fd, partial, name, RENAME_NOREPLACE):
            parent.rename(partial, name)
        return
    if _renameat2(parent.fd, partial, name, RENAME_EXCHANGE):
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
        if not self.parent.holds(name, identity) or _marker_at(self.parent, name) is None:
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
        if stat.S_ISDIR(st.st_mode) and _marker_at(self.parent, name) is not None:
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


# A full disk (or quota) is met by a write: through a descriptor (pwrite, fsync, a file object) the
# error names no file, and through the held parent only a name relative to it.
_FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


def _name_the_full_disk(error: BaseException, out: Path) -> None:
    """Make a full disk met while ``out`` was written name where: the output, or the name beside it
    (relative to its held parent) that the write was making, so that its one line says which disk."""
    if isinstance(error, OSError) and error.errno in _FULL_DISK:
        name = error.filename
        if name is None:
            error.filename = str(out)
        elif isinstance(name, str) and not os.path.isabs(name):
            error.filename = str(out.parent / name)


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
    created = make_parents(out)
    try:
        with output_lock(out) as parent:
            refuse_overlap_open(parent, out.name, inputs)
            restored = remove_leftovers(out, parent)
            existing = parent.lstat(out.name)
            if existing is not None:
                if not force:
                    how = f" (put back from {restored.name}, left by a --force replace that was interrupted)" \
                        if restored else ""
                    raise _already_exists(out, how)
                marker = _marker_at(parent, out.name) if stat.S_ISDIR(existing.st_mode) else None
                _refuse_unless_replaceable(out, marker, made_by)
            yield OutputDirectory(out, parent, inputs, replacing=existing is not None)
    except BaseException as e:
        remove_empty(created)
        _name_the_full_disk(e, out)
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
        partial = output.make_partial(name, made_by)
        try:
            yield partial.through() if held else out.parent / name
            output.commit(name, partial)
        except BaseException:
            output.discard(name, partial)
            raise
        finally:
            partial.close()


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
    tmp, fd = _create_temporary(parent, name)
    mine = _identity(os.fstat(fd))
    try:
        _write_durably(fd, text)
        parent.rename(tmp, name)
    except BaseException:
        if parent.holds(tmp, mine):
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
        tmp, fd = _create_temporary(parent, path.name)
        mine = _identity(os.fstat(fd))
        try:
            _write_durably(fd, text)
            try:
                if not _renameat2(parent.fd, tmp, path.name, RENAME_NOREPLACE):
                    os.link(tmp, path.name, src_dir_fd=parent.fd, dst_dir_fd=parent.fd, follow_symlinks=False)
            except FileExistsError:
                raise FlashnextError(f"{path} already exists: choose another name (it is never replaced)") from None
            os.fsync(parent.fd)
        finally:
            if parent.holds(tmp, mine):
                os.unlink(tmp, dir_fd=parent.fd)


def check_file_destination(path: Path, option: str, inputs: dict[str, Path | None] | None = None) -> None:
    """Refuse up front, before any work, a file output (``option`` names it: ``--report``) that could
    only fail once the work is done, minutes of it on the real model: one that is, contains or lies
    inside one of ``inputs`` (:func:`refuse_overlap`), a directory, or one whose nearest existing
    folder is no directory or takes no new file (read-only, not permitted): that is found as the write
    will find it, by creating the file's temporary name there exclusively and removing it at once.
    The folders missing on the way are made when it is written (:func:`make_parents`)."""
    path = Path(path)
    refuse_overlap(path, inputs or {})
    if path.is_dir():
        raise FlashnextError(f"{option} {path} is a directory; name a file")
    where = path.absolute().parent
    while not os.path.lexists(where):
        where = where.parent
    try:
        held = HeldDirectory.open(where)
    except FlashnextError as e:
        raise FlashnextError(f"{option} {path} cannot be written: {e}; choose another file") from None
    with held:
        try:
            tmp, fd = _create_temporary(held, path.name)
        except OSError as e:
            raise FlashnextError(f"{option} {path} cannot be written: cannot create a file in {where} "
                                 f"({e.strerror}); choose another file") from None
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
        if not self.parent.holds(partial, _identity(written)):
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
        raise FlashnextError(f"{out} is a directory; --out names {what} to write")
    created = make_parents(out)
    try:
        with output_lock(out) as parent:
            refuse_overlap_open(parent, out.name, inputs)
            for name in (out, *companions):
                remove_leftovers(Path(name), parent)
            existing = parent.lstat(out.name)
            if existing is not None:
                if not force:
                    raise _already_exists(out)
                if stat.S_ISDIR(existing.st_mode) or not is_ours(parent.through(out.name)):
                    raise FlashnextError(f"{out} exists and was not made by {maker}; --force only replaces "
                                         "flashnext's own output: remove it yourself or choose another --out")
            yield OutputFile(out, parent, inputs)
    except BaseException as e:
        remove_empty(created)
        _name_the_full_disk(e, out)
        raise
