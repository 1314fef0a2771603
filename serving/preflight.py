"""Preflight: can this machine run a serving profile? Go/no-go, with numbers and the fix for each problem.

Checks: the GPUs (count, model, free VRAM, through NVML); host RAM against every pinned allocation
(the plan's QSA K/V, a pinned PLE table, the MTP draft embedding, the streamed ViT blocks);
the locked-memory limit, /dev/shm and the cgroup memory limit; whether process_madvise is allowed
(SYS_PTRACE / seccomp); the PLE table file (whole, and built from this snapshot) and its drive
(tail latency, ``flashnext ple drive-check``); each overlay against the snapshot; the serving
image. Each failing check has its own exit code.
"""
from __future__ import annotations

import os
import resource
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from flashnext.errors import NoGoCode
from flashnext.serving.host_memory import CGROUP_MEMORY_MAX, MEMINFO, read_host_memory
from flashnext.serving.profiles import Profile
from flashnext.sizes import format_size


@dataclass
class Finding:
    check: str
    ok: bool
    detail: str
    fix: str | None = None
    exit: int = NoGoCode.GO
    blocking: bool = True
    terms: dict[str, int] | None = None  # host-ram: each pinned allocation's bytes

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int
    free_bytes: int


def nvml_devices() -> list[GpuInfo]:
    """The GPUs NVML reports (empty without a driver)."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver: NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append(GpuInfo(i, name.decode() if isinstance(name, bytes) else name, int(mem.total), int(mem.free)))
        return out
    finally:
        pynvml.nvmlShutdown()


def check_gpus(profile: Profile, devices: list[GpuInfo]) -> Finding:
    if len(devices) < profile.gpus:
        return Finding("gpus", False, f"{len(devices)} GPU(s) visible, the profile needs {profile.gpus}",
                       "expose the GPUs to this process (drivers installed, CUDA_VISIBLE_DEVICES, "
                       f"compose `deploy.resources.reservations.devices: count: {profile.gpus}`)", NoGoCode.GPU)
    from flashnext.errors import FlashnextError
    from flashnext.serving.capacity import gpu_memory_utilization

    models = ", ".join(sorted({d.name for d in devices[:profile.gpus]}))
    try:
        util = gpu_memory_utilization(profile)
    except FlashnextError as e:  # no vLLM here to read the profile with: the count is all that is known
        return Finding("gpus", False, f"{profile.gpus} x {models}; free VRAM not checked ({e})",
                       "install vLLM 0.33.0 beside flashnext (the `serve` extra) to check it here", NoGoCode.GPU, blocking=False)
    busy = [d for d in devices[:profile.gpus] if d.free_bytes < util * d.total_bytes]
    if busy:
        d = busy[0]
        return Finding("gpus", False,
                       f"GPU {d.index} ({d.name}) has {format_size(d.free_bytes)} free of {format_size(d.total_bytes)}; "
                       f"the profile takes {util:.0%}", f"stop what holds GPU {d.index}'s memory (see nvidia-smi)",
                       NoGoCode.GPU)
    return Finding("gpus", True, f"{profile.gpus} x {models}, free VRAM ≥ {util:.0%} on each")


def check_memlock(profile: Profile) -> Finding:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if not profile.container.memlock_unlimited or soft == resource.RLIM_INFINITY:
        return Finding("memlock", True, "locked memory: unlimited" if soft == resource.RLIM_INFINITY
                       else f"locked memory limit {soft} B (the profile does not pin)")
    return Finding("memlock", False, f"`ulimit -l` is {soft // 1024} KiB; pinned host K/V pools need it unlimited",
                   "compose: `ulimits: {memlock: {soft: -1, hard: -1}}` (serve writes it); natively: `ulimit -l unlimited`",
                   NoGoCode.MEMORY)


def _parse_size(text: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().rstrip("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def check_shm(profile: Profile, path: str = "/dev/shm") -> Finding:
    need = _parse_size(profile.container.shm_size)
    try:
        st = os.statvfs(path)
    except OSError:
        return Finding("shm", False, f"{path} is missing", f"compose: `shm_size: {profile.container.shm_size}`",
                       NoGoCode.MEMORY)
    size = st.f_frsize * st.f_blocks
    if size < need:
        return Finding("shm", False, f"{path} is {format_size(size)}; the profile wants {format_size(need)}",
                       f"compose: `shm_size: {profile.container.shm_size}` (serve writes it) or `ipc: host`",
                       NoGoCode.MEMORY)
    return Finding("shm", True, f"{path}: {format_size(size)}")


def check_cgroup(memory_max: Path = CGROUP_MEMORY_MAX, meminfo: Path = MEMINFO) -> Finding:
    memory = read_host_memory(meminfo, memory_max)
    total, limit = memory.total, memory.cgroup_limit
    if not memory_max.exists():
        return Finding("cgroup", True, f"no cgroup v2 memory limit; host RAM {format_size(total)}")
    if limit is None:
        return Finding("cgroup", True, f"cgroup memory.max: unlimited; host RAM {format_size(total)}")
    if limit < 0.9 * total:
        return Finding("cgroup", False, f"cgroup memory.max is {format_size(limit)} of {format_size(total)} RAM; pinned pools "
                                        "and the PLE page cache need the host's memory",
                       "raise the container's memory limit (compose `mem_limit`, podman `--memory`)", NoGoCode.MEMORY)
    return Finding("cgroup", True, f"cgroup memory.max {format_size(limit)} of {format_size(total)}")


VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: VocabParallelEmbedding pads its rows to it
BF16_BYTES = 2  # the release's PLE rows and its INT8 embedding's group scales are bf16


@dataclass(frozen=True)
class PinnedTerm:
    """One allocation that stays pinned in host memory for the server's life."""

    name: str
    bytes: int  # as allocated: power-of-two rounded when PyTorch's allocator takes it
    why: str


