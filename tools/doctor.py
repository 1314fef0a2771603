"""``flashnext doctor`` (also ``serve --check``): can this machine run a profile?"""

from __future__ import annotations

import json
from pathlib import Path

import click

from flashnext.errors import NoGo
from flashnext.tools._common import json_option, user_errors


def report(profile_name: str, model: Path | None, overlays: tuple[Path, ...], ple_table: Path | None,
           engine: str, as_json: bool) -> None:
    """Run the preflight, print go/no-go, and exit with the verdict's code."""
    from flashnext.serving.preflight import preflight, verdict
    from flashnext.serving.profiles import load_profile

    findings = preflight(load_profile(profile_name), model, list(overlays), ple_table, engine)
    code = verdict(findings)
    if as_json:
        click.echo(json.dumps({"go": code == 0, "exit_code": code, "findings": [f.to_json() for f in findings]},
                              indent=2))
    else:
        for f in findings:
            mark = "ok  " if f.ok else ("FAIL" if f.blocking else "warn")
            click.echo(f"[{mark}] {f.check}: {f.detail}")
            if not f.ok and f.fix:
                click.echo(f"       fix: {f.fix}")
        click.echo("GO" if code == 0 else f"NO-GO (exit {code})")
    if code:
        raise NoGo(f"NO-GO (exit {code})", code)


@click.command("doctor")
@click.option("--profile", required=True, help="Serving profile to check for.")
@click.option("--model", type=click.Path(path_type=Path), default=None, help="The base snapshot (to verify overlays).")
@click.option("--overlay", "overlays", multiple=True, type=click.Path(path_type=Path))
@click.option("--ple-table", type=click.Path(path_type=Path), default=None, help="The PLE table file (its drive is checked).")
@click.option("--engine", type=click.Choice(["docker", "podman", "native"]), default="docker", show_default=True)
@json_option
@user_errors
def main(profile: str, model: Path | None, overlays: tuple[Path, ...], ple_table: Path | None, engine: str,
         as_json: bool) -> None:
    """Preflight for a serving profile: GPUs, memory limits, ptrace, the PLE drive, overlays, the
    image. Prints go/no-go with the fix for each problem; exit 0 (go), 10 GPU, 11 memory,
    12 ptrace, 13 PLE table or its drive, 14 overlay, 15 image."""
    report(profile, model, overlays, ple_table, engine, as_json)
