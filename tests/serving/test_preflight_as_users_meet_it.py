"""Issue 41: the preflight as a new user meets it. The base install finds NVIDIA GPUs without vLLM
(NVML through nvidia-ml-py, else ``nvidia-smi``); a container's locked-memory limit is the one its
compose file gives it, not this shell's; and each fix it prints can be followed as written."""

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashnext.serving import preflight as pf
from flashnext.serving.deployment import Deployment
from flashnext.serving.profiles import load_profile
from flashnext.tools.cli import main as cli

MIB = 2**20

# What `nvidia-smi --query-gpu=index,name,memory.total,memory.free --format=csv,noheader,nounits`
# prints on a rig of three 3090s (memory in MiB), and nothing for any other question.
FAKE_NVIDIA_SMI = """#!/bin/sh
[ "$1" = "--query-gpu=index,name,memory.total,memory.free" ] && [ "$2" = "--format=csv,noheader,nounits" ] || exit 9
echo "0, NVIDIA GeForce RTX 3090, 24576, 24250"
echo "1, NVIDIA GeForce RTX 3090, 24576, 24250"
echo "2, NVIDIA GeForce RTX 3090, 24576, 1024"
"""


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_NVIDIA_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return smi


@pytest.fixture
def no_pynvml(monkeypatch):
    """``import pynvml`` fails, as where the bindings are not installed."""
    monkeypatch.setitem(sys.modules, "pynvml", None)


# --- GPUs: NVML, else nvidia-smi ---------------------------------------------------------------------

def test_pynvml_is_a_base_dependency():
    """The base install declares the NVML bindings: vLLM, which brought them before, is an extra."""
    import tomllib

    from support import ROOT

    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("nvidia-ml-py") for d in base), base


def test_without_nvml_the_gpus_come_from_nvidia_smi(fake_nvidia_smi, no_pynvml):
    assert pf.nvml_devices() is None
    gpus = pf.visible_gpus()
    assert gpus == [pf.GpuInfo(0, "NVIDIA GeForce RTX 3090", 24576 * MIB, 24250 * MIB),
                    pf.GpuInfo(1, "NVIDIA GeForce RTX 3090", 24576 * MIB, 24250 * MIB),
                    pf.GpuInfo(2, "NVIDIA GeForce RTX 3090", 24576 * MIB, 1024 * MIB)]


def test_doctor_on_the_base_install_sees_the_rigs_gpus(fake_nvidia_smi, no_pynvml):
    """Before issue 41: "0 GPU(s) visible, the profile needs 3", exit 10, on a rig with three 3090s."""
    done = CliRunner().invoke(cli, ["doctor", "--profile", "3x3090", "--engine", "native", "--json"])
    gpus = json.loads(done.stdout)["findings"][0]
    assert gpus["check"] == "gpus" and "NVIDIA GeForce RTX 3090" in gpus["detail"], gpus
    assert "0 GPU(s) visible" not in gpus["detail"], gpus


def test_a_missing_or_failing_nvidia_smi_is_no_gpus(tmp_path, monkeypatch, no_pynvml):
    monkeypatch.setenv("PATH", str(tmp_path))  # none on PATH
    assert pf.visible_gpus() == []
    failing = tmp_path / "nvidia-smi"
    failing.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver'\n"
                       "exit 9\n")
    failing.chmod(0o755)
    assert pf.visible_gpus() == []


def test_nvml_answers_first(fake_nvidia_smi, monkeypatch):
    """Where NVML loads, its answer stands (none, here) and nvidia-smi is not asked."""
    monkeypatch.setattr(pf, "nvml_devices", lambda: [])
    assert pf.visible_gpus() == []


# --- memlock: what the container gets ----------------------------------------------------------------

