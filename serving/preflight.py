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

from flashnext.errors import NoGoCode, said
from flashnext.serving.capacity.ledger import pinned_host_terms  # the pinned-host terms: the memory ledger's
from flashnext.serving.host_memory import CGROUP_MEMORY_MAX, MEMINFO, read_host_memory
from flashnext.serving.deployment import Deployment
from flashnext.serving.profiles import Profile, shm_size_bytes
from flashnext.sizes import format_size


@dataclass
class Finding:
    """One check's verdict. ``detail`` and ``fix`` may quote an error with the inputs it names marked
    (:func:`flashnext.errors.said`): a command shows them as its flags."""

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


def nvml_devices() -> list[GpuInfo] | None:
    """The GPUs NVML reports; None where NVML cannot load (no ``pynvml``, no driver library)."""
    try:
        import pynvml  # nvidia-ml-py, a base dependency; imported here, not at start-up
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver: NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None
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


NVIDIA_SMI_QUERY = ["--query-gpu=index,name,memory.total,memory.free", "--format=csv,noheader,nounits"]
MIB = 2**20


def nvidia_smi_devices() -> list[GpuInfo]:
    """The GPUs ``nvidia-smi`` reports (empty where it is missing or fails): the driver's own tool,
    for where the NVML bindings cannot load. Its memory columns are MiB."""
    import shutil

    program = shutil.which("nvidia-smi")
    if program is None:
        return []
    try:
        done = subprocess.run([program, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    out = []
    for row in done.stdout.splitlines():
        if not row.strip():
            continue
        try:
            # The name is the only column that could hold a comma: the others are taken from both ends.
            index, rest = row.split(",", 1)
            name, total, free = rest.rsplit(",", 2)
            out.append(GpuInfo(int(index), name.strip(), int(float(total)) * MIB, int(float(free)) * MIB))
        except ValueError:  # "[N/A]" where a GPU reports no memory, or not the asked format
            return []
    return out


def visible_gpus() -> list[GpuInfo]:
    """The GPUs this process can see: NVML's answer, else ``nvidia-smi``'s where NVML cannot load."""
    devices = nvml_devices()
    return nvidia_smi_devices() if devices is None else devices


def check_gpus(profile: Profile, devices: list[GpuInfo]) -> Finding:
    if len(devices) < profile.gpus:
        return Finding("gpus", False, f"{len(devices)} GPU(s) visible, the profile needs {profile.gpus}",
                       "expose the GPUs to this process (drivers installed, CUDA_VISIBLE_DEVICES, "
                       f"compose `deploy.resources.reservations.devices: count: {profile.gpus}`)", NoGoCode.GPU)
    from flashnext.errors import FlashnextError
    from flashnext.serving import vllm_release
    from flashnext.serving.capacity import extensible_kv_cache, gpu_memory_utilization

    models = ", ".join(sorted({d.name for d in devices[:profile.gpus]}))
    try:
        util, extensible = gpu_memory_utilization(profile), extensible_kv_cache(profile)
    except FlashnextError as e:  # no vLLM here to read the profile with: the count is all that is known
        return Finding("gpus", False, f"{profile.gpus} x {models}; free VRAM not checked ({said(e)})",
                       f"install vLLM beside flashnext to check it here: {vllm_release.INSTALL}", NoGoCode.GPU,
                       blocking=False)
    if extensible:
        # vLLM's start refuses a GPU with less free than its share only when the KV cache is sized
        # up front (vllm/v1/worker/utils.py request_memory); the extensible one takes what is free
        # after warm-up, so less free memory is a smaller cache, not a refusal.
        least = min(devices[:profile.gpus], key=lambda d: d.free_bytes / d.total_bytes)
        return Finding("gpus", True, f"{profile.gpus} x {models}; vLLM's extensible KV cache takes what is free after "
                       f"warm-up, up to {util:.0%} of each (least free now: GPU {least.index}, "
                       f"{format_size(least.free_bytes)} of {format_size(least.total_bytes)})")
    busy = [d for d in devices[:profile.gpus] if d.free_bytes < util * d.total_bytes]
    if busy:
        d = busy[0]
        return Finding("gpus", False,
                       f"GPU {d.index} ({d.name}) has {format_size(d.free_bytes)} free of {format_size(d.total_bytes)}; "
                       f"the profile takes {util:.0%}", f"stop what holds GPU {d.index}'s memory (see nvidia-smi)",
                       NoGoCode.GPU)
    return Finding("gpus", True, f"{profile.gpus} x {models}, free VRAM ≥ {util:.0%} on each")


def _kib(limit: int) -> str:
    return "unlimited" if limit == resource.RLIM_INFINITY else f"{limit // 1024} KiB"


def check_memlock(profile: Profile, engine: str = "native") -> Finding:
    """The locked-memory limit the server will run under: natively this process's own (``ulimit
    -l``); in a container the one the compose file that ``serve`` writes gives it, whatever this
    shell's is. Docker's daemon sets it as root; rootless podman cannot raise it past this user's
    hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if not profile.container.memlock_unlimited:
        return Finding("memlock", True, f"locked memory limit {_kib(soft)} (the profile does not pin)")
    if engine in ("docker", "podman"):
        from flashnext.serving.compose import container_ulimits

        if container_ulimits(profile).get("memlock") != {"soft": -1, "hard": -1}:
            return Finding("memlock", False, f"the compose file for {profile.name} does not set memlock unlimited, "
                           "and pinned host K/V pools need it", "set `container.memlock_unlimited: true` in the "
                           "profile (compose then gets `ulimits: {memlock: {soft: -1, hard: -1}}`)", NoGoCode.MEMORY)
        if engine == "podman" and os.geteuid() != 0 and hard != resource.RLIM_INFINITY:
            return Finding("memlock", False, f"the compose file sets memlock unlimited, but rootless podman cannot "
                           f"raise the container's limit past this user's hard limit ({_kib(hard)})",
                           "raise this user's hard limit (/etc/security/limits.conf: `USER hard memlock unlimited`, "
                           "then log in again), or run podman as root", NoGoCode.MEMORY)
        return Finding("memlock", True, "locked memory in the container: unlimited (the compose file serve writes "
                       f"sets `ulimits: memlock: -1`; this shell's `ulimit -l` of {_kib(soft)} does not apply to it)")
    if soft == resource.RLIM_INFINITY:
        return Finding("memlock", True, "locked memory: unlimited")
    return Finding("memlock", False, f"`ulimit -l` is {_kib(soft)}; pinned host K/V pools need it unlimited",
                   "`ulimit -l unlimited` in the shell that runs serve (past the hard limit, "
                   f"{_kib(hard)}, it needs root or /etc/security/limits.conf), or serve in a container: the compose "
                   "file sets `ulimits: {memlock: {soft: -1, hard: -1}}`", NoGoCode.MEMORY)


def check_shm(profile: Profile, path: str = "/dev/shm") -> Finding:
    need = shm_size_bytes(profile.container.shm_size)
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


def _no_plan_fix(deployment: Deployment) -> str:
    """What to do when the preflight cannot plan ``deployment``: where vLLM is missing, install it;
    with a model the plan is that snapshot's (the demo's 4 layers do not split as a profile made for
    the base checkpoint splits its 48), which `plan --profile` alone would not reproduce."""
    from flashnext.serving import vllm_release

    profile, model = deployment.profile, deployment.model
    if vllm_release.installed_version() is None:
        return f"install vLLM to plan here: {vllm_release.INSTALL}"
    if model is not None:
        return (f"the plan is for {model}: `flashnext plan --profile {profile.name} --model {model}` gives the same "
                f"reason; profile {profile.name} is made for the base checkpoint (leave out --model to check that)")
    return f"`flashnext plan --profile {profile.name}` says why"


def check_host_ram(deployment: Deployment, meminfo: Path = MEMINFO, memory_max: Path = CGROUP_MEMORY_MAX) -> Finding:
    """Every pinned host byte (QSA K/V, a pinned PLE table, the MTP draft embedding, the streamed ViT)
    of ``deployment`` (its plan, and its served model's tensors) against what this host (and its
    cgroup) can still give."""
    from flashnext.errors import FlashnextError
    from flashnext.serving import capacity

    profile, model = deployment.profile, deployment.model
    try:
        plan, shape = deployment.plan, deployment.shape
        terms = pinned_host_terms(shape, plan, deployment)
    except FlashnextError as e:
        return Finding("host-ram", False, f"no plan for this profile ({said(e)})", _no_plan_fix(deployment),
                       NoGoCode.MEMORY, blocking=False)
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
    from flashnext.quant.ple.drive import MIN_FILE_BYTES, drive_check
    from flashnext.errors import FlashnextError

    size = table.stat().st_size if table.is_file() else None
    if size is not None and size < MIN_FILE_BYTES:  # the demo's table (528 KiB)
        return Finding("ple-drive", False, f"{table} is {format_size(size)}, under the {format_size(MIN_FILE_BYTES)} "
                       "the drive check reads: its drive is not measured (a table this small stays in the page "
                       "cache once read, so the drive's tail does not reach decode)",
                       "nothing to do for this table; to measure its drive anyway: `flashnext ple drive-check FILE` "
                       f"with a FILE of at least {format_size(MIN_FILE_BYTES)} there", NoGoCode.PLE, blocking=False)
    try:
        r = drive_check(table, seconds)
    except FlashnextError as e:
        return Finding("ple-drive", False, said(e), "check the path given to --ple-table", NoGoCode.PLE)
    q = r["qd1"]
    detail = f"{table}: QD1 p50 {q['p50_ms']:.3f} ms, p99 {q['p99_ms']:.3f} ms, max {q['max_ms']:.1f} ms; deep queue {r['deep']['iops']:.0f} IOPS"
    if not r["ok"]:
        return Finding("ple-drive", False, detail, "move the PLE table to a drive with a short tail "
                       "(seed 000 §3.7: a DRAM-less QLC drive stalled decode for seconds)", NoGoCode.PLE)
    return Finding("ple-drive", True, detail)


PLE_HASH_SECONDS = 5.0  # the preflight's budget for hashing the PLE table against its sidecar


def check_ple_table(deployment: Deployment, seconds: float = PLE_HASH_SECONDS) -> Finding:
    """The deployment's table file is whole and, given its snapshot, built from it (the base
    snapshot, as the deployment opened it): patch ple-mmap refuses a wrong-sized file only after the
    engine has started.

    Within ``seconds`` it hashes random 16 MiB blocks (both ends first) against the sidecar: all of a
    table of up to a few GiB, a sample of the real 95 GiB one. The finding says how much it covered,
    whether the file is the one ``ple build`` wrote (size, mtime and inode as recorded), and points
    to ``ple verify --full`` for the rest."""
    from flashnext.errors import FlashnextError
    from flashnext.quant.ple.sidecar import read_sidecar
    from flashnext.quant.ple.source import find_ple_source
    from flashnext.quant.ple.table import verify_table

    table, model = deployment.ple_table, deployment.model
    src = model or "SNAPSHOT"
    try:
        sidecar = read_sidecar(table)
    except FlashnextError as e:
        # Without a valid sidecar the file is not `ple build`'s, and its --force replaces only its own.
        fix = (f"flashnext ple build --src {src} --out NEW.bin, then pass --ple-table NEW.bin (`ple build --force` "
               f"replaces only a table it made)" if os.path.lexists(table) else
               f"flashnext ple build --src {src} --out {table}")
        return Finding("ple-table", False, said(e), fix, NoGoCode.PLE)
    rebuild = f"flashnext ple build --src {src} --out {table} --force"
    try:
        result = verify_table(table, seconds=seconds)
        if model is not None:
            source = find_ple_source(deployment.snapshot, sidecar.dense_layer_id)
            differ = sidecar.mismatches(source)
            if differ:
                return Finding("ple-table", False, f"{table} was built from another checkpoint than {model} "
                               f"(its {', '.join(differ)} differ)", rebuild, NoGoCode.PLE)
    except FlashnextError as e:
        return Finding("ple-table", False, said(e), rebuild, NoGoCode.PLE)
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


def check_overlays(deployment: Deployment) -> Finding:
    """Each overlay of ``deployment`` against its snapshot: its own files by the hashes its manifest
    pins, the base files it replaces by theirs."""
    from flashnext.errors import FlashnextError
    from flashnext.quant.overlays.view import verify_overlay

    model, overlays = deployment.model, deployment.overlays
    for overlay in overlays:
        try:
            problems = verify_overlay(model, overlay)
        except FlashnextError as e:
            return Finding("overlay", False, said(e), "pass an overlay directory made by flashnext", NoGoCode.OVERLAY)
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
        return Finding("image", False, f"{image} is not built", f"`serve` builds it (serving/Dockerfile: vLLM 0.34.0 "
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


def preflight(deployment: Deployment, engine: str, devices: list[GpuInfo] | None = None) -> list[Finding]:
    """Every check of ``deployment`` served by ``engine``: judged from what it holds, nothing loaded again."""
    from flashnext.serving.compose import IMAGE

    profile = deployment.profile

    findings = [check_gpus(profile, visible_gpus() if devices is None else devices),
                check_memlock(profile, engine), check_shm(profile), check_cgroup(), check_process_madvise()]
    from flashnext.serving.capacity import FAMILIES

    if profile.model_family in FAMILIES:
        findings.insert(1, check_host_ram(deployment))
    if deployment.ple_table is not None:
        findings.append(check_ple_table(deployment))
        findings.append(check_ple_drive(deployment.ple_table))
    if deployment.model is not None:
        findings.append(check_overlays(deployment))
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
