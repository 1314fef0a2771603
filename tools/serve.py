"""``serve``: run a serving profile with Docker, Podman or natively; ``serve down`` / ``serve logs``."""

from __future__ import annotations

import json
from pathlib import Path

import click

from flashnext.errors import UsageError
from flashnext.serving.run import (compose_command, compose_engine, engine_found, exec_native, find_compose,
                                   native_command, recorded_compose_file, refuse_missing_inputs, require_ple_table,
                                   run_command, serve_compose, summary_line)
from flashnext.tools._common import CONTEXT_SETTINGS, RootGroup, begin, begin_preflight, preflight_report, user_errors

ENGINES = ("docker", "podman", "native")


def _granted_capabilities(ctx, param, values: tuple[str, ...]) -> tuple[str, ...]:
    from flashnext.errors import FlashnextError
    from flashnext.serving.profiles import capability

    try:
        return tuple(capability(value) for value in values)
    except FlashnextError as e:
        raise click.BadParameter(str(e)) from None


def _native(deployment, listen: str, dry_run: bool, verified: bool = False) -> None:
    port = deployment.host_port
    cmd, env = native_command(deployment, listen, port, make_view=not dry_run, verified=verified)
    if dry_run:
        shown = {"command": cmd, "env": env}
        if deployment.overlays:  # the model vLLM gets is a view that serve makes (`overlay apply`) before it starts
            shown["view"] = {"path": cmd[2], "base": str(Path(deployment.model).absolute()),
                             "overlays": [str(Path(o).absolute()) for o in deployment.overlays]}
        click.echo(json.dumps(shown, indent=2))
        return
    if line := summary_line(deployment):
        click.echo(line, err=True)
    exec_native(cmd, env)


@click.group("serve", cls=RootGroup, invoke_without_command=True, context_settings=CONTEXT_SETTINGS)
@click.option("--profile", help="Serving profile: a name (serving/profiles/NAME.json) or a profile file "
                                "(`flashnext plan --write-profile`'s).")
@click.option("--model", type=click.Path(path_type=Path), help="The base model snapshot.")
@click.option("--overlay", "overlays", multiple=True, type=click.Path(path_type=Path),
              help="An overlay to apply, in order (repeatable).")
@click.option("--ple-table", type=click.Path(path_type=Path), default=None,
              help="The PLE table file from `flashnext ple build`.")
@click.option("--engine", type=click.Choice(ENGINES), default=None,
              help="docker or podman: that engine's Compose; native: `vllm serve` here. Default: the first "
                   "Compose found of `docker compose`, `docker-compose`, `podman compose`.")
@click.option("--dry-run", is_flag=True,
              help="Print the compose YAML (native: the command and env) and do nothing else: no preflight, "
                   "so it works on a machine without GPUs. The paths it names must exist here.")
@click.option("--bind", default="127.0.0.1", show_default=True, help="Host address the port is published on.")
@click.option("--listen", default="127.0.0.1", show_default=True, help="native: the address vLLM listens on.")
@click.option("--port", type=int, default=None, help="Port (default: the profile's).")
@click.option("--grant", "grants", multiple=True, callback=_granted_capabilities, metavar="CAPABILITY",
              help="Grant the container a capability its profile asks for beyond what a profile gets unasked "
                   "(docs/serving.md; repeatable; SYS_ADMIN or CAP_SYS_ADMIN). A profile asking for one not "
                   "granted is refused.")
@click.option("--check", is_flag=True, help="Run the preflight (as `flashnext doctor`) and exit with its verdict.")
@click.option("--no-check", is_flag=True,
              help="Start without the preflight (by default a NO-GO stops serve before anything starts).")
