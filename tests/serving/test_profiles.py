"""The profile loader as a trust boundary (issue 42, item 3): what a profile gets unasked, what
`serve --grant` adds and how it reaches the container's own serve, vLLM's parser at the boundary,
and the rules' table in docs/serving.md, generated from the loader's constants. The hostile rows
are tests/hostile/test_hostile_profiles.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from flashnext.errors import FlashnextError
from flashnext.serving import profiles, vllm_release
from flashnext.serving.compose import compose_model
from flashnext.serving.deployment import Deployment
from flashnext.serving.patches.series import VLLM_VERSION
from flashnext.serving.profiles import available, capabilities_to_grant, capability, load_profile
from flashnext.tools.cli import main as cli
from support import ROOT

SHIPPED = json.loads((ROOT / "serving" / "profiles" / "3x3090.json").read_text())
VLLM_RELEASE_HERE = vllm_release.supported(vllm_release.installed_version())


def profile_file(tmp_path: Path, name: str = "rig", **container) -> Path:
    """The shipped 3x3090 profile as the file ``name``.json, its container settings changed by ``container``."""
    data = json.loads(json.dumps(SHIPPED))
    data["name"] = name
    data["container"].update(container)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def inputs(tmp_path) -> tuple[Path, Path]:
    snap, table = tmp_path / "snap", tmp_path / "ple.bin"
    snap.mkdir()
    table.write_bytes(b"")
    return snap, table


@pytest.mark.parametrize("name", available())
def test_every_shipped_profile_passes_the_boundary_without_a_grant(name):
    profile = load_profile(name)
    assert capabilities_to_grant(profile) == []
    assert set(profile.container.cap_add) <= profiles.CAPABILITIES_WITHOUT_GRANT
    assert profile.container.ipc in profiles.IPC_MODES
    assert len((ROOT / "serving" / "profiles" / f"{name}.json").read_bytes()) * 10 < profiles.MAX_PROFILE_BYTES


@pytest.mark.skipif(not VLLM_RELEASE_HERE, reason="vLLM 0.34.0 is installed by .ci/run")
@pytest.mark.parametrize("name", available())
def test_every_shipped_profile_passes_vllms_own_parser(name):
    """What load_profile leaves out for flashnext's own profiles (profiles.shipped), checked here."""
    profile = load_profile(name)
    assert profiles.shipped(profile)
    profiles._parse_with_vllm(profile)


def test_a_profile_file_is_read_by_vllms_parser_and_a_shipped_one_is_not(tmp_path, monkeypatch):
    parsed = []
    monkeypatch.setattr(profiles, "_parse_with_vllm", parsed.append)
    load_profile("3x3090")
    assert parsed == []
    copy = profile_file(tmp_path, name="3x3090")
    assert not profiles.shipped(load_profile(str(copy)))
    assert [p.path for p in parsed] == [copy]


@pytest.mark.parametrize("given", ["SYS_ADMIN", "CAP_SYS_ADMIN", "sys_admin", "cap_sys_admin"])
def test_a_grant_is_named_as_docker_names_the_capability(given):
    assert capability(given) == "SYS_ADMIN"


@pytest.mark.parametrize("given", ["", "SYS ADMIN", "CAP_", "$(id)", "SYS_ADMIN\n", "9LIVES"])
def test_a_grant_that_names_no_capability_is_a_usage_error(given, inputs, tmp_path):
    snap, table = inputs
    result = CliRunner().invoke(cli, ["serve", "--profile", "3x3090", "--model", str(snap), "--ple-table",
                                      str(table), "--grant", given, "--dry-run"])
    assert result.exit_code == 2 and "is not a capability" in result.output, result.output
    assert result.stdout == ""


def test_a_capability_beyond_the_allow_list_needs_its_own_grant(tmp_path):
    path = profile_file(tmp_path, cap_add={"SYS_PTRACE": "prefetch", "SYS_ADMIN": "mounts", "NET_ADMIN": "routes"})
    with pytest.raises(FlashnextError, match=r"asks for NET_ADMIN, SYS_ADMIN, .*grant NET_ADMIN grant SYS_ADMIN"):
        load_profile(str(path))
    with pytest.raises(FlashnextError, match=r"asks for NET_ADMIN, which .*grant NET_ADMIN\)"):
        load_profile(str(path), grants=("SYS_ADMIN",))  # one grant is not the other
    profile = load_profile(str(path), grants=("SYS_ADMIN", "NET_ADMIN"))
    assert capabilities_to_grant(profile) == ["NET_ADMIN", "SYS_ADMIN"]


