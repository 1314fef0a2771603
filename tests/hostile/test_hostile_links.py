"""flashnext's own temporary names as attack surface (issue 26, class 1): whoever can write in an
output's parent can plant ``.OUT.partial-PID``, ``.OUT.lock``, ``.NAME.tmp-PID`` or ``FILE.partial``
as a link before a command runs, or swap the partial directory or the output's parent for a link
into the snapshot while it runs. Whatever the command then does (finish, or refuse in one line with
exit 1), it never writes through the link: the victim is byte-for-byte what it was, nothing appears
where a link points, and the snapshot is unchanged. The swaps happen at exact points of the writer
(a monkeypatched step it always takes), not after a sleep.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner

from flashnext.tools.cli import main as cli
from support.hostile import MTP_SHARD, Work, apply, interrupt_ple_build, mtp, ple_build, repack, tree_state

PID = os.getpid()  # CliRunner runs the command in this process: its temporary names carry this PID


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ple_source_shard(work: Work) -> Path:
    """The snapshot file holding the first PLE table shard (what a resume must never write)."""
    import flashnext.quant.ple.table as mod

    return mod.find_ple_source(mod.Snapshot.open(work.snap)).shards[0].path


# --- what a planted name points at ----------------------------------------------------------------

@dataclass(frozen=True)
class Victim:
    kind: str  # "symlink" or "hardlink"
    target: Callable[[Work], Path]  # what the planted name links to
    exists: bool = True  # False: a symlink to nothing, which must stay nothing


def victim_file(w: Work) -> Path:
    path = w.root / "victim.bin"
    if not path.exists():
        path.write_bytes(b"someone else's bytes\n" * 64)
    return path


VICTIMS = {
    "symlink-file": Victim("symlink", victim_file),
    "symlink-absent": Victim("symlink", lambda w: w.root / "absent", exists=False),
    "symlink-snapshot": Victim("symlink", lambda w: w.snap),
    "symlink-shard": Victim("symlink", lambda w: w.snap / MTP_SHARD),
    "hardlink-file": Victim("hardlink", victim_file),
    "hardlink-shard": Victim("hardlink", lambda w: w.snap / MTP_SHARD),
}


def plant(w: Work, name: Path, victim: Victim) -> Path:
    target = victim.target(w)
    if victim.kind == "symlink":
        os.symlink(target, name)
    else:
        os.link(target, name)
    return target


def victim_state(w: Work, target: Path) -> object:
    if target.is_dir():
        return tree_state(target)
    return _digest(target) if target.exists() else None


# --- the table ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Planted:
    id: str
    name: Callable[[Work], Path]  # the temporary name to plant
    command: Callable[[Work], list[str]]
    # victim -> what must happen: "done" (the link is removed, not followed, and the command
    # completes), "refused" (one line, exit 1, the link left where it is), "either"
    victims: dict[str, str]
    before: Callable[[Work, object], None] = lambda w, monkeypatch: None  # e.g. an interrupted build
    done: Callable[[Work], bool] = lambda w: True  # a successful run's output is complete


def mtp_done(w: Work) -> bool:
    return (w.root / "out" / "overlay.json").is_file()


def ple_done(w: Work) -> bool:
    return CliRunner().invoke(cli, ["ple", "verify", "--full", str(w.root / "new.bin")]).exit_code == 0


def report(w: Work) -> list[str]:
    return mtp(w, "--report", str(w.root / "report.json"))


def write_profile(w: Work) -> list[str]:
    return ["plan", "--gpus", "4", "--gpu-memory", "24", "--host-ram", "125",
            "--write-profile", str(w.root / "rig.json")]


def profile_done(w: Work) -> bool:
    from flashnext.serving.profiles import load_profile

    return load_profile(str(w.root / "rig.json")).name == "rig" and not (w.root / f".rig.json.tmp-{PID}").exists()


LOCK_VICTIMS = {"symlink-file": "refused", "symlink-absent": "refused", "symlink-shard": "refused",
                "hardlink-file": "refused"}
# A directory's temporary name: a link there is a leftover to remove, never a directory to enter.
DIR_VICTIMS = {"symlink-file": "done", "symlink-absent": "done", "symlink-snapshot": "done"}


def ple_format(w: Work) -> list[str]:
    return ["ple", "build", "--src", str(w.snap), "--out", str(w.root / "out"), "--format", "nvfp4", "--no-progress"]


def overlay_done(w: Work) -> bool:
    out = w.root / "out"
    return CliRunner().invoke(cli, ["overlay", "verify", "--base", str(w.snap), str(out)]).exit_code == 0


def view_done(w: Work) -> bool:
    return CliRunner().invoke(cli, ["overlay", "verify", str(w.root / "out")]).exit_code == 0


def repacked_without_exchange(w: Work, monkeypatch) -> None:
    """An output to replace, on a filesystem without renameat2's exchange: the replace moves the
    previous output aside as ``.out.old-PID`` first."""
    import flashnext.quant.checkpoint.fsutil.held as held

    assert CliRunner().invoke(cli, repack(w)).exit_code == 0
    monkeypatch.setattr(held, "_renameat2", lambda *a, **k: False)

PLANTED = [
    # A link at the writer's own partial name is a leftover to remove, never a directory to enter.
    Planted("partial-dir", lambda w: w.root / f".out.partial-{PID}", mtp,
            {"symlink-file": "done", "symlink-absent": "done", "symlink-snapshot": "done"}, done=mtp_done),
    # A lock that is not a regular file of ours with one link is refused, and left as it is.
    Planted("lock-mtp", lambda w: w.root / ".out.lock", mtp, LOCK_VICTIMS),
    Planted("lock-ple", lambda w: w.root / ".new.bin.lock", ple_build, LOCK_VICTIMS),
    Planted("lock-apply", lambda w: w.root / ".out.lock", apply, LOCK_VICTIMS),
    Planted("tmp-report", lambda w: w.root / f".report.json.tmp-{PID}", report,
            dict.fromkeys(("symlink-file", "symlink-absent", "symlink-shard", "hardlink-file", "hardlink-shard"),
                          "either"),
            done=lambda w: mtp_done(w) and '"make-mtp-int4"' in (w.root / "report.json").read_text()),
    # plan --write-profile writes a new file through the same temporary name as every small file: a
    # link or file planted there is removed, never followed, and does not block it (issue 44).
    Planted("tmp-profile", lambda w: w.root / f".rig.json.tmp-{PID}", write_profile,
            dict.fromkeys(("symlink-file", "symlink-absent", "symlink-shard", "hardlink-file", "hardlink-shard"),
                          "done"), done=profile_done),
    # A resume of an interrupted build into a partial that is now a link (to a source shard).
    Planted("ple-resume-partial", lambda w: w.root / "new.bin.partial", ple_build,
            dict.fromkeys(("symlink-shard", "hardlink-shard", "symlink-file", "hardlink-file"), "refused"),
            before=lambda w, monkeypatch: interrupt_ple_build(w, monkeypatch), done=ple_done),
    # Issue 42: every other temporary name, planted before a fresh run of each writer that makes it.
    # The partial directory of the other atomic_directory writers (demo-checkpoint and selftest take
    # the same path, and seconds more).
    Planted("partial-dir-repack", lambda w: w.root / f".out.partial-{PID}", repack, DIR_VICTIMS, done=overlay_done),
    Planted("partial-dir-apply", lambda w: w.root / f".out.partial-{PID}", apply, DIR_VICTIMS, done=view_done),
    # The previous output set aside by a --force replace where the filesystem has no atomic exchange.
    Planted("old-dir-repack-force", lambda w: w.root / f".out.old-{PID}", lambda w: repack(w, "--force"),
            DIR_VICTIMS, before=repacked_without_exchange, done=overlay_done),
    Planted("lock-repack", lambda w: w.root / ".out.lock", repack, LOCK_VICTIMS),
    Planted("lock-ple-format", lambda w: w.root / ".out.lock", ple_format, LOCK_VICTIMS),
    # ple build --format's resumable partial and journal (quant/overlays/resume.py): a partial
    # without its journal is no build of flashnext's, refused; a journal that is a link is no
    # journal to read (never followed), removed, and the build starts over.
    Planted("ple-format-partial", lambda w: w.root / ".out.partial", ple_format,
            dict.fromkeys(("symlink-file", "symlink-absent", "symlink-snapshot"), "refused")),
    Planted("ple-format-journal", lambda w: w.root / ".out.partial.json", ple_format,
            dict.fromkeys(("symlink-file", "symlink-absent", "symlink-shard", "hardlink-file"), "done"),
            done=overlay_done),
    Planted("ple-format-journal-tmp", lambda w: w.root / f".out.partial.json.tmp-{PID}", ple_format,
            dict.fromkeys(("symlink-file", "symlink-absent", "hardlink-file"), "done"), done=overlay_done),
    # The bf16 table's partial, journal, sidecar and their temporaries, on a fresh build.
    Planted("ple-partial", lambda w: w.root / "new.bin.partial", ple_build,
            dict.fromkeys(("symlink-file", "symlink-absent", "symlink-shard"), "refused")),
    Planted("ple-journal", lambda w: w.root / "new.bin.partial.json", ple_build,
            dict.fromkeys(("symlink-file", "symlink-absent", "symlink-shard", "hardlink-file"), "done"),
            done=ple_done),
    Planted("ple-journal-tmp", lambda w: w.root / f".new.bin.partial.json.tmp-{PID}", ple_build,
            dict.fromkeys(("symlink-file", "symlink-absent", "hardlink-file"), "done"), done=ple_done),
    Planted("ple-sidecar-tmp", lambda w: w.root / f".new.bin.json.tmp-{PID}", ple_build,
            dict.fromkeys(("symlink-file", "symlink-absent", "hardlink-file"), "done"), done=ple_done),
    Planted("ple-sidecar", lambda w: w.root / "new.bin.json", ple_build,
            dict.fromkeys(("symlink-file", "symlink-absent", "hardlink-file"), "either"), done=ple_done),
]

CASES = [(p, v, expect) for p in PLANTED for v, expect in p.victims.items()]


def _victim(w: Work, planted: Planted, victim: str) -> Victim:
    # The PLE writers' shard is the PLE source shard they copy from (and a resume would write into).
    if planted.id.startswith("ple-") and victim.endswith("-shard"):
        return Victim(VICTIMS[victim].kind, ple_source_shard)
    return VICTIMS[victim]


def _link_state(name: Path) -> object:
    st = os.lstat(name)
    return os.readlink(name) if name.is_symlink() else (st.st_dev, st.st_ino)


@pytest.mark.parametrize("planted,victim,expect", CASES, ids=[f"{p.id}-{v}" for p, v, _ in CASES])
def test_a_planted_link_is_never_written_through(planted: Planted, victim: str, expect: str, work: Work,
                                                 monkeypatch):
    planted.before(work, monkeypatch)
    name = planted.name(work)
    if name.exists() or name.is_symlink():
        name.unlink()  # the interrupted build's own partial, replaced by the link
    how = _victim(work, planted, victim)
    target = plant(work, name, how)
    before, snapshot, link = victim_state(work, target), tree_state(work.snap), _link_state(name)

    result = CliRunner().invoke(cli, planted.command(work))

    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert victim_state(work, target) == before, "the command wrote through the planted link"
    if not how.exists:
        assert not target.exists() and not target.is_symlink(), "the command created a file where the link points"
    assert tree_state(work.snap) == snapshot, "the command wrote into the snapshot"
    lines = [line for line in result.output.splitlines() if line.strip()]
    if expect == "done" or (expect == "either" and result.exit_code == 0):
        assert result.exit_code == 0 and planted.done(work), result.output
    else:
        assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), result.output
    if expect == "refused":
        assert _link_state(name) == link, "the refused command removed or changed the planted link"


# --- swaps while the writer runs ------------------------------------------------------------------

def _swap_for_link(path: Path, target: Path) -> Path:
    """Move ``path`` aside and put a link to ``target`` in its place; returns where it went."""
    moved = path.with_name(path.name + ".moved")
    os.rename(path, moved)
    os.symlink(target, path)
    return moved


def swap_partial_dir(work: Work, monkeypatch) -> None:
    """make-mtp-int4's partial directory becomes a link to the snapshot right after it is made
    (the writer always marks it first)."""
    import flashnext.quant.checkpoint.fsutil.directories as directories

    real = directories.write_marker

    def marked_then_swapped(directory, made_by):
        real(directory, made_by)
        _swap_for_link(work.root / f".out.partial-{PID}", work.snap)

    monkeypatch.setattr(directories, "write_marker", marked_then_swapped)


def swap_parent(module: str):
    """The output's parent becomes a link to the snapshot right after the lock is taken (the
    writer's first step under the lock is always the leftover sweep)."""
    def setup(work: Work, monkeypatch) -> None:
        import importlib

        mod = importlib.import_module(module)
        real = mod.remove_leftovers
        swapped = []

        def swept_then_swapped(*a, **k):
            result = real(*a, **k)
            if not swapped:
                swapped.append(_swap_for_link(work.root / "p", work.snap))
            return result

        monkeypatch.setattr(mod, "remove_leftovers", swept_then_swapped)
    return setup


