"""Rendering a serving profile as a Compose file (the vLLM command line it runs is the profile's:
:func:`flashnext.serving.profiles.vllm_command`).

The container runs ``flashnext serve --engine native`` (the image installs flashnext), which makes
a view of the snapshot with the overlays applied (symlinks, ``flashnext.quant.overlays.view``) and
then execs ``vllm serve``. Mounting each overlay file over the snapshot file would not work for
stacked overlays, whose config.json and index must be merged; the view does that inside the
container, from read-only mounts of the snapshot and of each overlay.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import yaml

from flashnext import __version__, envs
from flashnext.errors import FlashnextError
from flashnext.serving.deployment import Deployment
from flashnext.serving.patches.series import VLLM_VERSION
from flashnext.serving.profiles import CONTAINER_PORT, MODEL_DIR, Profile, capabilities_to_grant, is_shipped
from flashnext.serving.profiles import vllm_command  # noqa: F401  (the profile's: load_profile checks it)

# vLLM's own image of the release the series is cut against (serving/Dockerfile's FROM, and
# manifests/vllm-VERSION.json's "image": tests/test_project.py holds the three to one release).
BASE_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"
IMAGE = f"flashnext/vllm-openai:v{VLLM_VERSION}-flashnext{__version__}"
SERVICE = "vllm"
OVERLAY_DIR = "/models/overlays"
PLE_PATH = "/models/ple/table.bin"
PROFILE_DIR_IN_CONTAINER = "/models/profile"  # where a profile file that is not shipped is mounted
# The repository, when flashnext runs from a source checkout (the image is built from one); an
# installed wheel has no build context, so its compose file names the image only.
SOURCE_ROOT = Path(__file__).resolve().parent.parent


def runtime_env(profile: Profile, ple_table: str | None) -> dict[str, str]:
    env = dict(profile.env)
    if ple_table is not None:
        env[envs.VLLM_PLE_MMAP_PATH.name] = ple_table
    return env


def compose_literal(value: str) -> str:
    """``value`` as a Compose string that reads back as ``value``.

    Compose interpolates ``$NAME``, ``${NAME}`` and ``$$`` in every string value of the file
    (extension fields included, mapping keys not): a model under ``/data/$HOME`` would otherwise
    mount the user's home directory."""
    return value.replace("$", "$$")


def _escape_values(node):
    if isinstance(node, str):
        return compose_literal(node)
    if isinstance(node, dict):
        return {key: _escape_values(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_escape_values(item) for item in node]
    return node


def _bind_source(field: str, path: Path) -> str:
    """``path`` (the input ``field``) as the absolute bind source Compose gets, refused in one line
    where no Compose file can carry it: a control character (a newline would also split every
    message that names the path) or bytes that are not UTF-8 (Compose files are UTF-8; YAML would
    escape them into another name)."""
    text = str(Path(path).absolute())
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text):
        raise FlashnextError(f"{text!r} contains a newline or another control character, which a "
                             "Compose mount cannot name: rename it, or pass a symlink to it whose path has none",
                             field=field)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise FlashnextError(f"{text!r} is not valid UTF-8, which a Compose file cannot name: rename it, "
                             "or pass a symlink to it whose path is UTF-8", field=field) from None
    return text


def _bind(source: str, target: str) -> dict:
    # Without `create_host_path: false` Compose hands a plain bind to Docker as the string
    # "SOURCE:TARGET:ro", which a `:` in SOURCE breaks; with it, Compose uses the Mount API (one
    # field per part) and a missing source is an error rather than an empty directory made by root.
    return {"type": "bind", "source": source, "target": target, "read_only": True,
            "bind": {"create_host_path": False}}


def _published_port(bind: str, host_port: int) -> dict:
    try:
        ipaddress.ip_address(bind)
    except ValueError:
        raise FlashnextError(f"{bind!r} is not an IP address (Docker publishes ports on an address, "
                             "e.g. 127.0.0.1, 0.0.0.0 or ::)", field="bind") from None
    return {"target": CONTAINER_PORT, "published": str(host_port), "host_ip": bind, "protocol": "tcp"}


