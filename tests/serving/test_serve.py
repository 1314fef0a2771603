"""Serving profiles: the rendered compose against the Compose schema, every vLLM argument against
vLLM 0.34.0's own parser, every environment variable against what is read, and `serve` itself."""

import dataclasses
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from flashnext import envs
from flashnext.errors import FlashnextError
from flashnext.serving.compose import compose_model, render_compose, vllm_command
from flashnext.serving.deployment import Deployment
from flashnext.serving.profiles import available, load_profile
from flashnext.tools.cli import main as cli
from flashnext.serving.run import wait_ready

from support import ROOT
PROFILES = available()
SCHEMA = json.loads((ROOT / "manifests" / "compose-spec.schema.json").read_text())


@pytest.fixture
def inputs(tmp_path) -> tuple[Path, Path, Path]:
    """A snapshot folder, an overlay folder and a PLE table file that exist (`serve --dry-run` renders
    only what exists here): their content is not read."""
    snap, overlay, table = tmp_path / "snap", tmp_path / "ov1", tmp_path / "ple.bin"
    snap.mkdir()
    overlay.mkdir()
    table.write_bytes(b"")
    return snap, overlay, table


def test_the_profiles_of_the_issue_exist():
    assert {"3x3090", "3x3090-mtp", "8xh200-glm53-hisparse"} <= set(PROFILES)


def render(name, **kw):
    return render_compose(Deployment(load_profile(name), Path("/srv/snapshot"), (Path("/srv/ov1"), Path("/srv/ov2")),
                                       Path("/srv/ple.bin"), **kw))


@pytest.mark.parametrize("name", PROFILES)
def test_compose_validates_against_the_compose_schema(name, inputs):
    document = render(name)
    jsonschema.validate(document, SCHEMA)
    # and survives the YAML round trip that `serve --dry-run` prints
    snap, overlay, table = inputs
    result = CliRunner().invoke(cli, ["serve", "--profile", name, "--model", str(snap), "--overlay", str(overlay),
                                      "--ple-table", str(table), "--dry-run"])
    assert result.exit_code == 0, result.output
    jsonschema.validate(yaml.safe_load(result.stdout), SCHEMA)


def test_the_compose_file_is_the_model_with_every_value_escaped():
    """Compose interpolates `$` in values (not keys): the file doubles each one, and nothing else
    differs from the values the container must see (tests/hostile/test_hostile_compose.py checks
    that with a real Compose)."""
    profile = dataclasses.replace(load_profile("3x3090"), env={"A": "$HOME ${X} $$"}, description="$5")
    req = Deployment(profile, Path("/srv/$HOME"), (Path("/srv/${X}:ro"),), Path("/srv/$$.bin"))

    def doubled(node):
        if isinstance(node, str):
            return node.replace("$", "$$")
        if isinstance(node, dict):
            return {k: doubled(v) for k, v in node.items()}
        return [doubled(v) for v in node] if isinstance(node, list) else node

    document, model = render_compose(req), compose_model(req)
    assert document == doubled(model)
    svc = document["services"]["vllm"]
    assert svc["environment"] == {"A": "$$HOME $${X} $$$$", "VLLM_PLE_MMAP_PATH": "/models/ple/table.bin"}
    assert [v["source"] for v in svc["volumes"]] == ["/srv/$$HOME", "/srv/$${X}:ro", "/srv/$$$$.bin"]
    assert document["x-flashnext"]["description"] == "$$5"
    jsonschema.validate(document, SCHEMA)