def swap_ple_partial(work: Work, monkeypatch) -> None:
    """``ple build``'s partial file becomes a hardlink of a source shard as the first shard is copied."""
    import flashnext.quant.ple.table as mod

    real = mod._copy_shard
    shard_file = ple_source_shard(work)

    def copy_after_swap(shard, *a, **k):
        partial = work.root / "new.bin.partial"
        if not partial.with_name("new.bin.partial.moved").exists():
            os.rename(partial, partial.with_name("new.bin.partial.moved"))
            os.link(shard_file, partial)
        return real(shard, *a, **k)

    monkeypatch.setattr(mod, "_copy_shard", copy_after_swap)


def in_p(command: Callable[[Work], list[str]], out: str) -> Callable[[Work], list[str]]:
    def argv(w: Work) -> list[str]:
        (w.root / "p").mkdir()
        args = command(w)
        return [str(w.root / "p" / out) if a == str(w.root / out) else a for a in args]
    return argv


@dataclass(frozen=True)
class Swap:
    id: str
    setup: Callable[[Work, object], None]
    command: Callable[[Work], list[str]]
    done: Callable[[Work], bool]  # where a successful run's output must be complete


SWAPS = [
    Swap("mtp-partial-dir-to-snapshot", swap_partial_dir, mtp, mtp_done),
    Swap("mtp-parent-to-snapshot", swap_parent("flashnext.quant.checkpoint.fsutil.directories"), in_p(mtp, "out"),
         lambda w: (w.root / "p.moved" / "out" / "overlay.json").is_file()),
    Swap("demo-parent-to-snapshot", swap_parent("flashnext.quant.checkpoint.fsutil.directories"),
         lambda w: ((w.root / "p").mkdir(), ["demo-checkpoint", "--out", str(w.root / "p" / "demo")])[1],
         lambda w: (w.root / "p.moved" / "demo" / "config.json").is_file()),
    Swap("ple-parent-to-snapshot", swap_parent("flashnext.quant.checkpoint.fsutil.files"), in_p(ple_build, "new.bin"),
         lambda w: CliRunner().invoke(cli, ["ple", "verify", "--full", str(w.root / "p.moved" / "new.bin")]).exit_code == 0),
    Swap("ple-partial-to-source-shard", swap_ple_partial, ple_build,
         lambda w: ple_done(w) and (w.root / "new.bin").stat().st_nlink == 1),
]


