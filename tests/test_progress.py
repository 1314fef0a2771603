"""Long work shows progress (issue 32, item 5): each command that hashes or rewrites gigabytes has
the progress bar the builders have (``flashnext.progress``) behind ``--progress/--no-progress``, on
stderr, so that ``--json`` stays one JSON document on stdout. Run on the demo checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner

from flashnext.tools.cli import main as cli


@dataclass(frozen=True)
class Inputs:
    snap: Path
    overlay: Path
    view: Path
    table: Path
    root: Path


@pytest.fixture(scope="module")
def inputs(demo_snapshot, demo_overlay, tmp_path_factory) -> Inputs:
    from flashnext.quant.ple.table import build_table

    root = tmp_path_factory.mktemp("progress")
    build_table(demo_snapshot, root / "table.bin", progress=False)
    view = root / "view"
    result = CliRunner().invoke(cli, ["overlay", "apply", str(demo_overlay), "--base", str(demo_snapshot),
                                      "--out", str(view)])
    assert result.exit_code == 0, result.output
    return Inputs(demo_snapshot, demo_overlay, view, root / "table.bin", root)


@dataclass(frozen=True)
class Command:
    id: str
    argv: Callable[[Inputs, str], list[str]]  # the run's own name, for an output it must not share
    bar: str  # the bar's label


COMMANDS = [
    Command("repack-int6", lambda w, run: ["repack-int6", "--src", str(w.snap), "--out", str(w.root / f"bp-{run}")],
            "repack-int6"),
    Command("repack-int6-to-int8", lambda w, run: ["repack-int6", "--src", str(w.snap), "--to", "int8",
                                                   "--out", str(w.root / f"i8-{run}")], "repack-int6"),
    Command("overlay-verify-full", lambda w, run: ["overlay", "verify", str(w.overlay), "--base", str(w.snap),
                                                   "--full"], "overlay verify"),
    Command("overlay-verify-full-view", lambda w, run: ["overlay", "verify", str(w.view), "--full"],
            "overlay verify"),
    Command("ple-verify-full", lambda w, run: ["ple", "verify", str(w.table), "--full"], "ple verify"),
]


def invoke(argv: list[str]):
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    return result


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.id)
def test_progress_goes_to_stderr_and_no_progress_prints_none(command: Command, inputs: Inputs):
    shown = invoke(command.argv(inputs, "shown") + ["--progress"])
    assert f"{command.bar}:" in shown.stderr and "%|" in shown.stderr, shown.stderr
    assert command.bar not in shown.stdout
    quiet = invoke(command.argv(inputs, "quiet") + ["--no-progress"])
    assert quiet.stderr == ""
    assert quiet.stdout.splitlines() and shown.stdout.replace("shown", "quiet") == quiet.stdout


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.id)
def test_json_stays_one_document_on_stdout_under_a_bar(command: Command, inputs: Inputs):
    result = invoke(command.argv(inputs, "json") + ["--progress", "--json"])
    assert f"{command.bar}:" in result.stderr
    assert isinstance(json.loads(result.stdout), dict)


def test_progress_is_on_by_default_like_the_builders(inputs: Inputs):
    """Without either option a long command shows its bar, as make-mtp-int4 and ple build do."""
    for command in COMMANDS:
        assert f"{command.bar}:" in invoke(command.argv(inputs, "default")).stderr, command.id


@pytest.mark.parametrize("argv", [["overlay", "verify", "{overlay}", "--base", "{snap}"], ["ple", "verify", "{table}"]],
                         ids=["overlay-verify", "ple-verify"])
def test_a_check_of_seconds_has_no_bar(argv: list[str], inputs: Inputs):
    """Without --full both checks read little (the overlay's own files; 18 blocks of the table): no
    bar, so that their one line per finding stays the whole of stderr."""
    values = {"overlay": inputs.overlay, "snap": inputs.snap, "table": inputs.table}
    result = invoke([a.format(**{k: str(v) for k, v in values.items()}) for a in argv] + ["--progress"])
    assert result.stderr == ""


# --- the first line, before the seconds of imports (issue 41, item 6) --------------------------------

# Runs a command as a terminal runs it, and says on stderr when torch or vLLM starts to import: the
# seconds a user would otherwise watch an empty screen.
# The marker goes to the terminal itself (a descriptor kept from the start): the commands hold back
# what is written to stderr while vLLM imports (flashnext.output.held_back_output), and a marker
# written through it would arrive after the line it must precede, or never.
_WATCHED = r'''
import importlib.abc, os, sys

TERMINAL = os.dup(2)

class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in ("torch", "vllm"):
            os.write(TERMINAL, f"<importing {name}>\n".encode())
        return None

sys.meta_path.insert(0, Watch())
from flashnext.tools.cli import main
main(sys.argv[1:], prog_name="flashnext")
'''


def _before_heavy_imports(args: list[str], cwd: Path) -> str:
    """What a command wrote to its terminal before torch or vLLM began to import in its process (it is
    stopped then), or all it wrote where they never did."""
    import os
    import pty
    import select
    import subprocess
    import sys

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", _WATCHED, *args], stdin=follower, stdout=follower,
                            stderr=follower, cwd=cwd, close_fds=True)
    os.close(follower)
    seen = b""
    try:
        while b"<importing " not in seen:
            ready, _, _ = select.select([leader], [], [], 120)
            try:
                chunk = os.read(leader, 4096) if ready else b""
            except OSError:  # EIO: the command ended and closed the terminal
                chunk = b""
            if not chunk:
                break
            seen += chunk
    finally:
        proc.kill()
        proc.wait()
        os.close(leader)
    text = seen.decode(errors="replace").replace("\r\n", "\n")
    return text.partition("<importing ")[0]


@pytest.mark.parametrize("args, first", [
    (["plan", "--profile", "3x3090"], "planning 3x3090 with vLLM's own config classes"),
    (["plan", "--gpus", "3", "--gpu-memory", "24", "--host-ram", "125"], "planning a rig of 3 GPU(s)"),
    (["demo-checkpoint", "--out", "fresh-demo"], "writing the demo checkpoint to fresh-demo"),
    (["make-mtp-int4", "--src", "{snap}", "--out", "mtp-out"], "quantizing the MTP experts of"),
    (["repack-int6", "--src", "{snap}", "--out", "int6-out"], "repacking the INT6 modules of"),
    (["doctor", "--profile", "3x3090", "--model", "{snap}"], "preflight of 3x3090"),
    (["selftest", "--out", "selftest-out"], "selftest of 3x3090 into selftest-out"),
    (["serve", "--profile", "3x3090", "--model", "{snap}", "--dry-run"], "rendering 3x3090: its vllm_args"),
    (["serve", "--profile", "3x3090", "--model", "{snap}", "--check"], "preflight of 3x3090"),
], ids=lambda v: v[0] if isinstance(v, list) else None)
def test_a_slow_command_says_what_it_does_before_its_imports(args, first, demo_snapshot, tmp_path):
    shown = _before_heavy_imports([a.format(snap=demo_snapshot) for a in args], tmp_path)
    assert shown.startswith(first) and shown.splitlines()[0].endswith(" ..."), shown


def test_the_first_line_stays_off_a_pipe(demo_snapshot, tmp_path):
    """Where no one watches (a pipe, a log), stderr gets nothing more than before."""
    result = CliRunner().invoke(cli, ["demo-checkpoint", "--out", str(tmp_path / "d")])
    assert result.exit_code == 0 and "writing the demo checkpoint" not in result.output
