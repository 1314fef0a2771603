"""Cleanup by exact name (issue 26, class 2): a writer removes only its own temporary names for
*this* output (``.OUT.partial-PID``, ``.OUT.old-PID``, ``.OUT.tmp-PID`` of a writer that is gone),
not whatever starts the same way (another output's partial, a user's folder); and a ``--force``
replace killed between its renames leaves the previous output recoverable, which the next run
puts back. A command stopped by SIGTERM removes its scratch directory as Ctrl-C does; what a
SIGKILL leaves there the next run removes, by flashnext's marker and only once its process is gone.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner

from flashnext.quant.checkpoint.fsutil import directories, files, locks
from flashnext.tools.cli import main as cli
from support.hostile import Work, mtp, tree_state

MARKER = ".flashnext-output.json"


def flashnext_folder(path: Path) -> Path:
    """A directory flashnext could have made (its marker) holding a file of someone's."""
    path.mkdir()
    (path / MARKER).write_text(json.dumps({"made_by": "make-mtp-int4"}))
    (path / "keep.txt").write_text("not a leftover of --out o")
    return path


def a_file(path: Path) -> Path:
    path.write_text("not a leftover of --out o")
    return path


def o(w: Work) -> list[str]:
    return ["make-mtp-int4", "--src", str(w.snap), "--out", str(w.root / "o"), "--no-progress"]


@dataclass(frozen=True)
class Neighbour:
    id: str
    make: Callable[[Work], Path]


NEIGHBOURS = [
    # Another output's temporary names start with ".o.partial-" too.
    Neighbour("partial-of-o.partial-1", lambda w: flashnext_folder(w.root / ".o.partial-1.partial-5")),
    Neighbour("old-of-o.partial-1", lambda w: flashnext_folder(w.root / ".o.partial-1.old-5")),
    Neighbour("tmp-of-o.partial-1", lambda w: a_file(w.root / ".o.partial-1.tmp-5")),
    Neighbour("partial-1x", lambda w: flashnext_folder(w.root / ".o.partial-1x")),
    Neighbour("old-2x", lambda w: flashnext_folder(w.root / ".o.old-2x")),
    Neighbour("tmp-3x", lambda w: a_file(w.root / ".o.tmp-3x")),
    # Named exactly like a partial of --out o, but by a process that is alive (PID 1): not a
    # leftover of a dead writer, whatever it holds.
    Neighbour("partial-of-a-live-process", lambda w: flashnext_folder(w.root / ".o.partial-1")),
]


@pytest.mark.parametrize("neighbour", NEIGHBOURS, ids=[n.id for n in NEIGHBOURS])
def test_cleanup_removes_only_its_own_exact_names(neighbour: Neighbour, work: Work):
    kept = neighbour.make(work)
    before = tree_state(kept) if kept.is_dir() else kept.read_bytes()
    result = CliRunner().invoke(cli, o(work))
    assert result.exit_code == 0, result.output
    assert (work.root / "o" / "overlay.json").is_file()
    assert kept.exists(), f"{kept.name} was removed as if it were a leftover of --out o"
    assert (tree_state(kept) if kept.is_dir() else kept.read_bytes()) == before


def test_cleanup_still_removes_what_a_dead_writer_of_this_output_left(work: Work):
    dead = [flashnext_folder(work.root / ".o.partial-999999999"), a_file(work.root / ".o.tmp-999999998"),
            work.root / ".o.partial-999999997"]
    os.symlink(work.snap, dead[-1])  # a link at a leftover's name goes; what it points at stays
    snapshot = tree_state(work.snap)
    result = CliRunner().invoke(cli, o(work))
    assert result.exit_code == 0, result.output
    assert not any(p.exists() or p.is_symlink() for p in dead)
    assert tree_state(work.snap) == snapshot


# --- a --force replace killed between its renames ------------------------------------------------