@pytest.fixture
def small_memlock():
    """This shell's `ulimit -l` at the usual 8 MiB default."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (min(8 << 20, hard), hard))
    yield hard
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def test_a_container_gets_the_compose_files_memlock_not_this_shells(small_memlock):
    """Before issue 41: NO-GO (exit 11) for Docker with three healthy 3090s and an 8 MiB `ulimit -l`."""
    from flashnext.serving.compose import compose_model

    profile = load_profile("3x3090")
    rendered = compose_model(Deployment(profile, Path("/srv/snap")))
    assert rendered["services"]["vllm"]["ulimits"] == {"memlock": {"soft": -1, "hard": -1}}
    docker = pf.check_memlock(profile, "docker")
    assert docker.ok and "compose file" in docker.detail and "unlimited" in docker.detail, docker
    native = pf.check_memlock(profile, "native")
    assert not native.ok and native.exit == pf.NoGoCode.MEMORY and "ulimit -l unlimited" in native.fix


def test_rootless_podman_is_held_to_this_users_hard_limit(small_memlock, monkeypatch):
    profile = load_profile("3x3090")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (8 << 20, 8 << 20))
    rootless = pf.check_memlock(profile, "podman")
    assert not rootless.ok and "rootless podman" in rootless.detail and "limits.conf" in rootless.fix
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert pf.check_memlock(profile, "podman").ok


def test_the_preflight_judges_memlock_by_the_engine(small_memlock, monkeypatch):
    monkeypatch.setattr(pf, "check_process_madvise", lambda: pf.Finding("ptrace", True, "supplied"))
    monkeypatch.setattr(pf, "check_host_ram", lambda *a, **k: pf.Finding("host-ram", True, "supplied"))
    monkeypatch.setattr(pf, "check_image", lambda *a: pf.Finding("image", True, "supplied"))
    for engine, ok in (("docker", True), ("podman", True), ("native", False)):
        if engine == "podman":
            monkeypatch.setattr(os, "geteuid", lambda: 0)
        findings = {f.check: f for f in pf.preflight(Deployment(load_profile("3x3090")), engine, devices=[])}
        assert findings["memlock"].ok is ok, (engine, findings["memlock"])


# --- each fix can be followed as written ---------------------------------------------------------------

def test_a_table_flashnext_did_not_make_is_not_rebuilt_over(demo_snapshot, tmp_path):
    """`ple build --force` replaces only a table it made: for a file without a sidecar the fix names a
    new path (before issue 41 it said `--out big.bin --force`, which then failed)."""
    big = tmp_path / "big.bin"
    big.write_bytes(b"\0" * (8 << 20))
    finding = pf.check_ple_table(Deployment(load_profile("3x3090"), demo_snapshot, ple_table=big))
    assert not finding.ok and "--force" not in finding.fix.split("(")[0] and "NEW.bin" in finding.fix, finding.fix
    followed = subprocess.run([sys.executable, "-m", "flashnext", "ple", "build", "--src", str(demo_snapshot),
                               "--out", str(tmp_path / "NEW.bin"), "--no-progress"], capture_output=True, text=True)
    assert followed.returncode == 0, followed.stderr
    missing = pf.check_ple_table(Deployment(load_profile("3x3090"), demo_snapshot, ple_table=tmp_path / "absent.bin"))
    assert missing.fix == f"flashnext ple build --src {demo_snapshot} --out {tmp_path / 'absent.bin'}"


def test_a_table_under_the_drive_checks_minimum_is_a_warning_that_says_so(demo_table):
    """The demo's 528 KiB table: before issue 41 a blocking failure with "check the path given to
    --ple-table", though the path was right and nothing the demo makes reaches 4 MiB."""
    finding = pf.check_ple_drive(demo_table)
    assert not finding.ok and not finding.blocking and finding.exit == pf.NoGoCode.PLE
    assert "4.00 MiB" in finding.detail and "check the path" not in finding.fix, finding


def test_a_plan_that_fails_for_the_models_layers_points_at_that_models_plan(demo_snapshot):
    """The demo's 4 layers do not split as 3x3090-mtp splits 48: the fix names --model (before
    issue 41 it pointed at `plan --profile 3x3090-mtp`, which plans the real model and succeeds)."""
    pytest.importorskip("vllm")
    finding = pf.check_host_ram(Deployment(load_profile("3x3090-mtp"), demo_snapshot))
    assert not finding.ok and "does not split 4 layers" in finding.detail, finding
    assert f"--model {demo_snapshot}" in finding.fix and "made for the base checkpoint" in finding.fix


def test_without_vllm_the_host_ram_fix_is_the_install(monkeypatch):
    from flashnext.errors import FlashnextError
    from flashnext.serving import capacity, vllm_release

    def no_vllm(*a, **k):
        raise FlashnextError(f"planning asks vLLM for its KV cache rules: {vllm_release.support_line(None)}")

    monkeypatch.setattr(capacity, "plan_profile", no_vllm)
    monkeypatch.setattr(vllm_release, "installed_version", lambda: None)
    finding = pf.check_host_ram(Deployment(load_profile("3x3090")))
    assert not finding.ok and not finding.blocking and vllm_release.INSTALL in finding.fix
