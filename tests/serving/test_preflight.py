"""The preflight, on this machine for real; only NVML's answers are supplied (no GPU here)."""

import dataclasses
import json
import resource
import shutil

import pytest
from click.testing import CliRunner

from flashnext.serving import preflight as pf
from flashnext.serving.capacity import ledger
from flashnext.quant.checkpoint.snapshot import Snapshot
from flashnext.serving.deployment import Deployment
from flashnext.serving.profiles import available, load_profile
from flashnext.tools.cli import main as cli

GIB = 2**30
RTX3090 = [pf.GpuInfo(i, "NVIDIA GeForce RTX 3090", 24 * GIB, int(23.9 * GIB)) for i in range(3)]


def test_gpu_findings():
    profile = load_profile("3x3090")
    assert pf.check_gpus(profile, RTX3090).ok
    few = pf.check_gpus(profile, RTX3090[:2])
    assert not few.ok and few.exit == pf.NoGoCode.GPU and "needs 3" in few.detail
    busy = [RTX3090[0], dataclasses.replace(RTX3090[1], free_bytes=20 * GIB), RTX3090[2]]
    finding = pf.check_gpus(profile, busy)
    assert not finding.ok and "GPU 1" in finding.detail and "nvidia-smi" in finding.fix


def pf_share(profile) -> float:
    from flashnext.serving.capacity import gpu_memory_utilization

    return gpu_memory_utilization(profile)


def with_args(name: str, *args: str):
    profile = load_profile(name)
    return dataclasses.replace(profile, vllm_args=[*profile.vllm_args, *args])


def vllms_cache_config(profile, monkeypatch):
    """The profile's ``CacheConfig`` as vLLM settles it served on CUDA: built from what vLLM's
    ``EngineArgs`` parser makes of the arguments, its extensible KV cache decided by vLLM's own
    ``VllmConfig._resolve_extensible_kv_cache`` with a stand-in for the CUDA platform (the one
    stand-in: vllm/platforms/cuda.py needs libcuda to import)."""
    import types

    import vllm.platforms
    from vllm.config import CacheConfig, VllmConfig

    from flashnext.serving.capacity.shape import engine_args

    parsed = engine_args(profile)
    cache = CacheConfig(gpu_memory_utilization=parsed.gpu_memory_utilization,
                        kv_cache_memory_bytes=parsed.kv_cache_memory_bytes,
                        num_gpu_blocks_override=parsed.num_gpu_blocks_override,
                        enable_extensible_kv_cache=parsed.enable_extensible_kv_cache)
    if parsed.kv_transfer_config is not None:  # its connectors' modules imported on the real platform
        parsed.kv_transfer_config.kv_cache_access()
    monkeypatch.setattr(vllm.platforms, "_current_platform",
                        types.SimpleNamespace(is_cuda_alike=lambda: True, is_rocm=lambda: False, device_type="cuda"))
    VllmConfig._resolve_extensible_kv_cache(types.SimpleNamespace(
        cache_config=cache, kv_transfer_config=parsed.kv_transfer_config,
        parallel_config=types.SimpleNamespace(enable_elastic_ep=parsed.enable_elastic_ep)))
    monkeypatch.undo()
    return cache


@pytest.mark.parametrize("args, share", [
    # vLLM 0.34.0's default where the profile sizes the KV cache itself (--kv-cache-memory-bytes: no
    # extensible KV cache); the preflight's own parse assumed 0.9 before issue 27
    ([], 0.92),
    (["--gpu-memory-utilization=0.95"], 0.95),  # the `=` form vLLM's parser reads
    (["--gpu-memory-utilization", "0.5"], 0.5),
])
def test_the_gpu_check_takes_the_share_vllm_reads(args, share, monkeypatch):
    """What the preflight requires free on each GPU is the share vLLM resolves for the profile
    (vLLM 0.34.0's parser leaves an absent --gpu-memory-utilization None, and CacheConfig picks the
    default by how the KV cache is sized: resolved_gpu_memory_utilization)."""
    profile = load_profile("3x3090")
    rest = list(profile.vllm_args)
    at = rest.index("--gpu-memory-utilization")
    del rest[at:at + 2]
    profile = dataclasses.replace(profile, vllm_args=rest + args)
    cache = vllms_cache_config(profile, monkeypatch)
    assert cache.enable_extensible_kv_cache is False
    assert cache.resolved_gpu_memory_utilization == share == pf_share(profile)
    just_under = [pf.GpuInfo(i, "NVIDIA GeForce RTX 3090", 24 * GIB, int(share * 24 * GIB) - 1) for i in range(3)]
    refused = pf.check_gpus(profile, just_under)
    assert not refused.ok and f"takes {share:.0%}" in refused.detail
    just_free = [pf.GpuInfo(i, "NVIDIA GeForce RTX 3090", 24 * GIB, int(share * 24 * GIB) + 1) for i in range(3)]
    assert pf.check_gpus(profile, just_free).ok