def _kill_at_the_second_rename(monkeypatch) -> list[tuple[str, str]]:
    """The replace is killed (SystemExit, as by a signal) just before the new output is renamed into
    place, the old one already moved aside. The filesystem is taken to lack an atomic exchange, so
    the two-rename path is the one taken."""
    import flashnext.quant.checkpoint.fsutil.held as held

    monkeypatch.setattr(held, "_renameat2", lambda *a, **k: False)
    real = os.rename
    renames: list[tuple[str, str]] = []

    def rename(src, dst, *a, **k):
        if ".partial-" in os.path.basename(src) and os.path.basename(dst) == "out":
            raise SystemExit(137)
        renames.append((os.path.basename(src), os.path.basename(dst)))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", rename)
    return renames


def test_a_force_replace_killed_between_renames_leaves_the_old_output_recoverable(work: Work, monkeypatch):
    out = work.root / "out"
    assert CliRunner().invoke(cli, mtp(work)).exit_code == 0
    (out / "mine.txt").write_text("the only complete copy")
    previous = tree_state(out)

    with monkeypatch.context() as m:
        renames = _kill_at_the_second_rename(m)
        result = CliRunner().invoke(cli, mtp(work, "--force"))
    assert result.exit_code == 137 and any(dst.startswith(".out.old-") for _, dst in renames), result.output
    assert not out.exists()
    aside = [p for p in work.root.iterdir() if p.name.startswith(".out.old-")]
    assert len(aside) == 1 and tree_state(aside[0]) == previous

    # The next run (no --force) puts the previous output back and says so, in one line.
    result = CliRunner().invoke(cli, mtp(work))
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and "put back from .out.old-" in lines[0], result.output
    assert tree_state(out) == previous and not aside[0].exists()

    # And a --force run then replaces it, leaving nothing beside it.
    assert CliRunner().invoke(cli, mtp(work, "--force")).exit_code == 0
    assert not (out / "mine.txt").exists() and (out / "overlay.json").is_file()
    assert not [p for p in work.root.iterdir() if p.name.startswith(".out.")]


def test_the_old_output_survives_a_second_interrupted_replace(work: Work, monkeypatch):
    """After a replace killed between its renames, the next ``--force`` run fails before it is done
    (as a full disk or Ctrl-C would make it): a complete copy of the previous output still exists."""
    import flashnext.quant.overlays.builder as builder

    out = work.root / "out"
    assert CliRunner().invoke(cli, mtp(work)).exit_code == 0
    (out / "mine.txt").write_text("the only complete copy")
    previous = tree_state(out)
    with monkeypatch.context() as m:
        _kill_at_the_second_rename(m)
        assert CliRunner().invoke(cli, mtp(work, "--force")).exit_code == 137

    def killed(*a, **k):
        raise SystemExit(137)

    with monkeypatch.context() as m:
        m.setattr(builder, "write_json", killed)
        assert CliRunner().invoke(cli, mtp(work, "--force")).exit_code == 137
    copies = [p for p in (out, *work.root.glob(".out.old-*")) if p.is_dir() and tree_state(p) == previous]
    assert copies, "no complete copy of the previous output is left"
    assert tree_state(out) == previous  # put back where it was

    result = CliRunner().invoke(cli, mtp(work, "--force"))
    assert result.exit_code == 0, result.output
    assert (out / "overlay.json").is_file() and not (out / "mine.txt").exists()
    assert not [p for p in work.root.iterdir() if p.name.startswith(".out.")]


# --- scratch of a run stopped by a signal (issue 44) ----------------------------------------------
# Real processes and real signals: `flashnext` started with its own temporary folder (TMPDIR), so
# that its scratch directory can be watched, and nothing outside the work tree is touched.

SCRATCH_WAIT_S = 300  # the scratch appears within seconds; this is for a machine under load


def start(argv: list[str], tmpdir: Path, log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "flashnext", *argv], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "TMPDIR": str(tmpdir)})


def _marked_by(directory: Path, pid: int) -> bool:
    try:
        return json.loads((directory / MARKER).read_text()).get("pid") == pid
    except (OSError, ValueError):
        return False


