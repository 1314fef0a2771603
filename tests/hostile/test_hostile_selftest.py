"""Issue 42: ``flashnext selftest`` with a hostile ``--out``, and interrupted while it runs.

``--out`` is refused up front, in one line with exit 1, before any of the selftest's minutes: an
existing file, a link (to a directory, to an earlier selftest's report, dangling), a FIFO (never
opened), a path under a file or a dangling link, inside a Hugging Face cache's own folders, in a
folder it cannot write. Its work (``run_selftest``) is replaced by one that fails the test if it is
ever reached; nothing in the work tree changes, and no scratch is left. ``bench``, the other report
writer with an ``--out`` directory, refuses the same way before a request.

Interrupted (Ctrl-C, SIGTERM) in its last CPU step, with the demo checkpoint and its PLE overlays
built in its scratch, the report's partial made beside ``--out`` and a vLLM interpreter running as
its child: exit 130 or 143 and that word as the last line, the child gone, no scratch and nothing
beside ``--out`` left. The signal is real, sent by that child to this process while the command
waits on it (so it always lands inside the command); the steps before it are the selftest's own,
except the patch series check (stubbed as not applying: it takes half a minute) and the demo
checkpoint (the session's copied, not written again). ``test_hostile_cleanup.py`` sends SIGTERM to a
real ``flashnext selftest`` process as its scratch appears, and SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner

from flashnext.tools.cli import main as cli
from support.hostile import Work, invoke_expecting_one_line, modes_bind, tree_state

REV = "0123456789abcdef0123456789abcdef01234567"
NOT_OURS = "was not made by flashnext (no .flashnext-output.json); --force only replaces"


def selftest(out: Path, *extra: str) -> list[str]:
    return ["selftest", "--out", str(out), "--gpus", "0", *extra]


def bench(out: Path, *extra: str) -> list[str]:
    return ["bench", "http://127.0.0.1:9/v1", "--out", str(out), "--no-progress", *extra]


def a_file(w: Work) -> Path:
    path = w.root / "notes.txt"
    path.write_text("mine")
    return path


def a_link_to_a_folder(w: Work) -> Path:
    (w.root / "mine").mkdir()
    (w.root / "mine" / "keep.txt").write_text("mine")
    os.symlink(w.root / "mine", w.root / "report")
    return w.root / "report"


def a_link_to_an_earlier_report(w: Work) -> Path:
    """A link to a directory an earlier selftest made (its marker says so): --force replaces a
    report, never what a link points at."""
    earlier = w.root / "earlier"
    earlier.mkdir()
    (earlier / ".flashnext-output.json").write_text(json.dumps({"made_by": "flashnext selftest"}))
    (earlier / "report.json").write_text("{}")
    os.symlink(earlier, w.root / "report")
    return w.root / "report"


def a_dangling_link(w: Work) -> Path:
    os.symlink(w.root / "nowhere", w.root / "report")
    return w.root / "report"


def a_fifo(w: Work) -> Path:
    os.mkfifo(w.root / "report")
    return w.root / "report"


def in_a_hub_snapshot(w: Work) -> Path:
    snapshot = w.root / "hf" / "hub" / "models--org--name" / "snapshots" / REV
    snapshot.mkdir(parents=True)
    return snapshot / "selftest"


def read_only_folder(w: Work) -> Path:
    folder = w.root / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    return folder / "report"


@dataclass(frozen=True)
class Out:
    id: str
    out: Callable[[Work], Path]
    message: str
    extra: tuple[str, ...] = ()
    command: Callable[..., list[str]] = selftest
    needs_modes: bool = False  # only where file modes stop this process (not root with CAP_DAC_OVERRIDE)


OUTS = [
    Out("a-file", a_file, "already exists: choose another --out or pass --force"),
    Out("a-file-force", a_file, NOT_OURS, ("--force",)),
    Out("a-link-to-a-folder", a_link_to_a_folder, "already exists"),
    Out("a-link-to-a-folder-force", a_link_to_a_folder, NOT_OURS, ("--force",)),
    Out("a-link-to-an-earlier-report-force", a_link_to_an_earlier_report, NOT_OURS, ("--force",)),
    Out("a-dangling-link", a_dangling_link, "already exists"),
    Out("a-dangling-link-force", a_dangling_link, NOT_OURS, ("--force",)),
    Out("a-fifo", a_fifo, "already exists"),
    Out("a-fifo-force", a_fifo, NOT_OURS, ("--force",)),
    Out("under-a-file", lambda w: a_file(w) / "report", "is not a directory one can enter"),
    Out("under-a-dangling-link", lambda w: a_dangling_link(w) / "report", "cannot create"),
    Out("in-a-hub-snapshot", in_a_hub_snapshot, "lies inside the Hugging Face cache's models--org--name/snapshots"),
    Out("in-a-read-only-folder", read_only_folder, "Permission denied", needs_modes=True),
    Out("bench-a-file", a_file, "already exists: choose another --out or pass --force", command=bench),
    Out("bench-a-fifo-force", a_fifo, NOT_OURS, ("--force",), command=bench),
]


@pytest.fixture
def no_selftest_work(monkeypatch, work: Work) -> Path:
    """The selftest's work, replaced by a failure that says it ran; its temporary folder private."""
    import flashnext.serving.selftest.runner as runner

    def ran(*a, **k):
        raise AssertionError("the selftest ran before --out was refused")

    monkeypatch.setattr(runner, "run_selftest", ran)
    tmp = work.root / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