@click.pass_context
@user_errors
def main(ctx, profile, model, overlays, ple_table, engine, dry_run, bind, listen, port, grants, check,
         no_check) -> None:
    """Start the optimized vLLM system for a profile.

    Runs the preflight first (`flashnext doctor`: GPUs, every pinned host byte against RAM, limits,
    the PLE table and its drive, overlays, the image) and starts nothing on a NO-GO, exiting with its
    code (10-15); `--no-check` skips it. A profile that serves the PLE table from a file needs
    `--ple-table` (made by `flashnext ple build`).

    \b
    Examples:
      serve --profile 3x3090-mtp --model SNAPSHOT --overlay MTP_OVERLAY --ple-table TABLE
      serve --profile 3x3090 --model SNAPSHOT --ple-table TABLE --dry-run > compose.yaml
      serve down --profile 3x3090
    """
    if ctx.invoked_subcommand is not None:
        return
    from flashnext.serving.compose import IMAGE, render_compose, to_yaml
    from flashnext.serving.deployment import resolve_deployment

    missing = [flag for flag, given in (("--profile", profile), ("--model", model)) if not given]
    if missing:
        raise UsageError(f"serve needs {' and '.join(missing)} (see `serve --help`)")
    if check and no_check:
        raise UsageError("--check and --no-check contradict each other: pass one")
    if check:
        begin_preflight(profile, engine or "installed container")
    else:
        begin(f"{'rendering' if dry_run else 'starting'} {profile}: its vllm_args through vLLM's own parser "
              f"(vLLM loads first)")
    # resolved once: every stage below takes it, none loads the profile or reads the model again
    deployment = resolve_deployment(profile, model, overlays, ple_table, grants=grants, bind=bind, port=port)
    prof = deployment.profile
    require_ple_table(deployment)
    if check:
        return preflight_report(deployment, engine or engine_found(), False)
    # rendered first: a path or address no Compose file can carry is refused before the preflight
    document = render_compose(deployment) if engine != "native" else None
    # Then the paths it mounts or hands to vLLM, --dry-run's too: from a missing one it would render
    # a file that cannot start (an empty bind mount, a vLLM that fails minutes in).
    refuse_missing_inputs(deployment)
    if dry_run:
        if engine == "native":
            return _native(deployment, listen, dry_run)
        click.echo(to_yaml(document), nl=False)
        return
    # A missing Compose is refused before the preflight: its GO would be for a start that cannot happen.
    compose = find_compose(engine) if engine != "native" else None
    if not no_check:  # a NO-GO raises here, before anything is written or started
        preflight_report(deployment, compose_engine(compose) if compose else "native", False, err=True)
    elif engine == "native":  # --no-check skips the rig's checks, not whether this vLLM can serve at all
        from flashnext.errors import NoGo
        from flashnext.serving.preflight import check_vllm

        found = check_vllm("native")
        if not found.ok:
            click.echo(f"Error: {found.detail}: {found.fix}", err=True)
            raise NoGo(found.detail, found.exit)
    if engine == "native":  # the preflight's GO checked the overlays against the snapshot
        return _native(deployment, listen, dry_run, verified=not no_check)
    url = f"http://{'127.0.0.1' if bind in ('0.0.0.0', '::') else bind}:{deployment.host_port}"
    models = serve_compose(compose, deployment, to_yaml(document), url, IMAGE,
                           say=lambda line: click.echo(line, err=True),
                           progress=lambda line: click.echo("\r" + line, nl=False, err=True))
    click.echo("", err=True)
    engine = compose_engine(compose)
    served = ", ".join(m.get("id", "?") for m in models.get("data", []))
    click.echo(f"ready: {url}/v1 (models: {served})")
    click.echo(f"stop:  serve down --profile {prof.name} --engine {engine}")
    click.echo(f"logs:  serve logs --profile {prof.name} --engine {engine}")


ENGINE_OF_A_START = click.option("--engine", type=click.Choice(ENGINES[:2]), default=None,
                                 help="The engine `serve` started it with (default: the first Compose found, "
                                      "as `serve` looks).")


@main.command("down")
@click.option("--profile", required=True, help="The profile `serve` started (its name or its file).")
@ENGINE_OF_A_START
@user_errors
def down(profile: str, engine: str | None) -> None:
    """Stop and remove a profile's containers."""
    from flashnext.serving.profiles import profile_name

    compose_file = recorded_compose_file(profile_name(profile))
    run_command(compose_command(find_compose(engine), compose_file, "down"))


@main.command("logs")
@click.option("--profile", required=True, help="The profile `serve` started (its name or its file).")
@ENGINE_OF_A_START
@click.option("--follow/--no-follow", default=True, show_default=True,
              help="Keep printing new lines until interrupted.")
@user_errors
def logs(profile: str, engine: str | None, follow: bool) -> None:
    """Show a profile's server logs."""
    from flashnext.serving.profiles import profile_name

    compose_file = recorded_compose_file(profile_name(profile))
    run_command(compose_command(find_compose(engine), compose_file, "logs", *(["-f"] if follow else [])))


if __name__ == "__main__":
    main()
