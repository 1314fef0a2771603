"""Runs one flashnext command line in a fresh interpreter and says whether it imported torch: the
check that refusals and tensor-free commands answer without paying for torch (2 s, 650 MB)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = ("import json, sys\nfrom flashnext.tools.cli import main\ncode = 0\n"
         "try:\n    main(sys.argv[1:], prog_name='flashnext')\nexcept SystemExit as e:\n    code = e.code or 0\n"
         "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}), file=sys.stderr)\n")


def probe(args: list[str], cwd, python: str = sys.executable, env: dict | None = None) -> tuple[dict, str]:
    """``({"code": exit code, "torch": imported?}, stderr)`` of ``flashnext ARGS`` run by ``python``."""
    done = subprocess.run([python, "-c", PROBE, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=env)
    return json.loads(done.stderr.strip().splitlines()[-1]), done.stderr
