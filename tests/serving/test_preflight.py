"""The preflight, on this machine for real; only NVML's answers are supplied (no GPU here)."""

import dataclasses
import json
import resource
import shutil

import pytest
from click.testing import CliRunner

from flashnext.serving import preflight as pf
from flashnext.serving.profiles import load_profile
from flashnext.tools.cli import main as cli

GIB = 2**30
RTX3090 = [pf.GpuInfo(i, "NVIDIA GeForce RTX 3090", 24 * GIB, int(23.9 * GIB)) for i in range(3)]


def test_gpu_findings():
    profile = load_profile("3x3090")
    assert pf.check_gpus(profile, RTX3090).ok
    few = pf.check_gpus(profile, RTX3090[:2])
    assert not few.ok and few.exit == pf.Exit.GPU and "needs 3" in few.detail
    busy = [RTX3090[0], dataclasses.replace(RTX3090[1], free_bytes=20 * GIB), RTX3090[2]]
    finding = pf.check_gpus(profile, busy)
    assert not finding.ok and "GPU 1" in finding.detail and "nvidia-smi" in finding.fix


def test_host_ram_against_the_plan(tmp_path):
    """The 3x3090 profile at 783 MB pins 67.8 GiB exact-size (244 blocks x 12,144 tokens x 2 KiB x 12 layers)."""
    profile = load_profile("3x3090")
    meminfo = tmp_path / "meminfo"
    unlimited = tmp_path / "memory.max"
    unlimited.write_text("max\n")
    meminfo.write_text(f"MemTotal: {125 * GIB // 1024} kB\nMemAvailable: {118 * GIB // 1024} kB\n")
    rig = pf.check_host_ram(profile, meminfo, unlimited)
    assert rig.ok and "67.82 GiB" in rig.detail

    meminfo.write_text(f"MemTotal: {64 * GIB // 1024} kB\nMemAvailable: {60 * GIB // 1024} kB\n")
    small = pf.check_host_ram(profile, meminfo, unlimited)
    assert not small.ok and small.exit == pf.Exit.MEMORY
    # each block pins 12 x 12,144 x 2,048 B = 0.278 GiB: (60 - 4) GiB hold 201 blocks of 3,207,168 B
    assert "lower --kv-cache-memory-bytes to 644,640,768 (201 blocks" in small.fix

    # a cgroup limit below MemAvailable is what counts
    unlimited.write_text(str(40 * GIB))
    meminfo.write_text(f"MemTotal: {125 * GIB // 1024} kB\nMemAvailable: {118 * GIB // 1024} kB\n")
    assert not pf.check_host_ram(profile, meminfo, unlimited).ok


def test_host_ram_counts_pytorch_power_of_two_rounding(tmp_path):
    """Without the exact-size pool each 5.65 GiB layer pool becomes 8 GiB: 96 GiB for 12 layers (seed 000 §2)."""
    profile = load_profile("3x3090")
    off = dataclasses.replace(profile, env={**profile.env, "VLLM_EXACT_HOST_POOL": "0"})
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {125 * GIB // 1024} kB\nMemAvailable: {90 * GIB // 1024} kB\n")
    finding = pf.check_host_ram(off, meminfo, tmp_path / "absent")
    assert not finding.ok and "96.00 GiB" in finding.detail and "67.82 GiB exact" in finding.detail
    assert 'VLLM_EXACT_HOST_POOL: "1"' in finding.fix


def test_memlock_for_real():
    profile = load_profile("3x3090")
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (4 << 20, hard))
        limited = pf.check_memlock(profile)
        assert not limited.ok and limited.exit == pf.Exit.MEMORY and "ulimits" in limited.fix
        if hard == resource.RLIM_INFINITY:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, hard))
            assert pf.check_memlock(profile).ok
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def test_shm_for_real(tmp_path):
    profile = load_profile("3x3090")
    huge = dataclasses.replace(profile, container=dataclasses.replace(profile.container, shm_size="900tb"))
    finding = pf.check_shm(huge, str(tmp_path))
    assert not finding.ok and "shm_size: 900tb" in finding.fix
    small = dataclasses.replace(profile, container=dataclasses.replace(profile.container, shm_size="1mb"))
    assert pf.check_shm(small, str(tmp_path)).ok