def wait_for_scratch(proc: subprocess.Popen, tmpdir: Path, kind: str, marked: bool = False) -> Path:
    """``proc``'s scratch directory ``flashnext-KIND-*`` in ``tmpdir``, as soon as it exists (with
    ``marked``: once its marker names ``proc``)."""
    deadline = time.monotonic() + SCRATCH_WAIT_S
    while proc.poll() is None and time.monotonic() < deadline:
        for p in tmpdir.glob(f"flashnext-{kind}-*"):
            if p.is_dir() and not p.is_symlink() and (not marked or _marked_by(p, proc.pid)):
                return p
        time.sleep(0.01)
    pytest.fail(f"no flashnext-{kind}-* scratch{' marked with its process' if marked else ''} appeared "
                f"(exit {proc.poll()})")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@dataclass(frozen=True)
class Scratching:
    id: str
    argv: Callable[[Work], list[str]]
    kind: str  # its scratch directory is flashnext-KIND-XXXXXXXX


def selftest(w: Work) -> list[str]:
    return ["selftest", "--out", str(w.root / "report"), "--gpus", "0"]


SCRATCHING = [
    Scratching("selftest", selftest, "selftest"),  # the demo checkpoint and a patched vLLM tree
    Scratching("patches-check", lambda w: ["patches", "check"], "patches"),  # a shadow vLLM tree
]


@pytest.mark.parametrize("command", SCRATCHING, ids=[c.id for c in SCRATCHING])
def test_sigterm_removes_the_scratch_as_ctrl_c_does(command: Scratching, work: Work):
    """SIGTERM (``timeout``, ``docker stop``, systemd) ends the command through its cleanup: its
    scratch is gone, nothing is left beside ``--out``, and the exit is the table's for SIGTERM."""
    from flashnext.errors import EXIT_TERMINATED

    tmpdir = work.root / "tmp"
    tmpdir.mkdir()
    log = work.root / "run.log"
    proc = start(command.argv(work), tmpdir, log)
    try:
        scratch = wait_for_scratch(proc, tmpdir, command.kind)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    finally:
        stop(proc)
    output = log.read_text(errors="replace")
    assert not scratch.exists(), f"{scratch.name} was left behind (exit {code})"
    assert not list(tmpdir.glob("flashnext-*")), "scratch was left behind"
    assert code == EXIT_TERMINATED, output
    assert output.splitlines()[-1] == "terminated", output
    assert not list(work.root.glob(".report*")) and not (work.root / "report").exists()


def marker_like(scratch: Path, **changes) -> dict:
    """The marker of the real ``scratch`` directory, with ``changes``."""
    return {**json.loads((scratch / MARKER).read_text()), **changes}


def marked_folder(path: Path, marker: dict | None) -> Path:
    path.mkdir()
    if marker is not None:
        (path / MARKER).write_text(json.dumps(marker))
    (path / "keep.txt").write_text("not a leftover of a dead flashnext run")
    return path


@dataclass(frozen=True)
class JustMade:
    id: str
    owner: object  # the module or class the maker is looked up in when called
    maker: str  # what makes the thing on disk; the signal lands as it returns
    run: Callable[[Path], None]


def _in_atomic_directory(out: Path) -> None:
    from flashnext.quant.checkpoint.fsutil import atomic_directory

    with atomic_directory(out, made_by="selftest"):
        pass


def _in_output_lock(out: Path) -> None:
    from flashnext.quant.checkpoint.fsutil import output_lock

    with output_lock(out):
        pass


def _in_scratch(out: Path) -> None:
    from flashnext.quant.checkpoint.fsutil import scratch_directory

    with scratch_directory("selftest", "selftest"):
        pass


def _a_file(out: Path) -> None:
    from flashnext.quant.checkpoint.fsutil import write_text_atomic

    write_text_atomic(out, "{}\n")


JUST_MADE = [
    JustMade("partial-directory", directories.OutputDirectory, "make_partial", _in_atomic_directory),
    JustMade("missing-parents", directories, "make_parents",
             lambda out: _in_atomic_directory(out.parent / "a" / "b" / out.name)),
    JustMade("lock", locks, "_open_lock", _in_output_lock),
    JustMade("scratch", tempfile, "mkdtemp", _in_scratch),
    JustMade("temporary-file", files, "_create_temporary", _a_file),
]


