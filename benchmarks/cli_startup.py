"""Start-up of the command lines: wall time of commands that need no torch, and whether they import it.

    python -m benchmarks.cli_startup [--runs 5]

Each command runs as a user runs it (the installed console script, a fresh process); the torch
column runs the same arguments in-process and looks at ``sys.modules``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = [
    ["flashnext", "--help"],
    ["flashnext", "--version"],
    ["make-mtp-int4", "--help"],
    ["flashnext", "overlay", "apply", "--help"],
    ["flashnext", "patches", "list"],
    ["serve", "--help"],
]

PROBE = """
import sys
from flashnext.tools.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print('torch' in sys.modules, file=sys.stderr)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print("| command | median wall (s) | min | imports torch |")
    print("|---|---|---|---|")
    for command in COMMANDS:
        times = []
        for _ in range(args.runs):
            started = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            times.append(time.perf_counter() - started)
        argv = command[1:] if command[0] == "flashnext" else [command[0], *command[1:]]
        probe = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True)
        torch = probe.stderr.strip().splitlines()[-1]
        print(f"| `{' '.join(command)}` | {statistics.median(times):.3f} | {min(times):.3f} | {torch} |")


if __name__ == "__main__":
    main()