@pytest.mark.parametrize("profile", [
    *(load_profile(name) for name in available()),
    with_args("8xh200-glm53-offload", "--no-enable-extensible-kv-cache"),
    with_args("8xh200-glm53-offload", "--num-gpu-blocks-override", "1000"),
    with_args("8xh200-glm53-offload", "--enable-elastic-ep", "--enable-expert-parallel"),
    with_args("8xh200-glm53-offload", "--kv-transfer-config",
              '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":'
              '{"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":1073741824,"custom_mem_pool":true}}'),
], ids=lambda p: " ".join(p.vllm_args[len(load_profile(p.name).vllm_args):]) or p.name)
def test_the_extensible_kv_cache_is_vllms_own_decision(profile, monkeypatch):
    """flashnext's reading of whether a profile gets vLLM 0.34.0's extensible KV cache is vLLM's
    own method's, and so is the share the preflight takes from it."""
    from flashnext.serving.capacity import extensible_kv_cache

    cache = vllms_cache_config(profile, monkeypatch)
    assert extensible_kv_cache(profile) == cache.enable_extensible_kv_cache
    assert pf_share(profile) == cache.resolved_gpu_memory_utilization


def test_with_the_extensible_kv_cache_a_busy_gpu_is_a_smaller_cache_not_a_refusal():
    """The GLM profiles leave the KV cache's size to vLLM: vLLM 0.34.0 then takes up to all of each
    GPU and sizes the cache from what is free after warm-up, and refuses no GPU for what is in use
    at the start (vllm/v1/worker/utils.py request_memory), so neither does the preflight."""
    profile = load_profile("8xh200-glm53-hisparse")
    assert pf_share(profile) == 1.0
    h200 = [pf.GpuInfo(i, "NVIDIA H200", 141 * GIB, 140 * GIB) for i in range(8)]
    h200[3] = dataclasses.replace(h200[3], free_bytes=100 * GIB)
    finding = pf.check_gpus(profile, h200)
    assert finding.ok and "extensible KV cache" in finding.detail and "GPU 3" in finding.detail
    assert not pf.check_gpus(profile, h200[:7]).ok


def test_the_host_ram_check_reads_the_pipeline_size_as_vllm_does(tmp_path):
    """`-pp 3` is the profile's pipeline as much as `--pipeline-parallel-size 3`: the MTP draft's
    embedding is pinned either way (the preflight's own parse saw only the long form before issue 27)."""
    profile = load_profile("3x3090-mtp")
    rest = list(profile.vllm_args)
    at = rest.index("--pipeline-parallel-size")
    short = dataclasses.replace(profile, vllm_args=[*rest[:at], "-pp", rest[at + 1], *rest[at + 2:]])
    for p in (profile, short):
        finding = pf.check_host_ram(Deployment(p, ple_table=tmp_path / "table.bin"), meminfo_file(tmp_path, 125, 118),
                                    tmp_path / "absent")
        assert finding.terms["MTP draft embedding"] == DRAFT_EMBED


def test_the_headroom_is_the_host_pools():
    """The preflight leaves the headroom the exact-size pool (patch host-pool) refuses by at start."""
    import inspect

    from flashnext.serving import capacity
    from flashnext.serving.runtime.host_pool import PinnedHostPool

    default = inspect.signature(PinnedHostPool).parameters["headroom"].default
    assert default == capacity.HOST_HEADROOM == 4 * GIB