@pytest.mark.parametrize("case", OUTS, ids=[o.id for o in OUTS])
def test_a_hostile_out_is_refused_before_any_work(case: Out, work: Work, no_selftest_work):
    if case.needs_modes and not modes_bind():
        pytest.skip("this process writes whatever the file modes say (root with CAP_DAC_OVERRIDE)")
    argv = case.command(case.out(work), *case.extra)
    before = tree_state(work.root)
    result, line = invoke_expecting_one_line(argv)
    assert result.exit_code == 1 and line.startswith("Error: ") and case.message in line, line
    assert tree_state(work.root) == before, "the command wrote or removed something"


# --- interrupted while it runs ----------------------------------------------------------------------

# The vLLM interpreter's stand-in: it says who it is, tells the selftest (its parent) to stop, then
# waits to be ended.
CHILD = ("import os, sys, time; open(sys.argv[2], 'w').write(str(os.getpid())); "
         "os.kill(os.getppid(), int(sys.argv[1])); time.sleep(120)")


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs: gone, or ended and not yet reaped (subprocess leaves a child it
    killed on Ctrl-C to its parent's exit, bpo-25942), it does not."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
                         ids=["ctrl-c", "sigterm"])
def test_a_selftest_interrupted_in_its_last_cpu_step_leaves_nothing(sig, code, word, work: Work, monkeypatch):
    import flashnext.quant.demo as demo
    import flashnext.serving.selftest.runner as runner
    from flashnext.serving.selftest.report import SeriesCheck

    tmp = work.root / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(runner, "check_series", lambda patches: SeriesCheck(status="failed", detail="stubbed",
                                                                            patches=[]))
    monkeypatch.setattr(demo, "write_demo_checkpoint", lambda path: shutil.copytree(work.snap, path))
    seen = {}

    def in_vllm(config, workdir, tree, snapshot, built):
        seen["scratch"] = sorted(p.name for p in workdir.iterdir())
        seen["beside"] = sorted(p.name for p in work.root.iterdir() if p.name.startswith(".report"))
        # As check_in_vllm runs its interpreter: subprocess.run, which ends the child on an exception.
        subprocess.run([sys.executable, "-c", CHILD, str(int(sig)), str(work.root / "child.pid")], timeout=120)
        raise AssertionError("the signal did not stop the selftest")

    monkeypatch.setattr(runner, "check_in_vllm", in_vllm)
    result = CliRunner().invoke(cli, selftest(work.root / "report"))
    monkeypatch.undo()

    assert {"demo", "ple-formats"} <= set(seen.get("scratch", ())), seen  # it had got that far
    assert any(n.startswith(".report.partial-") for n in seen["beside"]), seen
    assert result.exit_code == code, result.output
    assert result.output.splitlines()[-1] == word, result.output
    assert not alive(int((work.root / "child.pid").read_text())), "the selftest's child was left running"
    assert not list(tmp.glob("flashnext-*")), "scratch was left behind"
    assert not (work.root / "report").exists() and not list(work.root.glob(".report*"))
