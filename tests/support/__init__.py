"""What the tests share besides fixtures: the repository's paths, and helpers in this folder."""

import json
import os
import sys
from pathlib import Path

from . import fork_server  # a fresh interpreter's result without its import time; FLASHNEXT_TEST_FORK_SERVER=0: none

SUPPORT_DIR = Path(__file__).resolve().parent
ROOT = SUPPORT_DIR.parent.parent  # the repository


def run_scenario(script: str, args: tuple = (), pythonpath: str | None = None, extra_env: dict | None = None) -> dict:
    """Run a scenario script's text in a fresh interpreter on the CPU (``pythonpath`` first on the
    path: a patched vLLM tree) and return the JSON of its last line of output. (Through
    support/fork_server.py where a fork of a preloaded one is exact.)"""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONDONTWRITEBYTECODE="1", **(extra_env or {}))
    tests = str(SUPPORT_DIR.parent)  # the scripts import the shared helpers in support/
    env["PYTHONPATH"] = os.pathsep.join([pythonpath, *sys.path[1:], tests] if pythonpath
                                        else [tests, *filter(None, [os.environ.get("PYTHONPATH")])])
    out = fork_server.run([sys.executable, "-c", script, *args], env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def free_port() -> str:
    """A loopback port nothing listens on now (for a scenario's gloo group)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def two_ranks(extra_env: dict, scenario: str = "pp_ranks_scenario.py", args: tuple = ()) -> list[dict]:
    """Run ``scenario RANK PORT *args`` as both ranks of a two-rank gloo group; their JSON results."""
    script = SUPPORT_DIR / scenario
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", **extra_env}
    port = free_port()
    procs = [fork_server.start([sys.executable, str(script), str(rank), port, *map(str, args)], env=env)
             for rank in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results