def container_ulimits(profile: Profile) -> dict:
    """The ``ulimits`` of the profile's service: what the container gets, whatever the host's own
    limits (the preflight judges a container's locked-memory limit by this)."""
    return {"memlock": {"soft": -1, "hard": -1}} if profile.container.memlock_unlimited else {}


def compose_model(req: Deployment) -> dict:
    """The Compose document for the deployment ``req`` with every value as the container must see it, before the
    escaping a Compose file needs (:func:`render_compose`); paths need not exist (it may be meant
    for another host)."""
    p, c = req.profile, req.profile.container
    volumes = [_bind(_bind_source("model", req.model), MODEL_DIR)]
    profile_arg = p.name
    if not is_shipped(p):  # the image has the shipped profiles only: a profile file goes in read-only
        profile_arg = f"{PROFILE_DIR_IN_CONTAINER}/{p.name}.json"
        volumes.append(_bind(_bind_source("profile", p.path), profile_arg))
    # `serve` on the host ran the preflight before it started the container
    command = ["serve", "--engine", "native", "--profile", profile_arg, "--model", MODEL_DIR,
               "--listen", "0.0.0.0", "--port", str(CONTAINER_PORT), "--no-check"]
    # the serve inside loads the profile again: what the user granted here, it is granted there
    for cap in capabilities_to_grant(p):
        command += ["--grant", cap]
    for i, overlay in enumerate(req.overlays):
        target = f"{OVERLAY_DIR}/{i}"
        volumes.append(_bind(_bind_source("overlay", overlay), target))
        command += ["--overlay", target]
    if p.uses_ple_table and req.ple_table is not None:
        volumes.append(_bind(_bind_source("ple_table", req.ple_table), PLE_PATH))
        command += ["--ple-table", PLE_PATH]
    service: dict = {
        "image": IMAGE,
        "entrypoint": ["flashnext"],
        "command": command,
        "environment": runtime_env(p, PLE_PATH if p.uses_ple_table and req.ple_table else None),
        "volumes": volumes,
        "ports": [_published_port(req.bind, req.host_port)],
        "ipc": c.ipc,
        "shm_size": c.shm_size,
        "stop_grace_period": f"{c.stop_grace_period_s}s",
        "deploy": {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "count": p.gpus, "capabilities": ["gpu"]}]}}},
        "healthcheck": {
            "test": ["CMD-SHELL", f"curl -fsS http://localhost:{CONTAINER_PORT}/health || exit 1"],
            "interval": f"{p.healthcheck.interval_s}s", "timeout": f"{p.healthcheck.timeout_s}s",
            "retries": p.healthcheck.retries, "start_period": f"{p.healthcheck.start_period_s}s"},
        "labels": {"io.flashnext.profile": p.name, "io.flashnext.version": __version__},
    }
    if ulimits := container_ulimits(p):
        service["ulimits"] = ulimits
    if c.cap_add:
        service["cap_add"] = sorted(c.cap_add)
        for cap, why in c.cap_add.items():
            service["labels"][f"io.flashnext.cap_add.{cap}"] = why
    if (SOURCE_ROOT / "pyproject.toml").is_file() and (SOURCE_ROOT / "serving" / "Dockerfile").is_file():
        service["build"] = {"context": str(SOURCE_ROOT), "dockerfile": "serving/Dockerfile"}
    return {"name": f"flashnext-{p.name}", "services": {SERVICE: service},
            "x-flashnext": {"profile": p.name, "description": p.description, "base_image": BASE_IMAGE}}


def render_compose(req: Deployment) -> dict:
    """The Compose file's document for ``req``: :func:`compose_model` with every string value
    escaped, so that Compose reads back exactly the model's values."""
    return _escape_values(compose_model(req))


def to_yaml(document: dict) -> str:
    return yaml.safe_dump(document, sort_keys=False, width=120)
