"""Every environment variable flashnext reads, declared in one place.

The serving patches read the same names (they call into this library), so each switch here turns
a feature off both in the toolkit and in the patched vLLM. Declaring a variable registers it
(``DECLARED``), so that no list of them is kept by hand; its ``kind`` says whose it is. A patch's
off switch is declared in its entry of the patch series and read here like the rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# What a variable is: read by the patched vLLM through the hooks (a patch's switch or setting,
# which the serving profiles and the selftest may set), read by flashnext's own commands, or owned
# by another program and only read here.
SERVING = "serving"
FLASHNEXT = "flashnext"
THIRD_PARTY_READ = "third-party"
KINDS = (SERVING, FLASHNEXT, THIRD_PARTY_READ)

_declared: list[EnvVar] = []

@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str
    kind: str = SERVING

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {KINDS}")
        if any(v.name == self.name for v in _declared):
            raise ValueError(f"{self.name} is declared twice")
        _declared.append(self)

    def get(self) -> str:
        return os.environ.get(self.name, self.default)

    def enabled(self) -> bool:
        return is_on(self.get())

    def enabled_in(self, env: dict[str, str]) -> bool:
        """Whether the switch is on in another environment (a profile's, a container's)."""
        return is_on(env.get(self.name, self.default))

def is_on(value: str) -> bool:
    return value.strip().lower() not in ("0", "false", "no", "off", "")

FLASHNEXT_DEBUG = EnvVar(
    "FLASHNEXT_DEBUG", "0",
    "1: a command that fails on something unexpected prints the Python traceback, not one line.", FLASHNEXT)
# Read by flashnext but owned by others: declared here so that no module reads os.environ itself.
TRITON_INTERPRET = EnvVar(
    "TRITON_INTERPRET", "0",
    "Triton's: 1 runs kernels through its interpreter on the CPU (what the CPU tests and selftest do).",
    THIRD_PARTY_READ)
XDG_CACHE_HOME = EnvVar(
    "XDG_CACHE_HOME", "",
    "The XDG base directory for caches; `serve` keeps each profile's state under it (default ~/.cache).",
    THIRD_PARTY_READ)
HF_HOME = EnvVar(
    "HF_HOME", "",
    "huggingface_hub's home (default $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface): its hub/ is the "
    "download cache when HF_HUB_CACHE is unset.",
    THIRD_PARTY_READ)
HF_HUB_CACHE = EnvVar(
    "HF_HUB_CACHE", "",
    "huggingface_hub's download cache (default $HF_HOME/hub): no flashnext output goes into a repository's "
    "blobs/, snapshots/ or refs/ there (nor in any cache laid out as one).",
    THIRD_PARTY_READ)
CUDA_VISIBLE_DEVICES = EnvVar(
    "CUDA_VISIBLE_DEVICES", "",
    "CUDA's: the GPUs a process sees; the patch probes' interpreter inherits it (none when unset).",
    THIRD_PARTY_READ)

VLLM_QSA_ROW_CACHE = EnvVar(
    "VLLM_QSA_ROW_CACHE", "1",
    "Patch qsa-offload (decode-07): 0 reads every selected K/V row from host memory in decode, "
    "without the row cache in the staging arena.")

VLLM_INT8_LM_HEAD_KERNEL = EnvVar(
    "VLLM_INT8_LM_HEAD_KERNEL", "vllm",
    "Patch int8-modules: which kernel multiplies the INT8 LM head: vllm (the one vLLM's mixed-precision "
    "chooser picks, through its own compressed-tensors scheme; flashnext's where it has none) or "
    "flashnext (the INT8 tensor-core kernel int8_mma).")

VLLM_GPU_STEP_TIME_DIR = EnvVar(
    "VLLM_GPU_STEP_TIME_DIR", "/tmp/flashnext-gpu-step-time",
    "Patch step-time: where each worker writes its step times for the API server's /metrics; give each "
    "server on one host its own.")

VLLM_HOST_POOL_LOCK = EnvVar(
    "VLLM_HOST_POOL_LOCK", "/tmp/flashnext-host-pool.lock",
    "The lock file that serialises the free-RAM check and pinning across pipeline ranks.")


def __getattr__(name: str):
    """``DECLARED`` (every variable), ``ALL`` (what the patched vLLM reads: the patches' switches and
    their settings) and each patch's switch by its name. A switch is declared in its patch's entry
    of the series (``serving/patches/series.py``), so that a new patch is written in its own files
    only; importing ``flashnext.serving``, which every reader of a switch does, declares them."""
    if name == "DECLARED":
        return tuple(_declared)
    if name == "ALL":
        return tuple(v for v in _declared if v.kind == SERVING)
    for v in _declared:
        if v.name == name:
            return v
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Variables that serving profiles set and that neither vLLM (vllm.envs) nor the patch series reads,
# with the library that does.
THIRD_PARTY = {
    "PYTORCH_CUDA_ALLOC_CONF": "PyTorch's CUDA caching allocator",
    "NCCL_NVLS_ENABLE": "NCCL (NVLink SHARP / multicast)",
}
