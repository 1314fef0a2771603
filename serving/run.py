"""Running a serving profile: natively or through Compose, readiness, and the plan's one line.

The ``serve`` command line is a thin layer over this module.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from flashnext.errors import FlashnextError


def state_dir(profile: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flashnext" / "serve" / profile
    return root


def compose_command(engine: str, compose_file: Path, *args: str) -> list[str]:
    return [engine, "compose", "-f", str(compose_file), *args]


def run_command(cmd: list[str]) -> None:
    try:
        subprocess.run(cmd, check=True)
    except FileNotFoundError:
        raise FlashnextError(f"{cmd[0]} is not installed or not on PATH") from None
    except subprocess.CalledProcessError as e:
        raise FlashnextError(f"`{shlex.join(cmd)}` failed with exit status {e.returncode}") from None


def wait_ready(base_url: str, timeout_s: float, progress=None, poll_s: float = 2.0) -> dict:
    """Poll /health, then /v1/models, until both answer 200; returns the models listing."""
    started = time.monotonic()
    stage = "/health"
    while True:
        elapsed = time.monotonic() - started
        if progress:
            progress(f"waiting for {base_url}{stage} ... {elapsed:4.0f} s")
        try:
            with urllib.request.urlopen(base_url + stage, timeout=5) as r:
                body = r.read()
            if stage == "/health":
                stage = "/v1/models"
                continue
            return json.loads(body or b"{}")
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            pass
        if elapsed > timeout_s:
            raise FlashnextError(f"{base_url}{stage} did not answer within {timeout_s:.0f} s; see `serve logs`")
        time.sleep(poll_s)


def require_ple_table(profile, model: Path | None, ple_table: Path | None) -> None:
    """A profile that serves the PLE table from a file cannot start without one: vLLM would fall back
    to pinning the whole table (95.4 GiB), which beside the QSA K/V exceeds a 125 GiB host."""
    if profile.uses_ple_table and ple_table is None:
        src = shlex.quote(str(model)) if model is not None and str(model).isprintable() else "SNAPSHOT"
        raise FlashnextError(
            f"profile {profile.name} serves the PLE table from a file: pass --ple-table FILE, made with "
            f"`flashnext ple build --src {src} --out FILE`")


def summary_line(profile) -> str | None:
    """One line of the plan for `serve` to print before starting; None when it cannot plan here."""
    from flashnext.serving import capacity

    if profile.model_family not in capacity.PLANNED_FAMILIES:
        return None
    try:
        p = capacity.plan_profile(profile)
    except FlashnextError:
        return None
    return (f"plan: {p.blocks} blocks per rank, {p.blocks_per_request} per {p.max_model_len:,}-token request: "
            f"{p.capacity_tokens:,} tokens ({p.concurrency:.2f}x); pinned host K/V {_gib(p.pinned_host_bytes_needed)}")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def native_command(profile, model: Path, overlays: tuple[Path, ...], ple_table: Path | None, listen: str,
                   port: int, make_view: bool = True) -> tuple[list[str], dict[str, str]]:
    """``vllm serve`` and the environment that run ``profile`` on this host. With overlays, the
    model is a fresh view of the snapshot with them applied (``make_view=False``: a placeholder)."""
    from flashnext.serving.compose import runtime_env, vllm_command

    model_dir = model
    if overlays:
        from flashnext.quant.overlays.view import apply_overlays

        if make_view:
            model_dir = Path(tempfile.mkdtemp(prefix="flashnext-view-")) / "model"
            apply_overlays(model, list(overlays), model_dir)
        else:
            model_dir = Path("<view of the snapshot with the overlays>")
    return vllm_command(profile, str(model_dir), listen, port), runtime_env(profile, str(ple_table) if ple_table else None)


def exec_native(cmd: list[str], env: dict[str, str]) -> None:
    """Replace this process with ``cmd`` under ``env`` added to the current environment."""
    import shutil

    if shutil.which(cmd[0]) is None:
        raise FlashnextError("vllm is not installed here: pip install 'flashnext[serve]', or use --engine docker")
    os.execvpe(cmd[0], cmd, {**os.environ, **env})
