"""What a new user waits for (issue 41's measure): each command on the demo checkpoint, run as a user
runs it (the installed console script, a fresh process, on a terminal), timed to its first line of
output and to its exit.

    python -m benchmarks.first_line [--tree NAME=BINDIR ...] [--runs 3] [--selftest] [--json]

``--tree`` names a bin directory whose ``flashnext``, ``make-mtp-int4`` and ``serve`` are timed
(repeatable: several trees run interleaved, command by command, so that they share the machine's
load); without it the console scripts on ``PATH``. The commands' inputs (a demo checkpoint, its PLE
table file) are made once, by the first tree, in a scratch folder; the commands that write get a fresh
``--out`` each run.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import select
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Timing:
    first_line_s: float | None
    total_s: float
    exit_code: int


def run_on_a_terminal(argv: list[str], env: dict[str, str]) -> Timing:
    """Time ``argv`` under a pseudo-terminal: the first newline it writes to stdout or stderr, and its exit."""
    leader, follower = pty.openpty()
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env,
                            close_fds=True)
    os.close(follower)
    first = None
    while True:
        ready, _, _ = select.select([leader], [], [], 0.05)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: the process has exited
                break
            if not chunk:
                break
            if first is None and b"\n" in chunk:
                first = time.perf_counter() - start
        elif proc.poll() is not None:
            break
    code = proc.wait()
    total = time.perf_counter() - start
    os.close(leader)
    return Timing(first, total, code)


def commands(bindir: Path, inputs: Path, out: Path, selftest: bool) -> dict[str, list[str]]:
    demo, table = inputs / "demo", inputs / "ple-table.bin"
    flashnext = str(bindir / "flashnext")
    table = {
        "flashnext --help": [flashnext, "--help"],
        "demo-checkpoint": [flashnext, "demo-checkpoint", "--out", str(out / "demo")],
        "make-mtp-int4": [str(bindir / "make-mtp-int4"), "--src", str(demo), "--out", str(out / "mtp")],
        "plan --profile 3x3090": [flashnext, "plan", "--profile", "3x3090"],
        "plan --profile 3x3090 --model": [flashnext, "plan", "--profile", "3x3090", "--model", str(demo)],
        "doctor": [flashnext, "doctor", "--profile", "3x3090", "--model", str(demo), "--ple-table", str(table)],
        "serve --dry-run": [str(bindir / "serve"), "--profile", "3x3090", "--model", str(demo),
                            "--ple-table", str(table), "--dry-run"],
        "patches check": [flashnext, "patches", "check"],
    }
    if selftest:
        table["selftest (CPU)"] = [flashnext, "selftest", "--gpus", "0"]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=BINDIR")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--selftest", action="store_true", help="also the CPU selftest (minutes a run)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree) or {"installed": str(Path(shutil.which("flashnext")).parent)}
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TERM": "xterm"}
    scratch = Path(tempfile.mkdtemp(prefix="first-line-"))
    try:
        first_bin = Path(next(iter(trees.values())))
        subprocess.run([str(first_bin / "flashnext"), "demo-checkpoint", "--out", str(scratch / "demo")],
                       check=True, capture_output=True, env=env)
        subprocess.run([str(first_bin / "flashnext"), "ple", "build", "--src", str(scratch / "demo"), "--out",
                        str(scratch / "ple-table.bin")], check=True, capture_output=True, env=env)
        results: dict[str, dict[str, list[Timing]]] = {}
        names = list(commands(first_bin, scratch, scratch, args.selftest))
        for number, name in enumerate(names):
            for run in range(args.runs):
                for tree, bindir in trees.items():
                    out = scratch / f"out-{number}-{tree}-{run}"
                    out.mkdir()
                    argv = commands(Path(bindir), scratch, out, args.selftest)[name]
                    results.setdefault(name, {}).setdefault(tree, []).append(run_on_a_terminal(argv, env))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {
        name: {tree: {"first_line_s": _median([t.first_line_s for t in ts]),
                      "total_s": _median([t.total_s for t in ts]),
                      "exit_codes": sorted({t.exit_code for t in ts})}
               for tree, ts in per_tree.items()}
        for name, per_tree in results.items()
    }
    if args.json:
        print(json.dumps({"runs": args.runs, "commands": summary}, indent=2))
        return
    header = "| command | " + " | ".join(f"{t}: first line (s) | {t}: total (s) | {t}: exit" for t in trees) + " |"
    print(header)
    print("|---" * (1 + 3 * len(trees)) + "|")
    for name, per_tree in summary.items():
        cells = []
        for tree in trees:
            s = per_tree[tree]
            first = "none" if s["first_line_s"] is None else f"{s['first_line_s']:.2f}"
            cells += [first, f"{s['total_s']:.2f}", ",".join(map(str, s["exit_codes"]))]
        print(f"| `{name}` | " + " | ".join(cells) + " |")


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


if __name__ == "__main__":
    main()