def test_what_a_profile_gets_unasked_needs_no_grant(tmp_path):
    assert load_profile(str(profile_file(tmp_path, cap_add={"SYS_PTRACE": "prefetch"}))).container.cap_add


def test_no_grant_opens_another_containers_ipc_namespace(tmp_path):
    for ipc in ("container:victim", "service:db", "shareable"):
        path = profile_file(tmp_path, name=f"ipc-{ipc.partition(':')[0]}", ipc=ipc)
        with pytest.raises(FlashnextError, match="container.ipc: Input should be 'host' or 'private'"):
            load_profile(str(path), grants=("ALL",))


def test_serve_grants_what_it_is_told_and_the_container_is_told_the_same(tmp_path, inputs):
    snap, table = inputs
    path = profile_file(tmp_path, cap_add={"SYS_PTRACE": "prefetch", "SYS_ADMIN": "mounts"})
    argv = ["serve", "--profile", str(path), "--model", str(snap), "--ple-table", str(table), "--dry-run"]
    refused = CliRunner().invoke(cli, argv)
    assert refused.exit_code == 1 and "--grant SYS_ADMIN" in refused.output and refused.stdout == ""
    granted = CliRunner().invoke(cli, [*argv, "--grant", "CAP_SYS_ADMIN"])
    assert granted.exit_code == 0, granted.output
    service = yaml.safe_load(granted.stdout)["services"]["vllm"]
    assert service["cap_add"] == ["SYS_ADMIN", "SYS_PTRACE"]
    # the serve inside the container loads the profile again, with the same grant and no other
    command = service["command"]
    assert [command[i + 1] for i, word in enumerate(command) if word == "--grant"] == ["SYS_ADMIN"]


def test_a_shipped_profiles_container_is_told_no_grant():
    req = Deployment(load_profile("3x3090"), Path("/srv/snap"), (), Path("/srv/ple.bin"))
    assert "--grant" not in compose_model(req)["services"]["vllm"]["command"]