@pytest.mark.parametrize("swap", SWAPS, ids=[s.id for s in SWAPS])
def test_a_swap_while_writing_changes_nothing_it_points_at(swap: Swap, work: Work, monkeypatch):
    argv = swap.command(work)
    swap.setup(work, monkeypatch)
    snapshot = tree_state(work.snap)
    shard_digests = {p.name: _digest(p) for p in work.snap.iterdir() if p.is_file()}

    result = CliRunner().invoke(cli, argv)
    monkeypatch.undo()

    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert tree_state(work.snap) == snapshot, "the command wrote into the snapshot"
    assert {p.name: _digest(p) for p in work.snap.iterdir() if p.is_file()} == shard_digests
    lines = [line for line in result.output.splitlines() if line.strip()]
    if result.exit_code == 0:
        assert swap.done(work), result.output
    else:
        assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), result.output
        assert not (work.root / "out").exists() and not (work.root / "new.bin").exists()


def test_the_report_is_never_written_inside_the_snapshot_by_a_swapped_parent(work: Work, monkeypatch):
    """``--report``'s folder checked before the build, then swapped for a link into the snapshot: the
    report is written where the folder really is, or refused; never inside the snapshot."""
    import flashnext.quant.overlays.mtp_int4 as mtp_mod

    (work.root / "r").mkdir()
    real = mtp_mod.make_mtp_int4

    def build_then_swap(*a, **k):
        result = real(*a, **k)
        shutil.rmtree(work.root / "r")
        os.symlink(work.snap, work.root / "r")
        return result

    monkeypatch.setattr(mtp_mod, "make_mtp_int4", build_then_swap)
    snapshot = tree_state(work.snap)
    result = CliRunner().invoke(cli, mtp(work, "--report", str(work.root / "r" / "report.json")))
    monkeypatch.undo()
    assert tree_state(work.snap) == snapshot, "the report was written inside the snapshot"
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and "lies inside the source snapshot" in lines[0], result.output