@pytest.mark.parametrize("name", PROFILES)
def test_container_settings(name):
    profile = load_profile(name)
    svc = render(name)["services"]["vllm"]
    assert svc["ports"] == [{"target": 8000, "published": str(profile.container.port), "host_ip": "127.0.0.1",
                             "protocol": "tcp"}]
    assert svc["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
    assert svc["ipc"] == "host" and svc["shm_size"]
    assert svc["deploy"]["resources"]["reservations"]["devices"][0]["count"] == profile.gpus
    mounts = {m["target"]: m for m in svc["volumes"]}
    assert mounts["/models/snapshot"]["read_only"] and mounts["/models/snapshot"]["source"] == "/srv/snapshot"
    # a missing source is an error, not an empty directory Docker makes (and the Mount API carries a `:`)
    assert all(m["type"] == "bind" and m["bind"] == {"create_host_path": False} for m in svc["volumes"])
    assert mounts["/models/overlays/0"]["source"] == "/srv/ov1" and mounts["/models/overlays/1"]["read_only"]
    assert svc["command"].count("--overlay") == 2
    shutdown = int(profile.vllm_args[profile.vllm_args.index("--shutdown-timeout") + 1])
    assert profile.container.stop_grace_period_s >= shutdown + 10
    assert svc["stop_grace_period"] == f"{profile.container.stop_grace_period_s}s"
    assert "/health" in " ".join(svc["healthcheck"]["test"])
    for cap in svc.get("cap_add", []):
        assert len(svc["labels"][f"io.flashnext.cap_add.{cap}"]) > 40  # the reason is recorded
    if profile.uses_ple_table:
        assert mounts["/models/ple/table.bin"]["read_only"]
        assert svc["environment"]["VLLM_PLE_MMAP_PATH"] == "/models/ple/table.bin"


def test_3x3090_matches_the_seed():
    p = load_profile("3x3090")
    a = p.vllm_args
    value = lambda flag: a[a.index(flag) + 1]  # noqa: E731
    assert value("--pipeline-parallel-size") == "3" and value("--max-model-len") == "262144"
    assert value("--max-num-seqs") == "4" and value("--max-num-batched-tokens") == "512"
    assert value("--kv-cache-memory-bytes") == "783000000" and value("--mamba-cache-mode") == "align"
    assert "SYS_PTRACE" in p.container.cap_add
    mtp = load_profile("3x3090-mtp")
    m = mtp.vllm_args
    assert m[m.index("--kv-cache-memory-bytes") + 1] == "550000000" and m[m.index("--max-num-seqs") + 1] == "2"
    assert json.loads(m[m.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 1}
    assert mtp.env["VLLM_PP_LAYER_PARTITION"] == "16,17,15"


cli_args = pytest.importorskip("vllm.entrypoints.common.cli_args", reason="vLLM 0.34.0 is installed by .ci/run")


@pytest.mark.parametrize("name", PROFILES)
def test_vllm_accepts_every_argument(name):
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = cli_args.make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(vllm_command(load_profile(name), "/models/view", "0.0.0.0", 8000)[2:])
    cli_args.validate_parsed_serve_args(args)
    assert args.model_tag == "/models/view" or args.model == "/models/view"


def test_the_seed_004_hisparse_key_is_refused_by_vllm_0_34():
    """Why the GLM profile does not copy seed 004's flags: vLLM 0.34.0's parser rejects them."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = cli_args.make_arg_parser(FlexibleArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["/m", "--attention-config", '{"hisparse_config":{"host_pool_gib":384}}'])


def known_variable(name: str) -> bool:
    import vllm.envs

    return (name in vllm.envs.environment_variables or name in {v.name for v in envs.ALL}
            or name in envs.THIRD_PARTY)


@pytest.mark.parametrize("name", PROFILES)
def test_every_environment_variable_is_read_by_something(name):
    env = render(name)["services"]["vllm"]["environment"]
    unknown = [k for k in env if not known_variable(k)]
    assert unknown == []


def test_a_typo_is_caught():
    assert not known_variable("PYTORCH_ALLOC_CONF")
    assert not known_variable("VLLM_PLE_MMAP_PAHT")


def test_native_dry_run_and_errors(tmp_path, inputs):
    snap, _, table = inputs
    result = CliRunner().invoke(cli, ["serve", "--profile", "3x3090", "--model", str(snap), "--engine", "native",
                                      "--ple-table", str(table), "--dry-run"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["command"][:3] == ["vllm", "serve", str(snap)] and out["env"]["VLLM_PLE_MMAP_PATH"] == str(table)
    bad = CliRunner().invoke(cli, ["serve", "--profile", "5x3090", "--model", str(snap), "--dry-run"])
    assert bad.exit_code == 1 and "choose one of" in bad.output
    missing = CliRunner().invoke(cli, ["serve", "--profile", "3x3090", "--model", tmp_path / "nope", "--engine", "docker"])
    assert missing.exit_code == 1 and len(missing.output.strip().splitlines()) == 1


def test_profile_loader_rejects_unknown_keys(tmp_path):
    data = json.loads((ROOT / "serving" / "profiles" / "3x3090.json").read_text())
    data["max_tokens"] = 5
    (tmp_path / "3x3090.json").write_text(json.dumps(data))
    with pytest.raises(FlashnextError, match="unknown keys"):
        load_profile("3x3090", tmp_path)


def test_wait_ready_against_a_server_on_loopback():
    """A stand-in for vLLM's HTTP server: /health fails twice, then both endpoints answer."""
    calls = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            calls.append(self.path)
            if self.path == "/health" and calls.count("/health") < 3:
                self.send_response(503)
                self.end_headers()
                return
            body = json.dumps({"data": [{"id": "flash-next"}]}).encode() if self.path == "/v1/models" else b""
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        lines = []
        models = wait_ready(f"http://127.0.0.1:{server.server_address[1]}", 10, lines.append, poll_s=0.05)
        assert models["data"][0]["id"] == "flash-next"
        assert calls[-2:] == ["/health", "/v1/models"] and lines
        with pytest.raises(FlashnextError, match="did not answer"):
            wait_ready("http://127.0.0.1:9", 0.1, poll_s=0.05)
    finally:
        server.shutdown()


# --- serve is safe by default: the PLE table file is required, the preflight runs first ----------

@pytest.fixture
def stock_vllm_check(monkeypatch):
    """The vLLM check as this machine answers it: stock vLLM 0.34.0, the series not applied."""
    from flashnext.serving import preflight as pf

    return pf.check_vllm


@pytest.fixture
def serve_state(tmp_path, monkeypatch, stock_vllm_check):
    """Where serve writes its compose file, and a record of what it would have executed. The native
    engine's vLLM stands in as patched (``check_vllm`` GO): the one installed here is stock."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    started = []
    import flashnext.tools.serve as serve_tool
    from flashnext.serving import preflight as pf

    monkeypatch.setattr(serve_tool, "exec_native", lambda cmd, env: started.append((cmd, env)))
    monkeypatch.setattr(serve_tool, "run_command", lambda cmd: started.append((cmd, None)))
    monkeypatch.setattr(pf, "check_vllm", lambda engine: pf.Finding("vllm", True, "patched (stand-in)"))
    return tmp_path / "cache", started


def test_no_check_still_refuses_a_native_vllm_that_cannot_serve(serve_state, stock_vllm_check, demo_snapshot,
                                                                 demo_table, monkeypatch):
    """--no-check skips the rig's checks, not the one that makes a native start fail a minute in with
    vLLM's traceback (issue 41): the stock vLLM installed here is refused in one line naming the fix."""
    from flashnext.serving import preflight as pf

    cache, started = serve_state
    monkeypatch.setattr(pf, "check_vllm", stock_vllm_check)
    result = CliRunner().invoke(cli, ["serve", "--profile", "3x3090", "--model", str(demo_snapshot),
                                      "--ple-table", str(demo_table), "--engine", "native", "--no-check"])
    assert result.exit_code == pf.NoGoCode.IMAGE, result.output
    assert result.stderr.count("\n") == 1 and "without flashnext's patch series" in result.stderr
    assert "flashnext patches apply --target " in result.stderr and started == []


@pytest.mark.parametrize("extra", [[], ["--dry-run"], ["--engine", "native"], ["--no-check"], ["--check"]])
def test_a_ple_table_profile_without_the_table_is_refused(serve_state, extra):
    """Without --ple-table vLLM would pin the whole 95.4 GiB table: refused in one line that says how
    to make the file, before anything is checked, rendered, written or started."""
    cache, started = serve_state
    result = CliRunner().invoke(cli, ["serve", "--profile", "3x3090", "--model", "/srv/snap", *extra])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "--ple-table" in result.output and "flashnext ple build --src /srv/snap --out FILE" in result.output
    assert not cache.exists() and started == []


def test_serve_stops_on_the_preflights_no_go_before_anything_starts(serve_state, demo_snapshot, demo_table,
                                                                    monkeypatch, tmp_path):
    from flashnext.serving import preflight as pf

    cache, started = serve_state
    (tmp_path / "bin").mkdir()
    DOCKER.write(tmp_path / "bin", tmp_path / "calls.log")  # the docker engine's Compose is found
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    gib = 2**30
    one_gpu = [pf.GpuInfo(0, "NVIDIA GeForce RTX 3090", 24 * gib, 24 * gib)]
    monkeypatch.setattr(pf, "nvml_devices", lambda: one_gpu)  # what NVML answers on a 1-GPU host
    for engine in ("native", "docker"):
        result = CliRunner().invoke(cli, ["serve", "--profile", "3x3090", "--model", str(demo_snapshot),
                                          "--ple-table", str(demo_table), "--engine", engine])
        assert result.exit_code == pf.NoGoCode.GPU, result.output
        assert "[FAIL] gpus" in result.stderr and "NO-GO (exit 10)" in result.stderr
        assert not cache.exists() and started == []
    # found, then asked by the preflight for the image; never started
    assert [c.split()[:3] for c in (tmp_path / "calls.log").read_text().splitlines()] == [
        ["docker", "compose", "version"], ["docker", "image", "inspect"]]
    # --no-check starts it anyway (the engine's own errors are then the user's to read)
    result = CliRunner().invoke(cli, ["serve", "--profile", "3x3090", "--model", str(demo_snapshot),
                                      "--ple-table", str(demo_table), "--engine", "native", "--no-check"])
    assert result.exit_code == 0, result.output
    [(cmd, env)] = started
    assert cmd[:3] == ["vllm", "serve", str(demo_snapshot)] and env["VLLM_PLE_MMAP_PATH"] == str(demo_table)


def test_serve_starts_after_a_go(serve_state, demo_snapshot, demo_table, monkeypatch):
    """The verdict alone decides: a GO (every finding ok, supplied: no GPUs here) lets the engine start."""
    from flashnext.serving import preflight as pf

    _, started = serve_state
    monkeypatch.setattr(pf, "preflight", lambda *a, **k: [pf.Finding("gpus", True, "3 x RTX 3090 (supplied)")])
    result = CliRunner().invoke(cli, ["serve", "--profile", "3x3090", "--model", str(demo_snapshot),
                                      "--ple-table", str(demo_table), "--engine", "native"])
    assert result.exit_code == 0, result.output
    assert "GO" in result.stderr and len(started) == 1


def test_dry_run_needs_no_gpu_and_the_container_does_not_check_again(serve_state, monkeypatch, inputs):
    from flashnext.serving import preflight as pf

    def no_nvml():
        raise AssertionError("--dry-run must not run the preflight")

    monkeypatch.setattr(pf, "nvml_devices", no_nvml)
    monkeypatch.setattr(pf, "nvidia_smi_devices", no_nvml)
    snap, _, table = inputs
    result = CliRunner().invoke(cli, ["serve", "--profile", "3x3090", "--model", str(snap),
                                      "--ple-table", str(table), "--dry-run"])
    assert result.exit_code == 0, result.output
    command = yaml.safe_load(result.stdout)["services"]["vllm"]["command"]
    assert "--no-check" in command  # the host's serve ran the preflight before it started the container
    both = CliRunner().invoke(cli, ["serve", "--profile", "3x3090", "--model", "/srv/snap", "--ple-table",
                                    "/srv/ple.bin", "--check", "--no-check"])
    assert both.exit_code == 2 and "contradict" in both.output  # a usage error


# --- issue 41: --dry-run renders only what can start ---------------------------------------------

@pytest.mark.parametrize("engine", ["docker", "native"])
@pytest.mark.parametrize("missing", ["--model", "--overlay", "--ple-table"])
def test_dry_run_refuses_a_path_that_is_not_here(serve_state, inputs, tmp_path, engine, missing):
    """Before issue 41 a missing --model became a bind mount (Compose then mounts nothing, or fails)
    and the native command named it for vLLM, with exit 0."""
    snap, overlay, table = inputs
    given = {"--model": snap, "--overlay": overlay, "--ple-table": table, missing: tmp_path / "not-here"}
    argv = ["serve", "--profile", "3x3090", *(x for kv in given.items() for x in map(str, kv)), "--dry-run",
            "--engine", engine]
    result = CliRunner().invoke(cli, argv)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and result.stdout == "", result.output
    assert lines[0] == f"Error: {missing} {tmp_path / 'not-here'} does not exist on this host"


def test_native_dry_run_names_absolute_paths_and_the_view_it_will_serve(serve_state, demo_snapshot, demo_overlay,
                                                                       tmp_path, monkeypatch):
    """Before issue 41: a placeholder model ("<view of the snapshot with the overlays>") and the
    VLLM_PLE_MMAP_PATH as given (relative), which vLLM reads from its own working directory."""
    cache, started = serve_state
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "table.bin").write_bytes(b"")
    monkeypatch.chdir(tmp_path / "work")
    argv = ["serve", "--profile", "3x3090-mtp", "--model", str(demo_snapshot), "--overlay", str(demo_overlay),
            "--ple-table", "table.bin", "--engine", "native"]
    dry = CliRunner().invoke(cli, [*argv, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    shown = json.loads(dry.stdout)
    model = shown["command"][2]
    assert Path(model).is_absolute() and not Path(model).exists() and "<" not in model
    assert shown["env"]["VLLM_PLE_MMAP_PATH"] == str(tmp_path / "work" / "table.bin")
    assert shown["view"] == {"path": model, "base": str(demo_snapshot), "overlays": [str(demo_overlay)]}
    assert started == []
    ran = CliRunner().invoke(cli, [*argv, "--no-check"])
    assert ran.exit_code == 0, ran.output
    [(cmd, env)] = started
    assert cmd == shown["command"] and env == shown["env"]  # what --dry-run said is what starts
    assert (Path(model) / "config.json").is_file()  # the view, made where it said
    again = CliRunner().invoke(cli, [*argv, "--no-check"])  # a second start replaces the view it made
    assert again.exit_code == 0, again.output
    assert started[1][0] == cmd


def test_serve_says_only_which_of_profile_and_model_is_missing(inputs):
    snap, _, _ = inputs
    for argv, words in ((["--profile", "3x3090"], "serve needs --model (see"),
                        (["--model", str(snap)], "serve needs --profile (see"),
                        ([], "serve needs --profile and --model (see")):
        result = CliRunner().invoke(cli, ["serve", *argv])
        assert result.exit_code == 2 and words in result.output, result.output


# --- serve finds its Compose up front, and records a start only once it succeeded ----------------

@dataclasses.dataclass(frozen=True)
class StandIn:
    """An executable the test writes in place of docker, docker-compose or podman (none of them can
    run here): it logs each call and answers as the real one would, with or without Compose."""
    program: str
    has_compose: bool = True  # `docker compose version` (docker-compose: `version`) answers
    up_fails: bool = False
    image_built: bool = True  # `image inspect` finds the patched image

    def write(self, bin_dir: Path, log: Path) -> None:
        version = "version" if self.program == "docker-compose" else "compose version"
        no_plugin = "" if self.has_compose else \
            f"""  "compose "*) echo "{self.program}: 'compose' is not a {self.program} command." >&2; exit 1 ;;\n"""
        script = (f"#!/bin/sh\necho \"{self.program} $*\" >> '{log}'\ncase \"$*\" in\n{no_plugin}"
                  f"  \"{version}\") exit 0 ;;\n"
                  f"  \"image inspect \"*) exit {0 if self.image_built else 1} ;;\n"
                  f"  *\" up -d\") exit {1 if self.up_fails else 0} ;;\nesac\nexit 0\n")
        (bin_dir / self.program).write_text(script)
        (bin_dir / self.program).chmod(0o755)


DOCKER, DOCKER_NO_PLUGIN = StandIn("docker"), StandIn("docker", has_compose=False)
DOCKER_COMPOSE, PODMAN = StandIn("docker-compose"), StandIn("podman")


@dataclasses.dataclass(frozen=True)
class ComposeCase:
    id: str
    installed: tuple[StandIn, ...]
    uses: str | None  # the Compose serve must start with; None: refused before the preflight
    engine: str | None = None  # --engine
    refusal: str = ""
    builds: bool = False  # Compose builds the image first: none found, or no engine CLI to ask

    @property
    def engine_of_start(self) -> str:
        return "podman" if self.uses and self.uses.startswith("podman") else "docker"


COMPOSE_CASES = [
    ComposeCase("none-installed", (), None, refusal="install Docker's Compose plugin"),
    ComposeCase("docker-without-the-compose-plugin", (DOCKER_NO_PLUGIN,), None,
                refusal="tried `docker compose version`, `docker-compose version`, `podman compose version`"),
    ComposeCase("docker-compose-plugin", (DOCKER,), "docker compose"),
    ComposeCase("docker-compose-plugin-builds-the-image", (StandIn("docker", image_built=False),), "docker compose",
                builds=True),
    ComposeCase("docker-compose-standalone", (DOCKER_NO_PLUGIN, DOCKER_COMPOSE), "docker-compose"),
    ComposeCase("docker-compose-standalone-without-the-docker-cli", (DOCKER_COMPOSE,), "docker-compose",
                builds=True),
    ComposeCase("podman-only", (PODMAN,), "podman compose"),
    ComposeCase("docker-before-podman", (DOCKER, PODMAN), "docker compose"),
    ComposeCase("engine-podman-beside-docker", (DOCKER, PODMAN), "podman compose", engine="podman"),
    ComposeCase("engine-docker-with-podman-only", (PODMAN,), None, engine="docker",
                refusal="or use --engine podman or --engine native"),
    ComposeCase("up-fails", (StandIn("docker", up_fails=True),), "docker compose", refusal="up -d` failed"),
]


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """A PATH of nothing but the stand-ins a case installs; the preflight (logged, GO) and readiness
    supplied; the state folder under tmp_path."""
    from flashnext.serving import preflight as pf
    from flashnext.serving import run

    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def preflight(deployment, engine, devices=None):
        with log.open("a") as f:
            f.write(f"preflight {engine}\n")
        return [pf.Finding("gpus", True, "3 x RTX 3090 (supplied)")]

    monkeypatch.setattr(pf, "preflight", preflight)
    monkeypatch.setattr(run, "wait_ready", lambda *a, **k: {"data": [{"id": "flash-next"}]})
    model, table = tmp_path / "snap", tmp_path / "table.bin"
    model.mkdir()
    table.write_bytes(b"")

    def install(case: ComposeCase) -> None:
        for stand_in in case.installed:
            stand_in.write(bin_dir, log)

    def calls() -> list[str]:
        return log.read_text().splitlines() if log.exists() else []

    return install, calls, model, table, tmp_path / "cache"


@pytest.mark.parametrize("case", COMPOSE_CASES, ids=lambda c: c.id)
def test_serve_finds_compose_up_front_and_records_only_a_start(case: ComposeCase, stand_ins):
    install, calls, model, table, cache = stand_ins
    install(case)
    argv = ["serve", "--profile", "3x3090", "--model", str(model), "--ple-table", str(table),
            *(["--engine", case.engine] if case.engine else [])]
    result = CliRunner().invoke(cli, argv)
    state = cache / "flashnext" / "serve" / "3x3090" / "compose.yaml"
    if case.uses is None:
        # one line, exit 1, before the preflight and before anything is written
        lines = result.output.strip().splitlines()
        assert result.exit_code == 1 and len(lines) == 1, result.output
        assert lines[0].startswith("Error: no Compose found") and case.refusal in lines[0], lines[0]
        assert all(c.endswith(" version") for c in calls()) and not cache.exists()
        return
    tmp = f"{state.parent}/.compose.yaml.tmp-{os.getpid()}"
    started = [c for c in calls() if not c.endswith(" version") and " image inspect " not in c]
    build = [f"{case.uses} -f {tmp} build"] if case.builds else []
    assert started == [f"preflight {case.engine_of_start}", *build, f"{case.uses} -f {tmp} up -d"]
    down = CliRunner().invoke(cli, ["serve", "down", "--profile", "3x3090",
                                    *(["--engine", case.engine] if case.engine else [])])
    if case.refusal:  # the start failed: nothing recorded, nothing left, and down says so
        assert result.exit_code == 1 and case.refusal in result.output, result.output
        assert not cache.exists()
        assert down.exit_code == 1 and "nothing is running for profile '3x3090'" in down.output, down.output
        return
    assert result.exit_code == 0, result.output
    req = Deployment(load_profile("3x3090"), model, (), table)
    assert state.read_text() == yaml.safe_dump(render_compose(req), sort_keys=False, width=120)
    assert os.listdir(state.parent) == ["compose.yaml"]
    assert f"serve down --profile 3x3090 --engine {case.engine_of_start}" in result.stdout
    assert down.exit_code == 0, down.output
    assert calls()[-1] == f"{case.uses} -f {state} down"


def test_find_compose_takes_its_path(tmp_path):
    """The library's own lookup, on a path given rather than PATH."""
    from flashnext.serving.run import find_compose

    log = tmp_path / "calls.log"
    DOCKER_NO_PLUGIN.write(tmp_path, log)
    DOCKER_COMPOSE.write(tmp_path, log)
    assert find_compose(path=str(tmp_path)) == [str(tmp_path / "docker-compose")]
    with pytest.raises(FlashnextError, match="install a Compose provider for podman"):
        find_compose("podman", path=str(tmp_path))


def test_a_native_vllm_does_not_inherit_what_the_planner_set(monkeypatch):
    """The planner imports vLLM with VLLM_TARGET_DEVICE=cpu (any machine can plan for another); the
    vLLM that `serve --engine native` then starts from the same process inherited it and would have
    served on the CPU. A value the user set is theirs, and passed on."""
    from flashnext.serving import run
    from flashnext.serving.capacity import shape

    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    monkeypatch.setattr(shape, "PLANNING_ENV", {})
    shape.import_vllm()
    assert os.environ["VLLM_TARGET_DEVICE"] == "cpu" and os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    started = {}
    monkeypatch.setattr(run.os, "execvpe", lambda file, args, env: started.update(env))
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")
    run.exec_native(["vllm", "serve", "x"], {"VLLM_PLE_MMAP_PATH": "/t.bin"})
    assert "VLLM_TARGET_DEVICE" not in started and started["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert started["VLLM_PLE_MMAP_PATH"] == "/t.bin"