@pytest.mark.parametrize("site", JUST_MADE, ids=[s.id for s in JUST_MADE])
def test_sigterm_just_after_a_make_waits_for_the_cleanup_that_removes_it(site: JustMade, tmp_path, monkeypatch):
    """A SIGTERM that lands the moment a partial, a lock, a scratch directory or a temporary file has
    been made, before the ``try`` that removes it, is held until that ``try`` runs (CI once found a
    ``.report.partial-PID`` that ``selftest`` left this way). Made deterministic here: the maker
    itself sends the signal as it returns."""
    from flashnext.errors import Terminated
    from flashnext.tools._common import sigterm_as_interrupt

    real = getattr(site.owner, site.maker)

    def made_then_signalled(*args, **kwargs):
        made = real(*args, **kwargs)
        signal.raise_signal(signal.SIGTERM)
        return made

    work = tmp_path / "w"
    work.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    monkeypatch.setattr(site.owner, site.maker, made_then_signalled)
    with pytest.raises(Terminated), sigterm_as_interrupt():
        site.run(work / "out")
    assert sorted(os.listdir(work)) == []


def test_the_next_run_removes_what_a_killed_run_left_and_nothing_else(work: Work):
    """A selftest killed outright (SIGKILL: no cleanup can run) leaves its scratch; the next run
    removes it, by its marker and because its process is gone, and leaves every directory that
    only looks like one: no marker (a user's, or one kept with --keep), a live process's, another
    host's or PID namespace's, a name tempfile would not make, a link to a dead run's scratch."""
    tmpdir = work.root / "tmp"
    tmpdir.mkdir()
    first = start(selftest(work), tmpdir, work.root / "first.log")
    try:
        left = wait_for_scratch(first, tmpdir, "selftest", marked=True)
        first.kill()
        first.wait()
    finally:
        stop(first)
    assert left.is_dir(), "SIGKILL should leave the scratch for the next run"
    dead = marker_like(left)  # the very marker of a run that is gone
    elsewhere = marked_folder(work.root / "elsewhere", dead)
    kept = [
        marked_folder(tmpdir / "flashnext-selftest-usrfoldr", None),
        marked_folder(tmpdir / "flashnext-selftest-liveproc", marker_like(left, pid=os.getpid())),
        marked_folder(tmpdir / "flashnext-selftest-otherhst", marker_like(left, host=f"not-{socket.gethostname()}")),
        marked_folder(tmpdir / "flashnext-selftest-otherpns", marker_like(left, pid_namespace="pid:[1]")),
        marked_folder(tmpdir / "flashnext-selftest-dead", dead),
        marked_folder(tmpdir / "flashnext-selftest-deadrun1x", dead),
        marked_folder(tmpdir / "flashnext-nokind-deadrun1", dead),
    ]
    link = tmpdir / "flashnext-selftest-linkdead"
    os.symlink(elsewhere, link)
    before = {p: tree_state(p) for p in (*kept, elsewhere)}

    second = start(selftest(work), tmpdir, work.root / "second.log")
    try:
        own = wait_for_scratch(second, tmpdir, "selftest", marked=True)  # made after the sweep
        second.send_signal(signal.SIGTERM)
        second.wait(120)
    finally:
        stop(second)
    assert not left.exists(), f"{left.name}, left by a killed run, was not removed"
    assert {p: tree_state(p) for p in (*kept, elsewhere)} == before
    assert link.is_symlink() and os.readlink(link) == str(elsewhere)
    assert not own.exists()


def test_scratch_kept_with_keep_is_the_users(tmp_path, monkeypatch):
    """``selftest --keep``'s scratch stays, without the marker: no later run takes it for a leftover."""
    import tempfile

    from flashnext.quant.checkpoint.fsutil import remove_abandoned_scratch, scratch_directory

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with scratch_directory("selftest", "flashnext selftest", keep=True) as kept:
        assert json.loads((kept / MARKER).read_text())["pid"] == os.getpid()
        (kept / "demo").mkdir()
    assert kept.parent == tmp_path and (kept / "demo").is_dir() and not (kept / MARKER).exists()
    remove_abandoned_scratch(tmp_path)
    assert (kept / "demo").is_dir()
