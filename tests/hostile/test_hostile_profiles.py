"""Issue 42, item 3: a profile file is code the user runs, table-driven.

``serve --profile FILE`` rendered, with exit 0, a profile asking for any number of GPUs or none, a
port or a wait out of range, a shell line as ``shm_size``, environment keys that are no names, every
capability, another container's IPC namespace, and ``vllm_args`` that end in ``--`` (so that
serve's own ``--host``/``--port``, which follow them, never reached vLLM's options) or that set
where vLLM listens; a 300 MB profile kept it busy for over a minute. Each is refused by the loader
(``serving/profiles.py``) in one line, exit 1, before anything is printed or written.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from flashnext.errors import FlashnextError
from flashnext.serving.profiles import MAX_PROFILE_BYTES
from support import ROOT
from support.hostile import invoke_expecting_one_line, tree_state

SHIPPED = json.loads((ROOT / "serving" / "profiles" / "3x3090.json").read_text())
QUICK_S = 5  # a refusal before reading reads nothing; what reading 300 MB would exceed on a busy machine


@dataclass(frozen=True)
class ProfileCase:
    id: str
    write: Callable[[Path], None]  # writes the profile file at the path it is given
    message: str


def edited(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    """The shipped 3x3090 profile, renamed after its file and changed by ``edit``."""
    def write(path: Path) -> None:
        data = json.loads(json.dumps(SHIPPED))
        data["name"] = path.stem
        edit(data)
        path.write_text(json.dumps(data, indent=2))
    return write


def setting(*keys: str, value) -> Callable[[Path], None]:
    def edit(data: dict) -> None:
        for key in keys[:-1]:
            data = data[key]
        data[keys[-1]] = value
    return edited(edit)


def env_key(key: str) -> Callable[[Path], None]:
    return edited(lambda d: d["env"].update({key: "1"}))


def vllm_args_then(*args: str) -> Callable[[Path], None]:
    return edited(lambda d: d["vllm_args"].extend(args))


def padded_to(size: int) -> Callable[[Path], None]:
    """A valid profile with spaces after it, ``size`` bytes in all."""
    def write(path: Path) -> None:
        edited(lambda d: None)(path)
        with open(path, "a") as f:
            f.write(" " * (size - path.stat().st_size))
    return write


def sparse(size: int) -> Callable[[Path], None]:
    """A profile's opening and then holes to ``size`` bytes: a large file at no cost of disk."""
    def write(path: Path) -> None:
        edited(lambda d: None)(path)
        with open(path, "r+b") as f:
            f.truncate(size)
    return write


CASES = [
    ProfileCase("gpus-negative", setting("gpus", value=-1), "gpus must be at least 1, got -1"),
    ProfileCase("gpus-zero", setting("gpus", value=0), "gpus must be at least 1, got 0"),
    ProfileCase("gpus-huge", setting("gpus", value=10**30), "gpus must be at most 64"),
    ProfileCase("port-zero", setting("container", "port", value=0), "container.port must be at least 1"),
    ProfileCase("port-negative", setting("container", "port", value=-1), "container.port must be at least 1"),
    ProfileCase("port-70000", setting("container", "port", value=70000), "container.port must be at most 65535"),
    ProfileCase("healthcheck-interval-negative", setting("healthcheck", "interval_s", value=-30),
                "healthcheck.interval_s must be at least 1"),
    ProfileCase("healthcheck-timeout-huge", setting("healthcheck", "timeout_s", value=10**30),
                "healthcheck.timeout_s must be at most"),
    ProfileCase("healthcheck-retries-negative", setting("healthcheck", "retries", value=-1),
                "healthcheck.retries must be at least 1"),
    ProfileCase("healthcheck-start-period-huge", setting("healthcheck", "start_period_s", value=10**30),
                "healthcheck.start_period_s must be at most"),
    ProfileCase("grace-negative", setting("container", "stop_grace_period_s", value=-1),
                "container.stop_grace_period_s must be at least 1"),
    ProfileCase("grace-huge", setting("container", "stop_grace_period_s", value=10**30),
                "container.stop_grace_period_s must be at most"),
    ProfileCase("shm-size-shell", setting("container", "shm_size", value="lots; $(id)"),
                "container.shm_size: 'lots; $(id)' is not a size"),
    ProfileCase("env-key-assignment", env_key("LD_PRELOAD=evil.so #"), "is not an environment variable name"),
    ProfileCase("env-key-newline", env_key("A\nB"), "'A\\nB' is not an environment variable name"),
    ProfileCase("env-key-empty", env_key(""), "'' is not an environment variable name"),
    ProfileCase("env-key-dollar", env_key("$HOME"), "'$HOME' is not an environment variable name"),
    ProfileCase("env-value-nul", edited(lambda d: d["env"].update(VLLM_PLE_PREFETCH="1\0evil")),
                "env: VLLM_PLE_PREFETCH's value holds a NUL or a line break"),
    ProfileCase("cap-add-all", setting("container", "cap_add", value={"ALL": "everything"}), "--grant ALL"),
    ProfileCase("cap-add-sys-admin", setting("container", "cap_add", value={"SYS_ADMIN": "mounts"}),
                "--grant SYS_ADMIN"),
    ProfileCase("ipc-another-container", setting("container", "ipc", value="container:victim"), "container.ipc"),
    ProfileCase("vllm-args-end-in-double-dash", vllm_args_then("--"), "vllm_args: '--'"),
    ProfileCase("vllm-args-newline", vllm_args_then("--served-model-name", "a\nb"),
                "vllm_args: 'a\\nb' holds a NUL or a line break"),
    ProfileCase("vllm-args-host", vllm_args_then("--host", "0.0.0.0"), "vllm_args: --host is set by flashnext"),
    ProfileCase("vllm-args-port-equals", vllm_args_then("--port=80"), "vllm_args: --port is set by flashnext"),
    ProfileCase("vllm-args-host-abbreviated", vllm_args_then("--hos", "0.0.0.0"),
                "vllm_args: --hos may be read as --host, which is set by flashnext"),
    ProfileCase("size-over-the-limit", padded_to(MAX_PROFILE_BYTES + 1), "more than a serving profile may be"),
    ProfileCase("size-300-mb", sparse(300 << 20), "more than a serving profile may be"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_hostile_profile_file_is_refused_in_one_line(case, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    snap, table, profile = tmp_path / "snap", tmp_path / "ple.bin", tmp_path / "evil.json"
    snap.mkdir()
    table.write_bytes(b"")
    case.write(profile)
    before = tree_state(tmp_path)
    started = time.monotonic()
    result, line = invoke_expecting_one_line(["serve", "--profile", str(profile), "--model", str(snap),
                                              "--ple-table", str(table), "--dry-run"])
    assert result.exit_code == 1 and line.startswith("Error: ") and case.message in line, line
    assert result.stdout == "" and tree_state(tmp_path) == before
    assert time.monotonic() - started < QUICK_S


@pytest.mark.parametrize("name", ["../../escape", "a/b", "", "..", "/etc", "x\ny"])
def test_serves_state_folder_is_never_joined_with_a_name_that_is_no_profile_name(name, tmp_path, monkeypatch):
    from flashnext.serving.run import state_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(FlashnextError, match="is not a profile name"):
        state_dir(name)