def test_down_and_logs_read_only_the_name(tmp_path, monkeypatch):
    """Stopping what serve started grants nothing: no --grant is asked for it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = profile_file(tmp_path, cap_add={"SYS_ADMIN": "mounts"})
    result = CliRunner().invoke(cli, ["serve", "down", "--profile", str(path), "--engine", "docker"])
    assert result.exit_code == 1 and "nothing is running for profile 'rig'" in result.output, result.output


def test_without_vllm_the_records_rules_stand_alone(tmp_path, monkeypatch):
    """A base install (the Docker host's side) has no vLLM: an option only vLLM's parser knows to be
    wrong passes, and what flashnext keeps for itself is still refused."""
    monkeypatch.setattr(vllm_release, "installed_version", lambda: None)
    data = json.loads(json.dumps(SHIPPED))
    data.update(name="rig", vllm_args=[*SHIPPED["vllm_args"], "--no-such-option"])
    (tmp_path / "rig.json").write_text(json.dumps(data))
    assert load_profile(str(tmp_path / "rig.json")).vllm_args[-1] == "--no-such-option"
    data["vllm_args"] += ["--port", "80"]
    (tmp_path / "rig.json").write_text(json.dumps(data))
    with pytest.raises(FlashnextError, match="--port is set by flashnext"):
        load_profile(str(tmp_path / "rig.json"))


@pytest.mark.skipif(not VLLM_RELEASE_HERE, reason="vLLM 0.34.0 is installed by .ci/run")
@pytest.mark.parametrize("args, refusal", [
    (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["--max-model-len", "lots"], "argument --max-model-len: invalid"),
    (["another/model"], "unrecognized arguments: another/model"),
    (["--help"], "it stops at them"),
])
def test_vllms_own_parser_reads_the_command_flashnext_runs(args, refusal, tmp_path):
    data = json.loads(json.dumps(SHIPPED))
    data.update(name="rig", vllm_args=[*SHIPPED["vllm_args"], *args])
    (tmp_path / "rig.json").write_text(json.dumps(data))
    with pytest.raises(FlashnextError, match=f"vllm_args: vLLM {VLLM_VERSION}'s parser refuses them: {re.escape(refusal)}"):
        load_profile(str(tmp_path / "rig.json"))


@pytest.mark.parametrize("arg", ["--host", "--host=0.0.0.0", "--ho", "--host.x", "--po", "--ud", "--model=x",
                                 "--config", "--conf=x.yaml"])
def test_what_flashnext_sets_itself_is_refused_however_it_is_spelled(arg):
    with pytest.raises(ValueError, match="is set by flashnext|names a file of further arguments"):
        profiles._vllm_args(["--max-model-len", "4096", arg, "x"])


def test_the_rest_of_vllms_options_pass_the_records_rule():
    args = ["--model-impl", "vllm", "--port-range", "1", "--hf-config-path", "x", "-O3", "--served-model-name", "m"]
    assert profiles._vllm_args(args) == args


# --- the rules' table in docs/serving.md, generated from the loader's constants ---------------------

def rules_table() -> str:
    p = profiles
    rows = [
        ("the file", f"a regular file of at most {p.MAX_PROFILE_BYTES:,} bytes, strict JSON, every key known"),
        ("`name`", f"the file's name without `.json`: {p.PROFILE_NAME_RULE}"),
        ("`gpus`", f"1 to {p.MAX_GPUS}"),
        ("`gpu_memory_gib`", f"optional: each GPU's memory, {p.MIN_GPU_MEMORY_GIB} to {p.MAX_GPU_MEMORY_GIB:,} GiB "
         "(`plan`'s card)"),
        ("`container.port`", f"1 to {p.MAX_PORT}"),
        ("`container.stop_grace_period_s`, `healthcheck.interval_s`, `healthcheck.timeout_s`",
         f"1 to {p.MAX_WAIT_S:,}"),
        ("`healthcheck.start_period_s`", f"1 to {p.MAX_START_PERIOD_S:,} (also how long `serve` waits for readiness)"),
        ("`healthcheck.retries`", f"1 to {p.MAX_RETRIES}"),
        ("`container.shm_size`", f"`{p._anchored(p.SHM_SIZE)}` (`16gb`, `512m`), at most {p.MAX_SHM_BYTES >> 40} TiB"),
        ("`container.ipc`", " or ".join(f"`{mode}`" for mode in p.IPC_MODES)),
        ("`container.cap_add`", f"Docker's names, `{p._anchored(p.CAPABILITY)}`; "
         f"{', '.join(sorted(p.CAPABILITIES_WITHOUT_GRANT))} unasked, any other only with `serve --grant NAME`"),
        ("`env`", f"keys `{p._anchored(p.ENV_NAME)}`, values without NUL or line break"),
        ("`vllm_args`", "no NUL or line break, no `--`; not "
         f"{', '.join(f'`{o}`' for o in (*p.FLASHNEXT_OPTIONS, *p.ARGUMENTS_FILE_OPTIONS))}, however spelled "
         f"(a prefix, `_` for `-`, `--opt.key`); with vLLM {VLLM_VERSION} installed, accepted by its `vllm serve` "
         "parser with flashnext's own options after them (a profile file at each load, flashnext's own in the tests)"),
    ]
    lines = ["| key | rule |", "|---|---|", *(f"| {key} | {rule} |" for key, rule in rows)]
    return "\n".join(lines)


def test_the_docs_table_of_the_rules_is_the_loaders():
    doc = (ROOT / "docs" / "serving.md").read_text()
    shown = re.search(r"<!-- profile rules: .*? -->\n(.*?)\n<!-- /profile rules -->", doc, re.S)
    assert shown is not None, "docs/serving.md has no profile rules table"
    assert shown[1] == rules_table(), "docs/serving.md's profile rules table is stale; it should read:\n" + rules_table()
