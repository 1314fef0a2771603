"""Issue 41: which extra each command needs. The README says it, and a command that needs vLLM where
it is missing says in one line what to install (vLLM 0.34.0 without its requirements, then the
``serve`` extra: pip cannot resolve ``vllm==0.34.0`` itself). tests/test_packaging.py runs the same
commands in a fresh venv without vLLM."""

import importlib.util
import sys

import pytest
from click.testing import CliRunner

from flashnext.serving import vllm_release
from flashnext.tools.cli import main as flashnext
from support import ROOT

NEEDS_SERVE = ["plan", "selftest", "patches check", "serve --engine native"]


def test_the_readme_says_which_extra_each_command_needs():
    text = (ROOT / "README.md").read_text()
    table = text.split("Which install each command needs:", 1)[1].split("\n\n", 2)[1]
    serve_row = next(line for line in table.splitlines() if line.startswith("| `[serve]`"))
    assert "pip install --no-deps vllm==0.34.0" in serve_row
    for command in NEEDS_SERVE:
        assert f"`{command}`" in serve_row, command
    base_row = next(line for line in table.splitlines() if line.startswith("| the base install"))
    assert not any(f"`{command}`" in base_row for command in NEEDS_SERVE)
    # and the selftest's CPU part is not said to run "everywhere": it runs vLLM's own code
    assert "(CPU, everywhere)" not in text


@pytest.fixture
def no_vllm(monkeypatch):
    """vLLM as a fresh venv of the base install has it: not found, not importable, no metadata."""
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "vllm" else found(name, *a, **k))
    monkeypatch.setattr(vllm_release, "installed_version", lambda: None)
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", None)


def _one_line_with_the_install(done) -> str:
    lines = done.output.strip().splitlines()
    assert done.exit_code == 1 and len(lines) == 1 and lines[-1].startswith("Error: "), done.output
    assert vllm_release.INSTALL in lines[0], lines[0]
    return lines[0]


def test_patches_check_without_vllm_says_what_to_install(no_vllm):
    """Before issue 41: "pip install 'flashnext[serve]'", which installs vLLM's requirements, not vLLM."""
    _one_line_with_the_install(CliRunner().invoke(flashnext, ["patches", "check", "--no-progress"]))


def test_serve_native_without_vllm_says_what_to_install(tmp_path, monkeypatch):
    from flashnext.serving.run import exec_native

    monkeypatch.setenv("PATH", str(tmp_path))  # no `vllm` program
    with pytest.raises(Exception) as refused:
        exec_native(["vllm", "serve", "x"], {})
    from flashnext.tools._flags import as_typed

    shown = as_typed(refused.value)  # the line serve prints: its field, --engine, named as serve's flag
    assert vllm_release.INSTALL in shown and "--engine docker" in shown


def test_plan_without_vllm_says_what_to_install(no_vllm):
    _one_line_with_the_install(CliRunner().invoke(flashnext, ["plan", "--profile", "3x3090"]))
