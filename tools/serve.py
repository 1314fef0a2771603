"""``serve``: run a serving profile with Docker, Podman or natively; ``serve down`` / ``serve logs``."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import click

from flashnext.errors import FlashnextError
from flashnext.tools._common import user_errors

ENGINES = ("docker", "podman", "native")


def state_dir(profile: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flashnext" / "serve" / profile
    return root


def _compose(engine: str, compose_file: Path, *args: str) -> list[str]:
    return [engine, "compose", "-f", str(compose_file), *args]


def _run(cmd: list[str]) -> None:
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


def _native(profile, model: Path, overlays: tuple[Path, ...], ple_table: Path | None, listen: str, port: int,
            dry_run: bool) -> None:
    from flashnext.serving.compose import runtime_env, vllm_command

    model_dir = model
    if overlays:
        from flashnext.quant.overlays.view import apply_overlays

        if dry_run:
            model_dir = Path("<view of the snapshot with the overlays>")
        else:
            model_dir = Path(tempfile.mkdtemp(prefix="flashnext-view-")) / "model"
            apply_overlays(model, list(overlays), model_dir)
    env = runtime_env(profile, str(ple_table) if ple_table else None)
    cmd = vllm_command(profile, str(model_dir), listen, port)
    if dry_run:
        click.echo(json.dumps({"command": cmd, "env": env}, indent=2))
        return
    if shutil.which("vllm") is None:
        raise FlashnextError("vllm is not installed here: pip install 'flashnext[serve]', or use --engine docker")
    from flashnext.tools.plan import summary_line

    if line := summary_line(profile):
        click.echo(line, err=True)
    os.execvpe(cmd[0], cmd, {**os.environ, **env})


@click.group("serve", invoke_without_command=True)
@click.option("--profile", help="Serving profile (serving/profiles/NAME.json).")
@click.option("--model", type=click.Path(path_type=Path), help="The base model snapshot.")
@click.option("--overlay", "overlays", multiple=True, type=click.Path(path_type=Path),
              help="An overlay to apply, in order (repeatable).")
@click.option("--ple-table", type=click.Path(path_type=Path), default=None,
              help="The PLE table file from `flashnext ple build`.")
@click.option("--engine", type=click.Choice(ENGINES), default="docker", show_default=True)
@click.option("--dry-run", is_flag=True,
              help="Print the compose YAML (native: the command and env) and do nothing else.")
@click.option("--bind", default="127.0.0.1", show_default=True, help="Host address the port is published on.")
@click.option("--listen", default="127.0.0.1", show_default=True, help="native: the address vLLM listens on.")
@click.option("--port", type=int, default=None, help="Port (default: the profile's).")
@click.option("--check", is_flag=True, help="Run the preflight (as `flashnext doctor`) and exit with its verdict.")
@click.pass_context
@user_errors
def main(ctx, profile, model, overlays, ple_table, engine, dry_run, bind, listen, port, check) -> None:
    """Start the optimized vLLM system for a profile.

    \b
    Examples:
      serve --profile 3x3090 --model SNAPSHOT --overlay OVERLAY --ple-table TABLE
      serve --profile 3x3090 --model SNAPSHOT --dry-run > compose.yaml
      serve down --profile 3x3090
    """
    if ctx.invoked_subcommand is not None:
        return
    from flashnext.serving.compose import ServeRequest, render_compose, to_yaml
    from flashnext.serving.profiles import load_profile

    if not profile or model is None:
        raise FlashnextError("serve needs --profile and --model (see `serve --help`)")
    prof = load_profile(profile)
    if check:
        from flashnext.tools.doctor import report

        return report(profile, model, overlays, ple_table, engine, False)
    if engine == "native":
        return _native(prof, model, overlays, ple_table, listen, port or prof.container.port, dry_run)
    req = ServeRequest(prof, model, tuple(overlays), ple_table, bind, port)
    document = render_compose(req)
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
    image = document["services"]["vllm"]["image"]
    if subprocess.run([engine, "image", "inspect", image], capture_output=True).returncode != 0:
        click.echo(f"building {image} (vLLM 0.33.0 with the patch series) ...", err=True)
        _run(_compose(engine, compose_file, "build"))
    from flashnext.tools.plan import summary_line

    if line := summary_line(prof):
        click.echo(line, err=True)
    _run(_compose(engine, compose_file, "up", "-d"))
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
    _run(_compose(engine, _compose_file(profile), "down"))


@main.command("logs")
@click.option("--profile", required=True)
@click.option("--engine", type=click.Choice(ENGINES[:2]), default="docker", show_default=True)
@click.option("--follow/--no-follow", default=True)
@user_errors
def logs(profile: str, engine: str, follow: bool) -> None:
    """Show a profile's server logs."""
    _run(_compose(engine, _compose_file(profile), "logs", *(["-f"] if follow else [])))


if __name__ == "__main__":
    main()