def test_an_error_inside_a_held_directory_names_the_users_path(tmp_path, monkeypatch):
    """Writes go through ``/proc/self/fd/N``; a failure there (a full disk, a permission) must still
    name the directory the user gave, in the one line the CLI prints."""
    import errno

    import click

    from flashnext.quant.checkpoint.fsutil import HeldDirectory
    from flashnext.tools._common import user_errors

    out = tmp_path / "my-output"
    out.mkdir()
    with HeldDirectory.open(out) as held:
        inside = held.through("shard.safetensors")

    @user_errors
    def write():
        raise OSError(errno.ENOSPC, "No space left on device", str(inside))

    with pytest.raises(click.ClickException) as e:
        write()
    assert e.value.message == f"No space left on device: {out / 'shard.safetensors'}"


# --- the serving runtime's lock in the shared temporary folder --------------------------------------

HOST_POOL_PLANTS = {
    # what is planted at the lock's name -> whether a lock is then taken there
    "symlink-file": False,
    "symlink-absent": False,
    "symlink-snapshot": False,
    "fifo": False,
    "directory": False,
    "hardlink-file": True,  # a regular file: locked (flock only; nothing is written into it)
}


@pytest.mark.parametrize("planted", sorted(HOST_POOL_PLANTS))
def test_the_host_pool_lock_is_never_opened_through_a_link(planted: str, work: Work):
    """``VLLM_HOST_POOL_LOCK`` (``/tmp/flashnext-host-pool.lock``) is created in a folder anyone can
    write: a link planted there first is refused, in one line, never followed (a dangling one would
    have the open create the file it points at); a FIFO or a directory is no lock either."""
    from flashnext.errors import FlashnextError
    from flashnext.serving.runtime.host_pool import host_pool_lock

    lock = work.root / "flashnext-host-pool.lock"
    if planted == "fifo":
        os.mkfifo(lock)
        target = None
    elif planted == "directory":
        lock.mkdir()
        target = None
    else:
        target = plant(work, lock, VICTIMS[planted])
    before = victim_state(work, target) if target is not None else None
    snapshot = tree_state(work.snap)
    if HOST_POOL_PLANTS[planted]:
        with host_pool_lock(str(lock)):
            pass
    else:
        with pytest.raises(FlashnextError, match="host pool lock .* (is a symbolic link|is not a regular file)") as e:
            with host_pool_lock(str(lock)):
                pass
        assert len(str(e.value).splitlines()) == 1
    if target is not None:
        assert victim_state(work, target) == before
        if not VICTIMS[planted].exists:
            assert not target.exists() and not target.is_symlink(), "the lock was created where the link points"
    assert tree_state(work.snap) == snapshot
