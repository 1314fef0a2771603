"""Issue 43: one Deployment flows through serving, resolved once. A `serve` reads each config.json
once, loads its profile once and plans once, however many stages (the PLE-table rule, the compose
file, the preflight, the plan line) ask."""

import builtins
import io
import os
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashnext.serving import profiles
from flashnext.serving.capacity import qwen4_exp
from flashnext.serving.deployment import Deployment, resolve_deployment
from flashnext.tools.cli import main as cli


@pytest.fixture
def reads(monkeypatch):
    """What a command reads while it runs: the opens of each config.json (by ``open`` or ``os.open``,
    whichever reader opens it), the profile files read and the plans computed."""
    counts: Counter = Counter()
    real_open, real_os_open = builtins.open, os.open

    def note(path) -> None:
        if not isinstance(path, int) and os.path.basename(os.fsdecode(path)) == "config.json":
            counts[os.path.abspath(os.fsdecode(path))] += 1

    def open_(file, *a, **kw):
        note(file)
        return real_open(file, *a, **kw)

    def os_open(path, *a, **kw):
        note(path)
        return real_os_open(path, *a, **kw)

    def counted(key, fn):
        def wrapper(*a, **kw):
            counts[key] += 1
            return fn(*a, **kw)
        return wrapper

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(profiles, "_read_profile", counted("profile loads", profiles._read_profile))
    monkeypatch.setattr(qwen4_exp, "plan", counted("plans", qwen4_exp.plan))
    return counts


def config_of(folder: Path) -> str:
    return os.path.abspath(folder / "config.json")


@pytest.fixture
def table(tmp_path) -> Path:
    path = tmp_path / "ple.bin"  # serve checks that it is there; the preflight finds it is no table
    path.write_bytes(b"")
    return path


def serve(*argv: str):
    result = CliRunner().invoke(cli, ["serve", "--profile", "3x3090", *argv])
    return result


def test_serve_dry_run_reads_config_once_and_loads_the_profile_once(reads, demo_snapshot, table):
    result = serve("--model", str(demo_snapshot), "--ple-table", str(table), "--dry-run")
    assert result.exit_code == 0, result.output
    assert reads == {config_of(demo_snapshot): 1, "profile loads": 1}  # --dry-run prints no plan: none made


def test_serve_dry_run_with_an_overlay_reads_the_served_config_only(reads, demo_snapshot, demo_overlay, table):
    result = serve("--model", str(demo_snapshot), "--overlay", str(demo_overlay), "--ple-table", str(table),
                   "--dry-run")
    assert result.exit_code == 0, result.output
    assert reads == {config_of(demo_overlay): 1, "profile loads": 1}


def test_serve_plans_once_and_the_preflight_reads_nothing_again(reads, demo_snapshot, table, monkeypatch):
    """`serve` to its start: the preflight's verdict (a NO-GO on a machine without the profile's
    GPUs), and on a GO the plan line and the start, stood in for here."""
    from flashnext.tools import serve as serve_command

    monkeypatch.setattr(serve_command, "exec_native", lambda cmd, env: None)
    result = serve("--model", str(demo_snapshot), "--ple-table", str(table), "--engine", "native")
    assert "host-ram" in result.output, result.output
    assert reads == {config_of(demo_snapshot): 1, "profile loads": 1, "plans": 1}, result.output


def test_doctor_reads_config_once(reads, demo_snapshot, demo_table):
    result = CliRunner().invoke(cli, ["doctor", "--profile", "3x3090", "--model", str(demo_snapshot),
                                      "--ple-table", str(demo_table), "--engine", "native"])
    assert "ple-table" in result.output, result.output
    assert reads == {config_of(demo_snapshot): 1, "profile loads": 1, "plans": 1}, result.output


def test_plan_reads_config_once(reads, demo_snapshot):
    result = CliRunner().invoke(cli, ["plan", "--profile", "3x3090", "--model", str(demo_snapshot), "--json"])
    assert result.exit_code == 0, result.output
    assert reads == {config_of(demo_snapshot): 1, "profile loads": 1, "plans": 1}


def test_the_count_sees_a_second_reader(reads, demo_snapshot, table, monkeypatch):
    """The counts above would catch a stage that read config.json again, by any reader."""
    from flashnext.serving.capacity.model import load_text_config
    from flashnext.tools import serve as serve_command

    def require_ple_table_and_read_again(deployment):
        load_text_config(deployment.model)  # a stage reading the model itself, not through the Deployment
        return require_ple_table(deployment)

    require_ple_table = serve_command.require_ple_table
    monkeypatch.setattr(serve_command, "require_ple_table", require_ple_table_and_read_again)
    result = serve("--model", str(demo_snapshot), "--ple-table", str(table), "--dry-run")
    assert result.exit_code == 0, result.output
    assert reads[config_of(demo_snapshot)] == 2


def test_a_deployment_reads_and_plans_once_however_often_asked(reads, demo_snapshot):
    deployment = resolve_deployment("3x3090", demo_snapshot)
    for _ in range(3):
        deployment.plan, deployment.ple_format, deployment.served_config, deployment.shape
    assert reads == {config_of(demo_snapshot): 1, "profile loads": 1, "plans": 1}


def test_a_deployment_without_a_model_plans_the_pinned_checkpoint():
    from flashnext.serving import capacity
    from flashnext.serving.profiles import load_profile

    profile = load_profile("3x3090")
    deployment = Deployment(profile)
    assert deployment.served_config is None and deployment.ple_format is None
    assert deployment.plan.to_json() == capacity.plan_profile(profile).to_json()


def test_the_host_terms_size_the_pinned_table_from_the_deployments_snapshot(reads, demo_snapshot, tmp_path):
    """Without --ple-table the table is pinned, sized from the snapshot's shards: the snapshot the
    Deployment opened with the config.json it read, not a second opening."""
    from flashnext.serving import preflight as pf

    deployment = resolve_deployment("3x3090", demo_snapshot)
    finding = pf.check_host_ram(deployment, memory_max=tmp_path / "absent")
    assert finding.terms and "PLE table" in finding.terms, finding
    assert reads == {config_of(demo_snapshot): 1, "profile loads": 1, "plans": 1}
