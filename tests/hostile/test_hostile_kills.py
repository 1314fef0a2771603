"""Issue 42: every writer killed at points through its run (support/kill_at_scenario.py), then run
again: the rerun must make exactly what an uninterrupted run makes, and leave beside it nothing the
killed run made.

A point is the Nth file-system event of the run (a file opened for writing, an fsync, a rename,
an unlink, a progress step of the data...): first counted on an uninterrupted run, then drawn
from 1..count by a generator seeded by the writer's and the signal's names (so a failure names
a point that reproduces), the last event always among them. SIGKILL stops the run there with
nothing run after it; SIGTERM goes through flashnext's own handler, which must end it with exit
143 and leave nothing behind by itself. The rerun goes through the CLI in this process; where the
killed run had already finished its output (killed at its last events), the rerun's refusal to
replace it is the right answer, and the output must still be the uninterrupted run's.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner

from flashnext.tools.cli import main as cli
from support import SUPPORT_DIR, fork_server
from support.hostile import Work, output_state

pytestmark = pytest.mark.slow  # minutes in all on 2 cores: tests/conftest.py sends it to a worker first

POINTS = {"KILL": 3, "TERM": 1}  # drawn points a writer and signal, besides the last event
# what an interrupted resumable build keeps for the next run to resume from (``ple build``'s)
RESUMABLE = re.compile(r"\.?out\.partial(\.json)?")


@dataclass(frozen=True)
class Writer:
    id: str
    argv: Callable[[Work, Path], list[str]]  # the command writing ``out``


WRITERS = [
    Writer("make-mtp-int4", lambda w, out: ["make-mtp-int4", "--src", str(w.snap), "--out", str(out),
                                            "--no-progress"]),
    Writer("repack-int6", lambda w, out: ["repack-int6", "--src", str(w.snap), "--out", str(out), "--no-progress"]),
    Writer("ple-build", lambda w, out: ["ple", "build", "--src", str(w.snap), "--out", str(out), "--no-progress"]),
    Writer("ple-build-nvfp4", lambda w, out: ["ple", "build", "--src", str(w.snap), "--out", str(out),
                                              "--format", "nvfp4", "--no-progress"]),
    Writer("overlay-apply", lambda w, out: ["overlay", "apply", str(w.ov), "--base", str(w.snap),
                                            "--out", str(out)]),
]


def killed(argv: list[str], sig: str, at: int, count_file: Path, cwd: Path) -> int:
    script = SUPPORT_DIR / "kill_at_scenario.py"
    env = {**os.environ, "PYTHONPATH": str(SUPPORT_DIR.parent)}
    out = fork_server.run([sys.executable, str(script), sig, str(at), str(count_file), "--", *argv],
                          env=env, timeout=300, cwd=str(cwd))
    assert out.returncode != 2, out.stderr[-2000:]  # a usage error: the scenario's, not a kill's
    return out.returncode


@pytest.fixture(scope="module")
def outputs(pristine, tmp_path_factory):
    """Each writer's uninterrupted output (through the scenario, counting its events) and count."""
    done = {}
    for writer in WRITERS:
        root = tmp_path_factory.mktemp(writer.id)
        out = root / "out"
        assert killed(writer.argv(Work(pristine), out), "KILL", 0, root / "count", root) == 0
        done[writer.id] = (output_state(out), int((root / "count").read_text()), sorted(os.listdir(root)))
    return done


def points(writer: Writer, sig: str, count: int) -> list[int]:
    rng = random.Random(f"{writer.id}/{sig}")
    return sorted({*rng.sample(range(1, count), min(POINTS[sig], count - 1)), count})


@pytest.mark.parametrize("sig", ["KILL", "TERM"])
@pytest.mark.parametrize("writer", WRITERS, ids=lambda w: w.id)
def test_a_killed_writer_is_made_whole_by_the_rerun(writer: Writer, sig: str, outputs, pristine, tmp_path):
    straight, count, beside = outputs[writer.id]
    assert count > 10, "the run reached too few events to kill it anywhere"
    problems = []
    for at in points(writer, sig, count):
        root = tmp_path / f"{sig}-{at}"
        root.mkdir()
        out = root / "out"
        w = Work(pristine)
        argv = writer.argv(w, out)
        rc = killed(argv, sig, at, root / "count", root)
        expected_rc = {-signal.SIGKILL, 128 + signal.SIGKILL} if sig == "KILL" else {143}
        if rc not in expected_rc | {0}:
            problems.append(f"{sig} at event {at}/{count}: exit {rc}")
            continue
        left = [n for n in os.listdir(root) if n not in ("count", "out", "out.json") and not RESUMABLE.fullmatch(n)]
        if sig == "TERM" and left:
            problems.append(f"TERM at event {at}/{count} left {sorted(left)}")
        finished = out.exists() and output_state(out) == straight
        result = CliRunner().invoke(cli, argv)
        if finished and result.exit_code == 1 and "exists" in result.output:
            pass  # the killed run had finished its output: it is not replaced
        elif result.exit_code != 0:
            problems.append(f"{sig} at event {at}/{count}: the rerun exits {result.exit_code}: "
                            f"{result.output.strip().splitlines()[-1:]}")
            continue
        made = output_state(out)
        if made != straight:
            differ = sorted(k for k in set(made) | set(straight) if made.get(k) != straight.get(k))
            problems.append(f"{sig} at event {at}/{count}: the rerun's output differs from an uninterrupted run's "
                            f"in {differ}")
        left = sorted(set(os.listdir(root)) - {"count"})
        if left != sorted(set(beside) - {"count"}):
            problems.append(f"{sig} at event {at}/{count}: beside the output after the rerun: {left}")
    assert not problems, "\n".join(problems)