# The release's pinned allocations, by hand: 244 blocks x 12,144 tokens x 2 KiB x 12 QSA layers; the
# PLE table 320,001,536 padded rows x 160 bf16; 27 ViT blocks of 30,479,104 B (each parameter of a
# 30,479,008 B block rounded up to vit-stream's slot alignment); the draft's INT8 embedding, 248,320
# rows padded to 248,320 (already a multiple of 64) x (2,560 B + 20 bf16 scales).
QSA_783MB = 244 * 12_144 * 2_048 * 12
PLE_TABLE = 320_001_536 * 160 * 2
VIT_BLOCKS = 27 * 30_479_104
DRAFT_EMBED = 248_320 * (2_560 + 2_560 // 128 * 2)
PLE_STAGING = 4 * 2**20  # 512 tokens x 16 heads x 160 x bf16 = 2.5 MiB, as PyTorch's host allocator rounds it


def meminfo_file(tmp_path, total_gib, available_gib):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: {total_gib * GIB // 1024} kB\nMemAvailable: {available_gib * GIB // 1024} kB\n")
    return path


def test_host_ram_against_the_plan(tmp_path):
    """The 3x3090 profile at 783 MB with its table file: 67.82 GiB of QSA K/V + 0.77 GiB of ViT blocks."""
    profile = load_profile("3x3090")
    unlimited = tmp_path / "memory.max"
    unlimited.write_text("max\n")
    table = tmp_path / "table.bin"  # served from the file: never pinned, so never read here
    rig = pf.check_host_ram(Deployment(profile, ple_table=table), meminfo_file(tmp_path, 125, 118), unlimited)
    assert rig.ok and rig.terms == {"QSA K/V": QSA_783MB, "PLE staging rows": PLE_STAGING, "ViT blocks": VIT_BLOCKS}
    assert "QSA K/V 67.82 GiB + PLE staging rows 4.00 MiB + ViT blocks 784.81 MiB = 68.59 GiB" in rig.detail

    small = pf.check_host_ram(Deployment(profile, ple_table=table), meminfo_file(tmp_path, 64, 60), unlimited)
    assert not small.ok and small.exit == pf.NoGoCode.MEMORY
    # each block pins 12 x 12,144 x 2,048 B = 0.278 GiB: (60 - 4) GiB less the ViT's 0.77 hold 198 blocks
    assert "lower --kv-cache-memory-bytes to 635,019,264 (198 blocks" in small.fix

    # a cgroup limit below MemAvailable is what counts
    unlimited.write_text(str(40 * GIB))
    assert not pf.check_host_ram(Deployment(profile, ple_table=table), meminfo_file(tmp_path, 125, 118), unlimited).ok


def test_host_ram_counts_a_pinned_ple_table(tmp_path):
    """Without --ple-table vLLM's engram default (cpu_offload) pins the whole 95.37 GiB table: with
    the 67.82 GiB of QSA K/V that is more than a 125 GiB host has; the fix is the table file."""
    profile = load_profile("3x3090")
    finding = pf.check_host_ram(Deployment(profile), meminfo_file(tmp_path, 125, 118), tmp_path / "absent")
    assert finding.terms == {"QSA K/V": QSA_783MB, "PLE table": PLE_TABLE, "ViT blocks": VIT_BLOCKS}
    assert not finding.ok and finding.blocking and finding.exit == pf.NoGoCode.MEMORY
    assert "QSA K/V 67.82 GiB + PLE table 95.37 GiB + ViT blocks 784.81 MiB = 163.96 GiB" in finding.detail
    assert "--ple-table FILE" in finding.fix and "flashnext ple build --src SNAPSHOT --out FILE" in finding.fix
    # the engram table kept on the GPU instead pins nothing on the host
    on_gpu = dataclasses.replace(profile, vllm_args=[*profile.vllm_args, "--engram-config", '{"cpu_offload": false}'])
    assert "PLE table" not in pf.check_host_ram(Deployment(on_gpu), meminfo_file(tmp_path, 125, 118),
                                                tmp_path / "absent").terms
    # nor does vLLM 0.34.0's disk_offload, which reads the rows from the shards and wins over cpu_offload
    on_disk = with_args("3x3090", "--engram-config", '{"cpu_offload": true, "disk_offload": true}')
    assert "PLE table" not in pf.check_host_ram(Deployment(on_disk), meminfo_file(tmp_path, 125, 118),
                                                tmp_path / "absent").terms


def test_host_ram_counts_the_mtp_draft_embedding(tmp_path):
    """3x3090-mtp at 550 MB: 170 blocks of 9,776 tokens over 12 QSA layers and the draft's one,
    plus the draft's INT8 embedding that patch mtp-02 pins on the last rank (0.60 GiB)."""
    profile = load_profile("3x3090-mtp")
    finding = pf.check_host_ram(Deployment(profile, ple_table=tmp_path / "table.bin"),
                                meminfo_file(tmp_path, 125, 118), tmp_path / "absent")
    qsa = 170 * 9_776 * 2_048 * 13
    assert finding.terms == {"QSA K/V": qsa, "PLE staging rows": PLE_STAGING, "MTP draft embedding": DRAFT_EMBED,
                             "ViT blocks": VIT_BLOCKS}
    assert finding.ok and f"= {(qsa + DRAFT_EMBED + VIT_BLOCKS) / GIB:.2f} GiB" in finding.detail
    slim_off = dataclasses.replace(profile, env={**profile.env, "VLLM_MTP_SLIM_DRAFT": "0"})
    assert "MTP draft embedding" not in pf.check_host_ram(Deployment(slim_off, ple_table=tmp_path / "t"),
                                                          meminfo_file(tmp_path, 125, 118), tmp_path / "absent").terms


def test_pinned_sizes_from_the_snapshots_tensors(demo_snapshot, demo_table):
    """With --model the table and the draft embedding are sized from the snapshot: the table as the
    file `ple build` wrote, the embedding from its tensors as the safetensors library reads them."""
    from safetensors import safe_open

    assert ledger.ple_table_bytes(Snapshot.open(demo_snapshot)) == demo_table.stat().st_size
    config = json.loads((demo_snapshot / "config.json").read_text())
    vocab = config["text_config"]["vocab_size"]
    index = json.loads((demo_snapshot / "model.safetensors.index.json").read_text())["weight_map"]
    stored = 0
    for suffix in ("weight_packed", "weight_scale"):
        name = f"model.language_model.embed_tokens.{suffix}"
        with safe_open(demo_snapshot / index[name], "pt") as f:
            t = f.get_tensor(name)
        stored += t.numel() * t.element_size() // t.shape[0] * (-(-vocab // 64) * 64)
    assert ledger.draft_embedding_bytes(Snapshot.open(demo_snapshot)) == stored


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_a_quantized_ple_table_is_pinned_at_its_own_size(fmt, demo_snapshot, tmp_path):
    """A view with `ple build --format` applied: vLLM's method pins the table's codes (and NVFP4's block
    scales) as its own allocations, at the quantized sizes, not the BF16 table's."""
    from flashnext.quant.overlays.ple_quant import quantize_ple_table
    from flashnext.quant.overlays.view import apply_overlays
    from flashnext.quant.ple.table import find_ple_source

    quantize_ple_table(demo_snapshot, tmp_path / "ov", fmt)
    apply_overlays(demo_snapshot, [tmp_path / "ov"], tmp_path / "view")
    source = find_ple_source(Snapshot.open(demo_snapshot))
    rows, d = source.layout.padded_rows, source.row_elements
    expected = sorted([rows * d // 2, rows * d // 16] if fmt == "nvfp4" else [rows * d])
    assert sorted(ledger.ple_table_allocations(Snapshot.open(tmp_path / "view"))) == expected
    assert ledger.ple_table_bytes(Snapshot.open(demo_snapshot)) == rows * d * 2  # the BF16 table, for comparison
    finding = pf.check_host_ram(Deployment(load_profile("3x3090"), tmp_path / "view"), meminfo_file(tmp_path, 125, 118),
                                tmp_path / "absent")
    assert finding.terms["PLE table"] == sum(expected)  # the exact-size pool: no rounding


def test_host_ram_counts_pytorch_power_of_two_rounding(tmp_path):
    """Without the exact-size pool each 5.65 GiB layer pool becomes 8 GiB: 96 GiB for 12 layers (seed 000 §2),
    and the ViT's 0.77 GiB row becomes 1 GiB."""
    profile = load_profile("3x3090")
    off = dataclasses.replace(profile, env={**profile.env, "VLLM_EXACT_HOST_POOL": "0"})
    finding = pf.check_host_ram(Deployment(off, ple_table=tmp_path / "table.bin"), meminfo_file(tmp_path, 125, 90),
                                tmp_path / "absent")
    assert not finding.ok and "QSA K/V 96.00 GiB + PLE staging rows 4.00 MiB + ViT blocks 1.00 GiB" in finding.detail
    assert "67.82 GiB exact" in finding.detail
    assert 'VLLM_EXACT_HOST_POOL: "1"' in finding.fix


def test_memlock_for_real():
    profile = load_profile("3x3090")
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (4 << 20, hard))
        limited = pf.check_memlock(profile)
        assert not limited.ok and limited.exit == pf.NoGoCode.MEMORY and "ulimits" in limited.fix
        if hard == resource.RLIM_INFINITY:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, hard))
            assert pf.check_memlock(profile).ok
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def test_shm_for_real(tmp_path):
    profile = load_profile("3x3090")
    huge = dataclasses.replace(profile, container=dataclasses.replace(profile.container, shm_size="64tb"))
    finding = pf.check_shm(huge, str(tmp_path))
    assert not finding.ok and "shm_size: 64tb" in finding.fix
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
    assert not finding.ok and finding.exit == pf.NoGoCode.MEMORY and "32.00 GiB" in finding.detail
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
    assert "p99" in finding.detail and finding.exit in (pf.NoGoCode.GO, pf.NoGoCode.PLE)
    small = tmp_path / "small.bin"
    small.write_bytes(b"\1" * 4096)
    assert pf.check_ple_drive(small).exit == pf.NoGoCode.PLE


def test_overlay_findings(demo_snapshot, demo_overlay, tmp_path):
    assert pf.check_overlays(Deployment(load_profile("3x3090"), demo_snapshot, (demo_overlay,))).ok
    bad = tmp_path / "ov"
    shutil.copytree(demo_overlay, bad)
    with open(bad / "config.json", "a") as f:
        f.write(" ")
    finding = pf.check_overlays(Deployment(load_profile("3x3090"), demo_snapshot, (bad,)))
    assert not finding.ok and finding.exit == pf.NoGoCode.OVERLAY and "config.json" in finding.detail


def test_image_findings():
    missing_engine = pf.check_image("flashnext-no-such-engine", "x")
    assert not missing_engine.ok and missing_engine.exit == pf.NoGoCode.IMAGE


def test_verdict_and_exit_codes(demo_snapshot, demo_overlay, demo_table, monkeypatch):
    monkeypatch.setattr(pf, "nvml_devices", lambda: RTX3090)  # what NVML would answer on the rig
    result = CliRunner().invoke(cli, ["doctor", "--profile", "3x3090", "--model", str(demo_snapshot),
                                      "--overlay", str(demo_overlay), "--engine", "native", "--json"])
    report = json.loads(result.stdout)
    assert [f["check"] for f in report["findings"]] == ["gpus", "host-ram", "memlock", "shm", "cgroup", "ptrace",
                                                            "overlay", "vllm"]
    assert report["findings"][0]["ok"]
    blocking = [f for f in report["findings"] if not f["ok"] and f["blocking"]]
    assert result.exit_code == (blocking[0]["exit"] if blocking else 0) == report["exit_code"]
    assert report["go"] == (result.exit_code == 0)
    # GPUs are checked first, so too few of them decides the exit code whatever else is wrong
    monkeypatch.setattr(pf, "nvml_devices", lambda: RTX3090[:1])
    result = CliRunner().invoke(cli, ["serve", "--profile", "3x3090", "--model", str(demo_snapshot), "--check",
                                      "--engine", "native", "--ple-table", str(demo_table)])
    assert result.exit_code == pf.NoGoCode.GPU and "NO-GO (exit 10)" in result.output and "fix:" in result.output


def served_table(table, model) -> Deployment:
    """A deployment of ``model`` serving the PLE table file ``table``: what the preflight checks it for."""
    return Deployment(load_profile("3x3090"), model, ple_table=table)


def test_ple_table_findings(demo_snapshot, tmp_path):
    from flashnext.quant.ple.table import build_table

    table = tmp_path / "table.bin"
    build_table(demo_snapshot, table, progress=False)
    good = pf.check_ple_table(served_table(table, demo_snapshot))
    assert good.ok and "built from" in good.detail
    assert pf.check_ple_table(served_table(table, None)).ok
    with open(table, "r+b") as f:  # a byte changed on disk
        f.seek(5)
        f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
    changed = pf.check_ple_table(served_table(table, demo_snapshot))
    assert not changed.ok and changed.exit == pf.NoGoCode.PLE and "differs from its source" in changed.detail
    assert f"flashnext ple build --src {demo_snapshot} --out {table} --force" == changed.fix
    table.write_bytes(b"\0" * 64)
    short = pf.check_ple_table(served_table(table, demo_snapshot))
    assert not short.ok and "needs exactly" in short.detail


def test_ple_table_sidecar_and_sampling(demo_snapshot, tmp_path):
    """A malformed sidecar is a NO-GO with the rebuild line, not a crash; a flipped byte anywhere in
    a table this small is found within the budget; with no budget the finding says what it left out."""
    from flashnext.quant.ple.table import build_table

    table = tmp_path / "table.bin"
    build_table(demo_snapshot, table, progress=False)
    assert "100.0%" in pf.check_ple_table(served_table(table, demo_snapshot)).detail
    partial = pf.check_ple_table(served_table(table, demo_snapshot), seconds=0)
    assert partial.ok and "ple verify --full" in partial.detail and "as `ple build` left them" in partial.detail
    size = table.stat().st_size
    with open(table, "r+b") as f:  # the middle block, never one of the ends
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 1]))
    flipped = pf.check_ple_table(served_table(table, demo_snapshot))
    assert not flipped.ok and flipped.blocking and "differs from its source" in flipped.detail
    sidecar = table.with_name("table.bin.json")
    for broken in ("[]", '{"format": "flashnext.ple-table/1"}', "{"):
        sidecar.write_text(broken)
        finding = pf.check_ple_table(served_table(table, demo_snapshot))
        assert not finding.ok and finding.blocking and finding.exit == pf.NoGoCode.PLE
        # without a valid sidecar the table is not ple build's, which --force would refuse to replace
        assert finding.fix.startswith(f"flashnext ple build --src {demo_snapshot} --out NEW.bin, then pass "
                                      "--ple-table NEW.bin")
    result = CliRunner().invoke(cli, ["doctor", "--profile", "3x3090", "--model", str(demo_snapshot),
                                      "--ple-table", str(table), "--engine", "native"])
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "[FAIL] ple-table" in result.output and "NO-GO" in result.output


