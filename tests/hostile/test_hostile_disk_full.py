"""Issue 42: a full disk at every stage of ``ple build`` (``--format nvfp4|fp8``, and the bf16 table
file). A stage is one write-ish call the writer makes: a file or directory created, bytes written
(``pwrite``, ``ftruncate``, a file object's ``write``), an ``fsync``, a rename. They are first
counted on an uninterrupted run (in this process, only calls made from flashnext's own code), then
the run is repeated with ``OSError(ENOSPC)`` raised at each one in turn: the first and the last
occurrence of every distinct stage (the call and the function making it), the points where what
the build has made so far differs; a chunk's journal write in the middle is the same stage as the
first chunk's.

Each must end in one line that says the disk is full and where, exit 1, and no finished-looking
output: ``out`` exists only if it is complete (the stage was the very fsync after its rename), and
beside it only what a resume continues from (``.out.partial`` and its journal). The next run
without the fault must then make exactly what the uninterrupted run made (JSON timings aside),
leaving nothing else beside it; where ``out`` was already complete, it refuses to replace it.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

import flashnext.quant.checkpoint.fsutil.held as held
from flashnext.tools.cli import main as cli
from support.hostile import Work, output_state

# What a resumable build keeps for the next run after a full disk: its partial and journal.
RESUMABLE = re.compile(r"\.?out\.partial(\.json)?")


@dataclass(frozen=True)
class Build:
    id: str
    extra: tuple[str, ...]
    beside: tuple[str, ...]  # what a finished build leaves in --out's folder

    def argv(self, w: Work, out: Path) -> list[str]:
        return ["ple", "build", "--src", str(w.snap), "--out", str(out), "--no-progress", *self.extra]


BUILDS = [
    Build("nvfp4", ("--format", "nvfp4"), ("out",)),
    Build("fp8", ("--format", "fp8"), ("out",)),
    Build("bf16-table", (), ("out", "out.json")),
]


@dataclass
class Disk:
    """The write-ish calls of flashnext's code, counted; full (ENOSPC) at call ``full_at``."""

    full_at: int | None = None
    calls: list[str] = field(default_factory=list)

    def hit(self, what: str, filename=None) -> None:
        self.calls.append(what)
        if len(self.calls) == self.full_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([filename] if filename is not None else []))


class _FullFile:
    """A file object flashnext opened to write (``os.fdopen``): its ``write`` is a stage."""

    def __init__(self, f, disk: Disk, where: str):
        self._f, self._disk, self._where = f, disk, where

    def write(self, data):
        self._disk.hit(f"write@{self._where}")
        return self._f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


def _path_arg(args) -> object:
    """The path a call names (an OSError of it names that file), or None for a descriptor."""
    return args[0] if args and isinstance(args[0], (str, bytes, os.PathLike)) else None


def _caller() -> tuple[str, str]:
    frame = sys._getframe(2)
    return frame.f_globals.get("__name__", ""), frame.f_code.co_name


def install(monkeypatch, disk: Disk) -> None:
    """Route the write-ish calls through ``disk`` (only those made from flashnext's modules)."""
    def wrap(name: str, counts=lambda *a, **k: True):
        real = getattr(os, name)

        def call(*args, **kwargs):
            module, function = _caller()
            if module.startswith("flashnext") and counts(*args, **kwargs):
                if name == "fdopen":
                    return _FullFile(real(*args, **kwargs), disk, function)
                disk.hit(f"{name}@{function}", _path_arg(args))
            return real(*args, **kwargs)

        monkeypatch.setattr(os, name, call)

    for name in ("pwrite", "ftruncate", "fsync", "rename", "replace", "mkdir", "symlink", "link"):
        wrap(name)
    wrap("open", lambda path, flags, *a, **k: bool(flags & os.O_CREAT))
    wrap("fdopen", lambda fd, mode="r", *a, **k: any(c in mode for c in "wa+"))
    real_renameat2 = held._renameat2

    def renameat2(fd, src, dst, flags):
        disk.hit(f"renameat2@{sys._getframe(1).f_code.co_name}", dst)
        return real_renameat2(fd, src, dst, flags)

    monkeypatch.setattr(held, "_renameat2", renameat2)


def stages(calls: list[str]) -> list[int]:
    """The first and the last occurrence (1-based) of every distinct stage."""
    first, last = {}, {}
    for n, what in enumerate(calls, 1):
        first.setdefault(what, n)
        last[what] = n
    return sorted({*first.values(), *last.values()})


@pytest.fixture(scope="module")
def straight(pristine, tmp_path_factory):
    """Each build's uninterrupted output, what it leaves beside it, and its write-ish calls."""
    done = {}
    for build in BUILDS:
        root = tmp_path_factory.mktemp(f"straight-{build.id}")
        out = root / "out"
        with pytest.MonkeyPatch.context() as m:
            disk = Disk()
            install(m, disk)
            result = CliRunner().invoke(cli, build.argv(Work(pristine), out))
        assert result.exit_code == 0, result.output
        assert sorted(os.listdir(root)) == sorted(build.beside)
        done[build.id] = (output_state(out), disk.calls)
    return done


@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b.id)
def test_a_full_disk_at_every_stage_is_one_line_and_the_rerun_makes_it_whole(build: Build, straight, pristine,
                                                                            tmp_path, monkeypatch):
    made, calls = straight[build.id]
    points = stages(calls)
    assert len(points) > 10 and {c.split("@")[0] for c in calls} >= {"open", "pwrite", "fsync"}, calls
    problems = []
    for at in points:
        what = f"ENOSPC at stage {at}/{len(calls)} ({calls[at - 1]})"
        root = tmp_path / str(at)
        root.mkdir()
        out = root / "out"
        argv = build.argv(Work(pristine), out)
        with monkeypatch.context() as m:
            install(m, Disk(full_at=at))
            result = CliRunner().invoke(cli, argv)
        lines = [line for line in result.output.splitlines() if line.strip()]
        if result.exit_code != 1 or len(lines) != 1 or not lines[0].startswith("Error: No space left on device: "):
            problems.append(f"{what}: exit {result.exit_code}, {lines}")
            continue
        if str(root) not in lines[0]:
            problems.append(f"{what}: the line does not say where: {lines[0]}")
        finished = out.exists()
        if finished and output_state(out) != made:
            problems.append(f"{what}: {out.name} exists but is not the finished output")
        left = sorted(n for n in os.listdir(root) if n not in build.beside and not RESUMABLE.fullmatch(n))
        if left:
            problems.append(f"{what}: left {left}")
        rerun = CliRunner().invoke(cli, argv)
        if finished and rerun.exit_code == 1 and "already exists" in rerun.output:
            pass  # the output was complete (only the fsync after its rename failed): it is not replaced
        elif rerun.exit_code != 0:
            problems.append(f"{what}: the rerun exits {rerun.exit_code}: {rerun.output.strip().splitlines()[-1:]}")
            continue
        if output_state(out) != made:
            problems.append(f"{what}: the rerun's output differs from an uninterrupted run's")
        if sorted(os.listdir(root)) != sorted(build.beside):
            problems.append(f"{what}: beside the output after the rerun: {sorted(os.listdir(root))}")
    assert not problems, "\n".join(problems)
