"""Running a serving profile: natively or through Compose, readiness, and the plan's one line.

The ``serve`` command line is a thin layer over this module.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from flashnext import envs
from flashnext.errors import FlashnextError, named
from flashnext.sizes import format_size

# The Compose implementations, in the order they are tried, by the engine whose images they run.
COMPOSE_IMPLEMENTATIONS = {"docker": (("docker", "compose"), ("docker-compose",)), "podman": (("podman", "compose"),)}
COMPOSE_INSTALL = {
    "docker": "Docker's Compose plugin (the docker-compose-plugin package; https://docs.docker.com/compose/install/)",
    "podman": "a Compose provider for podman (podman-compose, or docker-compose)",
}
# Written only once `compose up` has succeeded: `serve down` and `serve logs` read it.
STATE_FILE = "compose.yaml"


def state_dir(profile: str) -> Path:
    """Where serve keeps what it started for the profile named ``profile``: one folder under the
    cache, never a path the name walks out to."""
    from flashnext.serving.profiles import require_profile_name

    root = Path(envs.XDG_CACHE_HOME.get() or Path.home() / ".cache") / "flashnext" / "serve"
    return root / require_profile_name(profile)


def find_compose(engine: str | None = None, path: str | None = None) -> list[str]:
    """The argv prefix of the first Compose implementation that answers ``version``: ``docker
    compose``, ``docker-compose``, ``podman compose`` (only ``engine``'s with one), looked up on
    ``path`` (default: PATH). Raises, saying what to install, when there is none."""
    engines = [engine] if engine else list(COMPOSE_IMPLEMENTATIONS)
    tried = []
    for name in engines:
        for argv in COMPOSE_IMPLEMENTATIONS[name]:
            tried.append(" ".join(argv))
            program = shutil.which(argv[0], path=path)
            if program is None:
                continue
            try:
                answered = subprocess.run([program, *argv[1:], "version"], capture_output=True, timeout=60,
                                          env=None if path is None else {**os.environ, "PATH": path})
            except (OSError, subprocess.TimeoutExpired):
                continue
            if answered.returncode == 0:
                return [program, *argv[1:]]
    install = " or ".join(COMPOSE_INSTALL[name] for name in engines)
    instead = " or ".join(f"--engine {e}" for e in (*(e for e in COMPOSE_IMPLEMENTATIONS if e not in engines), "native"))
    raise FlashnextError(f"no Compose found (tried {', '.join(f'`{t} version`' for t in tried)}): install {install}, "
                         f"or use {instead}")


def compose_engine(compose: list[str]) -> str:
    """The engine whose images and containers ``compose`` (from :func:`find_compose`) works with."""
    return "podman" if Path(compose[0]).name == "podman" else "docker"


def engine_found() -> str:
    """The engine `serve` would start with by default, for the preflight's image check; docker where
    no Compose is found (the check then says what is missing)."""
    try:
        return compose_engine(find_compose())
    except FlashnextError:
        return "docker"


def compose_command(compose: list[str], compose_file: Path, *args: str) -> list[str]:
    return [*compose, "-f", str(compose_file), *args]


def image_present(compose: list[str], image: str) -> bool:
    """Whether the engine behind ``compose`` has ``image``; False too where its CLI is missing (a
    standalone docker-compose), so that Compose's own build runs: it reuses what is cached."""
    from flashnext.serving.preflight import image_built

    program = compose[0] if len(compose) > 1 else shutil.which(compose_engine(compose))
    if program is None:
        return False
    try:
        return image_built(program, image)
    except FileNotFoundError:
        return False


def start_compose(compose: list[str], profile: str, text: str, build: bool) -> Path:
    """Build (``build``) and start the Compose project ``text`` for ``profile``; returns the state file.

    The compose file is written to a temporary name in the state folder, created exclusively and
    never through a link, and started from there (its folder and ``name:`` make the project, the
    same as the final name's); it is renamed into place only once ``up`` has succeeded, so that a
    failed start records nothing for `serve down` and `serve logs` to find."""
    from flashnext.quant.checkpoint.fsutil import make_parents, output_lock, remove_empty, remove_leftovers

    state = state_dir(profile) / STATE_FILE
    created = make_parents(state)
    try:
        with output_lock(state) as folder:
            remove_leftovers(state, folder)
            tmp = f".{STATE_FILE}.tmp-{os.getpid()}"
            fd = folder.create(tmp)
            written = os.fstat(fd)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                if build:
                    run_command(compose_command(compose, folder.path / tmp, "build"))
                run_command(compose_command(compose, folder.path / tmp, "up", "-d"))
                folder.rename(tmp, STATE_FILE)
                os.fsync(folder.fd)
            finally:
                if folder.holds(tmp, (written.st_dev, written.st_ino)):
                    os.unlink(tmp, dir_fd=folder.fd)
    except BaseException:
        remove_empty(created)
        raise
    return state


def serve_compose(compose: list[str], deployment, compose_text: str, url: str, image: str,
                  say=None, progress=None) -> dict:
    """Run ``deployment`` through ``compose`` (from :func:`find_compose`) with the Compose file
    ``compose_text``: build ``image`` where the engine lacks it, print the plan's line, start the
    project and wait until ``url`` serves. ``say`` takes the lines for the user, ``progress`` the
    waiting line; returns the models listing."""
    from flashnext.serving.patches.series import VLLM_VERSION

    build = not image_present(compose, image)
    if build and say:
        say(f"building {image} (vLLM {VLLM_VERSION} with the patch series) ...")
    if say and (line := summary_line(deployment)):
        say(line)
    profile = deployment.profile
    start_compose(compose, profile.name, compose_text, build)
    return wait_ready(url, profile.healthcheck.start_period_s, progress)


def recorded_compose_file(profile: str) -> Path:
    """The compose file a successful ``serve`` recorded for ``profile``."""
    path = state_dir(profile) / STATE_FILE
    if not path.is_file() or path.is_symlink():
        raise FlashnextError(f"nothing is running for profile {profile!r}: no `serve --profile {profile}` "
                             f"started from here ({path} is missing)")
    return path


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


def require_ple_table(deployment) -> None:
    """A profile that serves the PLE table from a file cannot start without one: vLLM would fall back
    to pinning the whole table (95.4 GiB), which beside the QSA K/V exceeds a 125 GiB host. A table
    that ``flashnext ple build --format`` quantized (the model's or an overlay's config.json says
    ``ple_embedding_dtype``) is vLLM's own to serve from pinned host memory: no file, and none taken."""
    profile, model, ple_table = deployment.profile, deployment.model, deployment.ple_table
    if model is not None and profile.model_family == "qwen4_exp":
        quantized = deployment.ple_format
        if quantized is not None:
            if ple_table is not None:
                raise FlashnextError(f"the PLE table is {quantized} (config.json's ple_embedding_dtype): vLLM serves "
                                     f"it from pinned host memory, not from a file; drop {named('ple_table')}")
            return
    if profile.uses_ple_table and ple_table is None:
        src = shlex.quote(str(model)) if model is not None and str(model).isprintable() else "SNAPSHOT"
        raise FlashnextError(
            f"profile {profile.name} serves the PLE table from a file: pass {named('ple_table')} FILE, made with "
            f"`flashnext ple build --src {src} --out FILE`")


def summary_line(deployment) -> str | None:
    """One line of the deployment's plan for `serve` to print before starting, the plan the preflight
    judged (without a model: the pinned base checkpoint's); None when it cannot plan here."""
    from flashnext.serving import capacity

    if deployment.profile.model_family not in capacity.FAMILIES:
        return None
    try:
        p = deployment.plan
    except FlashnextError:
        return None
    return (f"plan: {p.blocks} blocks per rank, {p.blocks_per_request} per {p.max_model_len:,}-token request: "
            f"{p.capacity_tokens:,} tokens ({p.concurrency:.2f}x); pinned host K/V {format_size(p.pinned_host_bytes_needed)}")


def refuse_missing_inputs(deployment) -> None:
    """Each path serve mounts or hands to vLLM must exist here: a missing one would become an empty
    bind mount, or a vLLM that fails minutes later."""
    overlays, ple_table = deployment.overlays, deployment.ple_table
    for field, path in (("model", deployment.model), *(("overlay", o) for o in overlays),
                        *((("ple_table", ple_table),) if ple_table is not None else ())):
        if not os.path.exists(path):
            raise FlashnextError(f"{path} does not exist on this host", field=field)


def view_dir(deployment) -> Path:
    """Where ``serve --engine native`` makes the view of the deployment's model with its overlays:
    one folder per snapshot and overlays (made again by each start, which replaces only its own), so
    that ``--dry-run`` names the path the start will use."""
    key = "\0".join(str(Path(p).absolute()) for p in (deployment.model, *deployment.overlays))
    return state_dir(deployment.profile.name) / "views" / hashlib.sha256(key.encode()).hexdigest()[:16]


def native_command(deployment, listen: str, port: int, make_view: bool = True,
                   verified: bool = False) -> tuple[list[str], dict[str, str]]:
    """``vllm serve`` and the environment that run ``deployment`` on this host, every path absolute
    (vLLM and its workers may run from another directory). With overlays, the model is the view of
    the snapshot with them applied (:func:`view_dir`), made here unless ``make_view`` is False: the
    deployment's overlay stack written out, as read once; its overlays checked against the snapshot
    unless the preflight ``verified`` them."""
    from flashnext.serving.compose import runtime_env
    from flashnext.serving.profiles import vllm_command

    profile, model, overlays = deployment.profile, deployment.model, deployment.overlays
    model_dir = Path(model).absolute()
    if overlays:
        from flashnext.quant.overlays.view import apply_overlays

        model_dir = view_dir(deployment)
        if make_view:
            apply_overlays(model, list(overlays), model_dir, verify=not verified, force=True,
                           stack=deployment.overlay_stack)
    table = str(Path(deployment.ple_table).absolute()) if deployment.ple_table else None
    return vllm_command(profile, str(model_dir), listen, port), runtime_env(profile, table)


def exec_native(cmd: list[str], env: dict[str, str]) -> None:
    """Replace this process with ``cmd`` under ``env`` added to the current environment, less what
    the planner set in it for itself (``shape.PLANNING_ENV``)."""
    import shutil

    from flashnext.serving.capacity.shape import PLANNING_ENV

    if shutil.which(cmd[0]) is None:
        from flashnext.serving import vllm_release

        raise FlashnextError(f"{vllm_release.support_line(None)}; or use {named('engine')} docker")
    inherited = {k: v for k, v in os.environ.items() if PLANNING_ENV.get(k) != v}
    os.execvpe(cmd[0], cmd, {**inherited, **env})