def _text_config(model: Path | None) -> tuple[dict, str]:
    from flashnext.serving.capacity import MANIFEST, base_manifest

    if model is None:
        return base_manifest()["text_config"], MANIFEST.name
    from flashnext.quant.checkpoint.snapshot import Snapshot

    return Snapshot.open(model).text_config, str(model)


PLE_FORMATS = ("file", "bf16", "nvfp4", "fp8")  # how the table is served: a mapped file, or pinned in a format


def manifest_table_allocations(fmt: str) -> list[int]:
    """The pinned base checkpoint's PLE table as vLLM allocates it in ``fmt`` (bf16, nvfp4, fp8)."""
    from flashnext.quant.formats import float_rows
    from flashnext.serving.capacity import base_manifest

    table = base_manifest()["ple_table"]
    rows, d = int(table["padded_rows"]), int(table["row_elements"])
    return {"bf16": [rows * d * BF16_BYTES], "fp8": [rows * d],
            "nvfp4": [rows * d // 2, rows * d // float_rows.NVFP4_BLOCK]}[fmt]


def ple_table_allocations(model: Path | None, overlays=()) -> list[int]:
    """The pinned allocations of the PLE tables, in bytes: one a table (its BF16 rows, from the
    snapshot's shards and config, else the pinned manifest); for a table that ``flashnext ple build
    --format`` quantized (config.json's ``ple_embedding_dtype``), vLLM's method allocates its
    ``weight`` (NVFP4 codes or FP8 rows) and, for NVFP4, its ``weight_scale`` blocks, each whole."""
    from flashnext.serving.capacity import base_manifest

    if model is None:
        table = base_manifest()["ple_table"]
        return [int(table["padded_rows"]) * int(table["row_elements"]) * BF16_BYTES]
    from flashnext.quant.checkpoint.snapshot import Snapshot
    from flashnext.quant.ple.table import find_ple_source

    from flashnext.quant.overlays.ple_quant import quantized_table_allocations, served_ple_format

    if served_ple_format(model, overlays) is not None:
        return quantized_table_allocations(model, overlays)
    snap = Snapshot.open(model)
    layers = sorted(set(snap.text_config.get("ple_layer_ids") or ()))
    return [find_ple_source(snap, i).file_size for i in range(len(layers))]


def ple_table_bytes(model: Path | None) -> int:
    """The PLE tables' bytes as vLLM holds them (:func:`ple_table_allocations`)."""
    return sum(ple_table_allocations(model))


# What the draft loads as its embed_tokens (vLLM's _remap_mtp_weight_name), and how the release
# stores it (manifests/qwen3.8-flash-next.json "releases": embed_tokens INT8 g128, bf16 scales).
DRAFT_EMBED = "model.language_model.embed_tokens"
RELEASE_EMBED_GROUP = 128


def draft_embedding_bytes(model: Path | None) -> int:
    """The MTP draft's ``embed_tokens`` as patch mtp-02 pins it at PP > 1: the checkpoint's tensors
    of that embedding (INT8 words and scales, or bf16 rows), per row as stored, over the vocabulary
    padded to 64 rows as vLLM's ``VocabParallelEmbedding`` allocates it."""
    text, _ = _text_config(model)
    vocab, hidden = int(text["vocab_size"]), int(text["hidden_size"])
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    if model is None:
        return padded * hidden + padded * (hidden // RELEASE_EMBED_GROUP) * BF16_BYTES
    from flashnext.errors import FlashnextError
    from flashnext.quant.checkpoint.snapshot import Snapshot

    snap = Snapshot.open(model)
    quantized = [f"{DRAFT_EMBED}.weight_packed", f"{DRAFT_EMBED}.weight_scale"]
    names = quantized if all(n in snap.weight_map for n in quantized) else [f"{DRAFT_EMBED}.weight"]
    total = 0
    for name in names:
        _, entry = snap.entry(name)
        if not entry.shape or entry.shape[0] != vocab:
            raise FlashnextError(f"{model}: {name} has shape {list(entry.shape)}; config.json's vocab_size is {vocab}")
        total += entry.nbytes // vocab * padded
    return total


def pinned_host_terms(shape, plan, model: Path | None, ple_table: Path | None, overlays=(),
                      ple_format: str | None = None) -> list[PinnedTerm]:
    """Every host allocation the patched engine pins for a profile served as ``shape`` (a
    :class:`~flashnext.serving.capacity.ServingShape`) with ``plan``, each as it is allocated; the
    model facts are ``model``'s, as ``plan`` is (None: the pinned base checkpoint). ``ple_format``
    (for the base checkpoint, as ``flashnext plan`` asks): the table served from a file, or pinned
    in that format; None: as the profile and ``model`` say."""
    from flashnext.serving import capacity

    exact = shape.exact_host_pool
    terms = [PinnedTerm("QSA K/V", plan.pinned_host_bytes_needed,
                        f"{sum(plan.qsa_layers_per_rank)} layers x {plan.blocks} blocks (flashnext plan)")]
    text = capacity.load_text_config(model)
    file_backed = ple_table is not None or shape.ple_table_file or ple_format == "file"
    if text.ple_layer_ids and not file_backed and shape.engram_cpu_offload:
        allocations = (manifest_table_allocations(ple_format) if ple_format and model is None
                       else ple_table_allocations(model, overlays))
        why = (f"the table pinned as {ple_format}" if ple_format else "no --ple-table") + \
            ": vLLM's engram cpu_offload pins it whole"
        terms.append(PinnedTerm("PLE table", sum(capacity.pinned_bytes(n, exact) for n in allocations), why))
    if shape.speculative_method == "mtp" and shape.pipeline_parallel_size > 1 and shape.mtp_slim_draft:
        terms.append(PinnedTerm("MTP draft embedding", capacity.pinned_bytes(draft_embedding_bytes(model), exact),
                                "patch mtp-02 (VLLM_MTP_SLIM_DRAFT)"))
    vision = plan.vision
    if vision is not None and vision.streamed and vision.streamed_weight_bytes < vision.resident_weight_bytes:
        tower = capacity.load_vision_config(model)
        terms.append(PinnedTerm("ViT blocks", capacity.pinned_bytes(capacity.streamed_host_bytes(tower), exact),
                                f"patch vit-stream: {tower.depth} blocks in one pinned row each"))
    return terms


def host_fit(shape, plan, terms: list[PinnedTerm], available: int) -> tuple[bool, int | None]:
    """Whether ``terms`` and the pool's headroom fit ``available`` host bytes, and the largest
    ``--kv-cache-memory-bytes`` whose QSA K/V would fit beside the rest (None without the
    exact-size pool, whose pools PyTorch rounds, or when no block fits)."""
    from flashnext.serving import capacity

    need = sum(t.bytes for t in terms)
    others = need - plan.pinned_host_bytes_needed
    per_block = plan.pinned_host_bytes_needed / plan.blocks
    fits = max(int((available - capacity.HOST_HEADROOM - others) // per_block), 0) if shape.exact_host_pool else 0
    return need + capacity.HOST_HEADROOM <= available, (fits * max(plan.bytes_per_block) if fits else None)


def check_host_ram(profile: Profile, meminfo: Path = MEMINFO, memory_max: Path = CGROUP_MEMORY_MAX, *,
                   model: Path | None = None, ple_table: Path | None = None, overlays=()) -> Finding:
    """Every pinned host byte (QSA K/V, a pinned PLE table, the MTP draft embedding, the streamed ViT)
    against what this host (and its cgroup) can still give."""
    from flashnext.errors import FlashnextError
    from flashnext.serving import capacity

    try:
        plan = capacity.plan_profile(profile, model=model)
        shape = capacity.ServingShape.from_profile(profile)
        terms = pinned_host_terms(shape, plan, model, ple_table, overlays)
    except FlashnextError as e:
        return Finding("host-ram", False, f"no plan for this profile ({e})", "`flashnext plan --profile "
                       f"{profile.name}` says why", NoGoCode.MEMORY, blocking=False)
    available = read_host_memory(meminfo, memory_max).allowance
    headroom = capacity.HOST_HEADROOM
    need = sum(t.bytes for t in terms)
    rounding = "" if shape.exact_host_pool else (f" (PyTorch rounds each pool to a power of two: QSA K/V "
                                                 f"{format_size(plan.pinned_host_bytes)} exact)")
    listed = " + ".join(f"{t.name} {format_size(t.bytes)}" for t in terms)
    detail = (f"pinned host memory: {listed} = {format_size(need)}{rounding} + {format_size(headroom)} headroom; "
              f"{format_size(available)} available")
    finding = Finding("host-ram", True, detail)
    finding.terms = {t.name: t.bytes for t in terms}
    if need + headroom <= available:
        return finding
    finding.ok, finding.exit = False, NoGoCode.MEMORY
    others = need - plan.pinned_host_bytes_needed
    table = next((t for t in terms if t.name == "PLE table"), None)
    per_block = plan.pinned_host_bytes_needed / plan.blocks
    fits = max(int((available - headroom - others) // per_block), 0) if shape.exact_host_pool else 0
    if table is not None and need - table.bytes + headroom <= available:
        finding.fix = ("serve the PLE table from a file instead of pinning it: `--ple-table FILE`, made with "
                       f"`flashnext ple build --src {model or 'SNAPSHOT'} --out FILE`")
    elif not shape.exact_host_pool and plan.pinned_host_bytes + others + headroom <= available:
        finding.fix = "turn the exact-size pool back on: environment `VLLM_EXACT_HOST_POOL: \"1\"`"
    elif fits and table is None:
        finding.fix = (f"lower --kv-cache-memory-bytes to {fits * max(plan.bytes_per_block):,} ({fits} blocks; "
                       f"`flashnext plan --profile {profile.name} --kv-cache-memory-bytes N` shows the capacity)")
    elif table is not None:
        finding.fix = ("serve the PLE table from a file (`--ple-table FILE`, from `flashnext ple build --src "
                       f"{model or 'SNAPSHOT'} --out FILE`), and free host memory or use a larger host")
    else:
        finding.fix = "free host memory (stop other processes, drop the page cache) or use a larger host"
    return finding


def check_process_madvise() -> Finding:
    """Probe process_madvise on a scratch mapping, as the PLE prefetcher does."""
    from flashnext.quant.ple.prefetch import TableMapping

    with tempfile.NamedTemporaryFile() as f:
        f.write(b"\0" * 8192)
        f.flush()
        mapping = TableMapping(Path(f.name), 4096)
        batched = mapping.batched
        mapping.close()
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    scope_text = f", ptrace_scope {scope.read_text().strip()}" if scope.exists() else ""
    if batched:
        return Finding("ptrace", True, f"process_madvise allowed{scope_text}")
    return Finding("ptrace", False, f"process_madvise is refused here{scope_text}: the PLE prefetcher falls back "
                                    "to per-range madvise (same pages, ~20x its CPU time)",
                   "compose: `cap_add: [SYS_PTRACE]` (the 3x3090 profiles set it)", NoGoCode.PTRACE, blocking=False)


def check_ple_drive(table: Path, seconds: float = 3.0) -> Finding:
    from flashnext.quant.ple.drive import drive_check
    from flashnext.errors import FlashnextError

    try:
        r = drive_check(table, seconds)
    except FlashnextError as e:
        return Finding("ple-drive", False, str(e), "check the path given to --ple-table", NoGoCode.PLE)
    q = r["qd1"]
    detail = f"{table}: QD1 p50 {q['p50_ms']:.3f} ms, p99 {q['p99_ms']:.3f} ms, max {q['max_ms']:.1f} ms; deep queue {r['deep']['iops']:.0f} IOPS"
    if not r["ok"]:
        return Finding("ple-drive", False, detail, "move the PLE table to a drive with a short tail "
                       "(seed 000 §3.7: a DRAM-less QLC drive stalled decode for seconds)", NoGoCode.PLE)
    return Finding("ple-drive", True, detail)


PLE_HASH_SECONDS = 5.0  # the preflight's budget for hashing the PLE table against its sidecar


def check_ple_table(table: Path, model: Path | None, seconds: float = PLE_HASH_SECONDS) -> Finding:
    """The table file is whole and, given the snapshot, built from it: patch ple-mmap refuses a
    wrong-sized file only after the engine has started.

    Within ``seconds`` it hashes random 16 MiB blocks (both ends first) against the sidecar: all of a
    table of up to a few GiB, a sample of the real 95 GiB one. The finding says how much it covered,
    whether the file is the one ``ple build`` wrote (size, mtime and inode as recorded), and points
    to ``ple verify --full`` for the rest."""
    from flashnext.errors import FlashnextError
    from flashnext.quant.ple.sidecar import read_sidecar
    from flashnext.quant.ple.source import find_ple_source
    from flashnext.quant.ple.table import verify_table
    from flashnext.quant.checkpoint.snapshot import Snapshot

    rebuild = f"flashnext ple build --src {model or 'SNAPSHOT'} --out {table} --force"
    try:
        sidecar = read_sidecar(table)
        result = verify_table(table, seconds=seconds)
        if model is not None:
            source = find_ple_source(Snapshot.open(model), sidecar.dense_layer_id)
            differ = sidecar.mismatches(source)
            if differ:
                return Finding("ple-table", False, f"{table} was built from another checkpoint than {model} "
                               f"(its {', '.join(differ)} differ)", rebuild, NoGoCode.PLE)
    except FlashnextError as e:
        return Finding("ple-table", False, str(e), rebuild, NoGoCode.PLE)
    covered = result["coverage"]
    detail = (f"{table}: {result['file_size']:,} bytes; {result['bytes_checked']:,} ({covered:.1%}) hashed "
              f"against its sidecar in {result['seconds']:.1f} s" + (f", built from {model}" if model else ""))
    full = f"flashnext ple verify --full {table}"
    if covered >= 1.0:
        return Finding("ple-table", True, detail)
    rate = result["bytes_checked"] / max(result["seconds"], 1e-3)
    rest = (f"the other {1 - covered:.1%} is not hashed here (`{full}` reads it all, about "
            f"{result['bytes_hashed_in_sidecar'] / rate / 60:.0f} min at this rate)")
    if result["unchanged_since_build"]:
        return Finding("ple-table", True, f"{detail}; size, mtime and inode are as `ple build` left them; {rest}")
    return Finding("ple-table", False, f"{detail}; the file was written or copied since `ple build` made it, "
                   f"and {rest}", full, NoGoCode.PLE, blocking=False)


def check_overlays(model: Path, overlays: list[Path]) -> Finding:
    from flashnext.errors import FlashnextError
    from flashnext.quant.overlays.view import verify_overlay

    for overlay in overlays:
        try:
            problems = verify_overlay(model, overlay)
        except FlashnextError as e:
            return Finding("overlay", False, str(e), "pass an overlay directory made by flashnext", NoGoCode.OVERLAY)
        if problems:
            return Finding("overlay", False, f"{overlay.name}: {problems[0]}",
                           f"rebuild it against this snapshot (e.g. make-mtp-int4 --src {model} --out NEW)", NoGoCode.OVERLAY)
    return Finding("overlay", True, f"{len(overlays)} overlay(s) match the snapshot" if overlays else "no overlays")


def image_built(engine: str, image: str) -> bool:
    """Whether ``engine`` (the docker or podman program) has ``image``; FileNotFoundError where
    the program is missing. ``serve`` asks the same before it decides to build."""
    return subprocess.run([engine, "image", "inspect", image], capture_output=True).returncode == 0


def check_image(engine: str, image: str) -> Finding:
    try:
        found = image_built(engine, image)
    except FileNotFoundError:
        return Finding("image", False, f"{engine} is not installed", f"install {engine}, or `serve --engine native`",
                       NoGoCode.IMAGE)
    if not found:
        return Finding("image", False, f"{image} is not built", f"`serve` builds it (serving/Dockerfile: vLLM 0.33.0 "
                       "with the patch series); to build now: `docker build -f serving/Dockerfile -t "
                       f"{image} .`", NoGoCode.IMAGE, blocking=False)
    return Finding("image", True, f"{image} present")


def check_vllm(engine: str) -> Finding:
    """The vLLM that will serve: for ``native``, the installed one must be the supported release
    with the series applied (``patches apply``) and flashnext's plugin visible to vLLM; in a
    container the image brings its own, and the installed one is only named."""
    from flashnext.serving import vllm_release

    version = vllm_release.installed_version()
    line = vllm_release.support_line(version)
    if engine != "native":
        return Finding("vllm", True, f"the image's vLLM serves ({line})")
    if not vllm_release.supported(version):
        return Finding("vllm", False, line, vllm_release.INSTALL, NoGoCode.IMAGE)
    from importlib.metadata import entry_points

    from flashnext.serving import patch_series, plugin

    if plugin.PLUGIN_NAME not in {e.name for e in entry_points(group="vllm.general_plugins")}:
        return Finding("vllm", False, f"{line}, but vLLM cannot see flashnext's plugin (no "
                       f"`vllm.general_plugins` entry point {plugin.PLUGIN_NAME})",
                       "reinstall flashnext into the environment vLLM runs in: pip install 'flashnext[serve]'",
                       NoGoCode.IMAGE)
    target = patch_series.installed_vllm_root()
    if not patch_series.series_applied(target):
        return Finding("vllm", False, f"{line}, but without flashnext's patch series",
                       f"flashnext patches apply --target {target}", NoGoCode.IMAGE)
    return Finding("vllm", True, f"{line}, the patch series applied, flashnext's plugin registered")


def preflight(profile: Profile, model: Path | None, overlays: list[Path], ple_table: Path | None,
              engine: str, devices: list[GpuInfo] | None = None) -> list[Finding]:
    from flashnext.serving.compose import IMAGE

    findings = [check_gpus(profile, nvml_devices() if devices is None else devices),
                check_memlock(profile), check_shm(profile), check_cgroup(), check_process_madvise()]
    from flashnext.serving.capacity import FAMILIES

    if profile.model_family in FAMILIES:
        findings.insert(1, check_host_ram(profile, model=model, ple_table=ple_table, overlays=overlays))
    if ple_table is not None:
        findings.append(check_ple_table(ple_table, model))
        findings.append(check_ple_drive(ple_table))
    if model is not None:
        findings.append(check_overlays(model, overlays))
    findings.append(check_vllm(engine))
    if engine in ("docker", "podman"):
        findings.append(check_image(engine, IMAGE))
    return findings


def verdict(findings: list[Finding]) -> int:
    """The exit code: that of the first blocking failure, else 0."""
    for f in findings:
        if not f.ok and f.blocking:
            return int(f.exit)
    return int(NoGoCode.GO)
