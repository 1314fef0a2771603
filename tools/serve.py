"""``serve``: run a serving profile with Docker, Podman or natively; ``serve down`` / ``serve logs``."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import click

from flashnext.errors import FlashnextError
from flashnext.serving.run import (compose_command, exec_native, native_command, require_ple_table, run_command,
                                   state_dir, summary_line, wait_ready)
from flashnext.tools._common import preflight_report, user_errors

ENGINES = ("docker", "podman", "native")


def _native(profile, model: Path, overlays: tuple[Path, ...], ple_table: Path | None, listen: str, port: int,
            dry_run: bool) -> None:
    cmd, env = native_command(profile, model, overlays, ple_table, listen, port, make_view=not dry_run)
    if dry_run:
        click.echo(json.dumps({"command": cmd, "env": env}, indent=2))
        return
    if line := summary_line(profile):
        click.echo(line, err=True)
    exec_native(cmd, env)


@click.group("serve", invoke_without_command=True)
@click.option("--profile", help="Serving profile (serving/profiles/NAME.json).")
@click.option("--model", type=click.Path(path_type=Path), help="The base model snapshot.")
@click.option("--overlay", "overlays", multiple=True, type=click.Path(path_type=Path),
              help="An overlay to apply, in order (repeatable).")
@click.option("--ple-table", type=click.Path(path_type=Path), default=None,
              help="The PLE table file from `flashnext ple build`.")
@click.option("--engine", type=click.Choice(ENGINES), default="docker", show_default=True)
@click.option("--dry-run", is_flag=True,
              help="Print the compose YAML (native: the command and env) and do nothing else: no preflight, "
                   "so it works on a machine without GPUs (e.g. to render a file for another host).")
@click.option("--bind", default="127.0.0.1", show_default=True, help="Host address the port is published on.")
@click.option("--listen", default="127.0.0.1", show_default=True, help="native: the address vLLM listens on.")
@click.option("--port", type=int, default=None, help="Port (default: the profile's).")
@click.option("--check", is_flag=True, help="Run the preflight (as `flashnext doctor`) and exit with its verdict.")
@click.option("--no-check", is_flag=True,
              help="Start without the preflight (by default a NO-GO stops serve before anything starts).")
@click.pass_context
@user_errors
def main(ctx, profile, model, overlays, ple_table, engine, dry_run, bind, listen, port, check, no_check) -> None:
    """Start the optimized vLLM system for a profile.

    Runs the preflight first (`flashnext doctor`: GPUs, every pinned host byte against RAM, limits,
    the PLE table and its drive, overlays, the image) and starts nothing on a NO-GO, exiting with its
    code (10-15); `--no-check` skips it. A profile that serves the PLE table from a file needs
    `--ple-table` (made by `flashnext ple build`).

    \b
    Examples:
      serve --profile 3x3090 --model SNAPSHOT --overlay OVERLAY --ple-table TABLE
      serve --profile 3x3090 --model SNAPSHOT --ple-table TABLE --dry-run > compose.yaml
      serve down --profile 3x3090
    """
    if ctx.invoked_subcommand is not None:
        return
    from flashnext.serving.compose import IMAGE, ServeRequest, render_compose, to_yaml
    from flashnext.serving.profiles import load_profile

    if not profile or model is None:
        raise FlashnextError("serve needs --profile and --model (see `serve --help`)")
    prof = load_profile(profile)
    if check and no_check:
        raise FlashnextError("--check and --no-check contradict each other: pass one")
    require_ple_table(prof, model, ple_table)
    if check:
        return preflight_report(profile, model, overlays, ple_table, engine, False)
    req = ServeRequest(prof, model, tuple(overlays), ple_table, bind, port)
    # rendered first: a path or address no Compose file can carry is refused before the preflight
    document = render_compose(req) if engine != "native" else None
    if not dry_run and not no_check:  # a NO-GO raises here, before anything is written or started
        preflight_report(profile, model, overlays, ple_table, engine, False, err=True)
    if engine == "native":
        return _native(prof, model, overlays, ple_table, listen, port or prof.container.port, dry_run)
    if dry_run:
        click.echo(to_yaml(document), nl=False)
        return
    if shutil.which(engine) is None:
        raise FlashnextError(f"{engine} is not installed or not on PATH: install it, or use --engine native")
    for path in (model, *overlays, *([ple_table] if ple_table else [])):
        if not Path(path).exists():
            raise FlashnextError(f"{path} does not exist on this host")
    folder = state_dir(prof.name)
    folder.mkdir(parents=True, exist_ok=True)
    compose_file = folder / "compose.yaml"
    compose_file.write_text(to_yaml(document))
    if subprocess.run([engine, "image", "inspect", IMAGE], capture_output=True).returncode != 0:
        click.echo(f"building {IMAGE} (vLLM 0.33.0 with the patch series) ...", err=True)
        run_command(compose_command(engine, compose_file, "build"))
    if line := summary_line(prof):
        click.echo(line, err=True)
    run_command(compose_command(engine, compose_file, "up", "-d"))
    url = f"http://{'127.0.0.1' if bind in ('0.0.0.0', '::') else bind}:{req.host_port}"
    models = wait_ready(url, prof.healthcheck.start_period_s,
                        lambda line: click.echo("\r" + line, nl=False, err=True))
    click.echo("", err=True)
    served = ", ".join(m.get("id", "?") for m in models.get("data", []))
    click.echo(f"ready: {url}/v1 (models: {served})")
    click.echo(f"stop:  serve down --profile {prof.name} --engine {engine}")
    click.echo(f"logs:  serve logs --profile {prof.name} --engine {engine}")


def _compose_file(profile: str) -> Path:
    path = state_dir(profile) / "compose.yaml"
    if not path.is_file():
        raise FlashnextError(f"no running profile {profile!r} was started from here ({path} is missing)")
    return path


@main.command("down")
@click.option("--profile", required=True)
@click.option("--engine", type=click.Choice(ENGINES[:2]), default="docker", show_default=True)
@user_errors
def down(profile: str, engine: str) -> None:
    """Stop and remove a profile's containers."""
    run_command(compose_command(engine, _compose_file(profile), "down"))


@main.command("logs")
@click.option("--profile", required=True)
@click.option("--engine", type=click.Choice(ENGINES[:2]), default="docker", show_default=True)
@click.option("--follow/--no-follow", default=True)
@user_errors
def logs(profile: str, engine: str, follow: bool) -> None:
    """Show a profile's server logs."""
    run_command(compose_command(engine, _compose_file(profile), "logs", *(["-f"] if follow else [])))


if __name__ == "__main__":
    main()