def test_cgroup_limits(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree: 1 kB\n")
    limit = tmp_path / "memory.max"
    limit.write_text("max\n")
    assert pf.check_cgroup(limit, meminfo).ok
    limit.write_text(str(32 * GIB))
    finding = pf.check_cgroup(limit, meminfo)
    assert not finding.ok and finding.exit == pf.Exit.MEMORY and "32.00 GiB" in finding.detail
    assert pf.check_cgroup(tmp_path / "absent", meminfo).ok


def test_ptrace_probe_for_real():
    finding = pf.check_process_madvise()
    assert finding.check == "ptrace"
    if not finding.ok:  # a sandbox that refuses it: a warning with the compose fix, not a no-go
        assert not finding.blocking and "SYS_PTRACE" in finding.fix


def test_ple_drive_for_real(tmp_path):
    table = tmp_path / "table.bin"
    table.write_bytes(b"\1" * (8 << 20))
    finding = pf.check_ple_drive(table, seconds=1)
    if "O_DIRECT" in finding.detail:
        pytest.skip("this filesystem does not support O_DIRECT")
    assert "p99" in finding.detail and finding.exit in (pf.Exit.GO, pf.Exit.PLE)
    small = tmp_path / "small.bin"
    small.write_bytes(b"\1" * 4096)
    assert pf.check_ple_drive(small).exit == pf.Exit.PLE


def test_overlay_findings(demo_snapshot, demo_overlay, tmp_path):
    assert pf.check_overlays(demo_snapshot, [demo_overlay]).ok
    bad = tmp_path / "ov"
    shutil.copytree(demo_overlay, bad)
    with open(bad / "config.json", "a") as f:
        f.write(" ")
    finding = pf.check_overlays(demo_snapshot, [bad])
    assert not finding.ok and finding.exit == pf.Exit.OVERLAY and "config.json" in finding.detail


def test_image_findings():
    missing_engine = pf.check_image("flashnext-no-such-engine", "x")
    assert not missing_engine.ok and missing_engine.exit == pf.Exit.IMAGE


def test_verdict_and_exit_codes(demo_snapshot, demo_overlay, monkeypatch):
    monkeypatch.setattr(pf, "nvml_devices", lambda: RTX3090)  # what NVML would answer on the rig
    result = CliRunner().invoke(cli, ["doctor", "--profile", "3x3090", "--model", str(demo_snapshot),
                                      "--overlay", str(demo_overlay), "--engine", "native", "--json"])
    report = json.loads(result.stdout)
    assert [f["check"] for f in report["findings"]] == ["gpus", "host-ram", "memlock", "shm", "cgroup", "ptrace",
                                                            "overlay"]
    assert report["findings"][0]["ok"]
    blocking = [f for f in report["findings"] if not f["ok"] and f["blocking"]]
    assert result.exit_code == (blocking[0]["exit"] if blocking else 0) == report["exit_code"]
    assert report["go"] == (result.exit_code == 0)
    # GPUs are checked first, so too few of them decides the exit code whatever else is wrong
    monkeypatch.setattr(pf, "nvml_devices", lambda: RTX3090[:1])
    result = CliRunner().invoke(cli, ["serve", "--profile", "3x3090", "--model", str(demo_snapshot), "--check",
                                      "--engine", "native"])
    assert result.exit_code == pf.Exit.GPU and "NO-GO (exit 10)" in result.output and "fix:" in result.output


def test_ple_table_findings(demo_snapshot, tmp_path):
    from flashnext.quant.ple.table import build_table

    table = tmp_path / "table.bin"
    build_table(demo_snapshot, table, progress=False)
    good = pf.check_ple_table(table, demo_snapshot)
    assert good.ok and "built from" in good.detail
    assert pf.check_ple_table(table, None).ok
    with open(table, "r+b") as f:  # a byte changed on disk
        f.seek(5)
        f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
    changed = pf.check_ple_table(table, demo_snapshot)
    assert not changed.ok and changed.exit == pf.Exit.PLE and "differs from its source" in changed.detail
    assert f"flashnext ple build --src {demo_snapshot} --out {table} --force" == changed.fix
    table.write_bytes(b"\0" * 64)
    short = pf.check_ple_table(table, demo_snapshot)
    assert not short.ok and "needs exactly" in short.detail


def test_ple_table_sidecar_and_sampling(demo_snapshot, tmp_path):
    """A malformed sidecar is a NO-GO with the rebuild line, not a crash; a flipped byte anywhere in
    a table this small is found within the budget; with no budget the finding says what it left out."""
    from flashnext.quant.ple.table import build_table

    table = tmp_path / "table.bin"
    build_table(demo_snapshot, table, progress=False)
    assert "100.0%" in pf.check_ple_table(table, demo_snapshot).detail
    partial = pf.check_ple_table(table, demo_snapshot, seconds=0)
    assert partial.ok and "ple verify --full" in partial.detail and "as `ple build` left them" in partial.detail
    size = table.stat().st_size
    with open(table, "r+b") as f:  # the middle block, never one of the ends
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 1]))
    flipped = pf.check_ple_table(table, demo_snapshot)
    assert not flipped.ok and flipped.blocking and "differs from its source" in flipped.detail
    sidecar = table.with_name("table.bin.json")
    for broken in ("[]", '{"format": "flashnext.ple-table/1"}', "{"):
        sidecar.write_text(broken)
        finding = pf.check_ple_table(table, demo_snapshot)
        assert not finding.ok and finding.blocking and finding.exit == pf.Exit.PLE
        assert finding.fix == f"flashnext ple build --src {demo_snapshot} --out {table} --force"
    result = CliRunner().invoke(cli, ["doctor", "--profile", "3x3090", "--model", str(demo_snapshot),
                                      "--ple-table", str(table), "--engine", "native"])
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "[FAIL] ple-table" in result.output and "NO-GO" in result.output