def test_serve_takes_a_quantized_ple_overlay_without_a_table_file(demo_snapshot, tmp_path):
    """`serve --profile 3x3090 --model SNAPSHOT --overlay PLE-NVFP4`: the table is vLLM's to pin, so no
    --ple-table is asked for (and one given is refused), and the preflight counts the quantized table."""
    from flashnext.errors import FlashnextError
    from flashnext.quant.overlays.ple_quant import quantize_ple_table
    from flashnext.quant.ple.table import find_ple_source
    from flashnext.serving.deployment import Deployment
    from flashnext.serving.run import require_ple_table

    quantize_ple_table(demo_snapshot, tmp_path / "nvfp4", "nvfp4")
    profile = load_profile("3x3090")
    with pytest.raises(FlashnextError, match="pass ple_table FILE"):
        require_ple_table(Deployment(profile, demo_snapshot))
    require_ple_table(Deployment(profile, demo_snapshot, (tmp_path / "nvfp4",)))
    with pytest.raises(FlashnextError, match="drop ple_table"):
        require_ple_table(Deployment(profile, demo_snapshot, (tmp_path / "nvfp4",), tmp_path / "table.bin"))
    finding = pf.check_host_ram(Deployment(profile, demo_snapshot, (tmp_path / "nvfp4",)),
                                meminfo_file(tmp_path, 125, 118), tmp_path / "absent")
    source = find_ple_source(Snapshot.open(demo_snapshot))
    rows, d = source.layout.padded_rows, source.row_elements
    assert finding.terms["PLE table"] == rows * d // 2 + rows * d // 16  # codes and block scales, 4.5 bits a value
    assert finding.terms["PLE table"] < ledger.ple_table_bytes(Snapshot.open(demo_snapshot)) / 3
