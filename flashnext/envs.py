"""Every environment variable flashnext reads, declared in one place.

The serving patches read the same names (they call into this library), so each switch here turns
a feature off both in the toolkit and in the patched vLLM. Declaring a variable registers it
(``DECLARED``), so that no list of them is kept by hand; its ``kind`` says whose it is.
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
CUDA_VISIBLE_DEVICES = EnvVar(
    "CUDA_VISIBLE_DEVICES", "",
    "CUDA's: the GPUs a process sees; the patch probes' interpreter inherits it (none when unset).",
    THIRD_PARTY_READ)
VLLM_PLE_PREFETCH = EnvVar(
    "VLLM_PLE_PREFETCH", "1",
    "Patch ttft-01: 0 turns off the prompt prefetcher (each admitted prompt's PLE pages, advised ahead).")
VLLM_PLE_DECODE_ADVICE = EnvVar(
    "VLLM_PLE_DECODE_ADVICE", "1",
    "Patch decode-06: 0 turns off the per-step advice of a decode step's PLE rows before the gather.")
VLLM_PLE_MMAP_PATH = EnvVar(
    "VLLM_PLE_MMAP_PATH", "",
    "Patch ple-mmap: the PLE table file made by `flashnext ple build`; empty: vLLM's own table.")

VLLM_QSA_KV_OFFLOAD = EnvVar(
    "VLLM_QSA_KV_OFFLOAD", "0",
    "Patch qsa-offload: 1 keeps the QSA main K/V in pinned host memory, with the attention block size "
    "of seed 000 (what `flashnext plan` models); 0 (vLLM's default) keeps it in VRAM.")
VLLM_QSA_ROW_CACHE = EnvVar(
    "VLLM_QSA_ROW_CACHE", "1",
    "Patch qsa-offload (decode-07): 0 reads every selected K/V row from host memory in decode, "
    "without the row cache in the staging arena.")

VLLM_QSA_INDEXER_OWN_SCHEME = EnvVar(
    "VLLM_QSA_INDEXER_OWN_SCHEME", "1",
    "Patch qsa-indexer-quant: 0 merges the QSA indexer projection into q/k/v as vLLM 0.33.0 does, "
    "even when the checkpoint quantizes them differently (the release's INT8 indexer then fails to load).")

VLLM_INT8_MODULES = EnvVar(
    "VLLM_INT8_MODULES", "1",
    "Patch int8-modules: 0 builds qwen4_exp's embed_tokens, lm_head and hyper-connection mixers as vLLM "
    "0.33.0 does, in bf16 (its loader then refuses the release's INT8 tensors).")
VLLM_INT8_LM_HEAD_KERNEL = EnvVar(
    "VLLM_INT8_LM_HEAD_KERNEL", "vllm",
    "Patch int8-modules: which kernel multiplies the INT8 LM head: vllm (the one vLLM's mixed-precision "
    "chooser picks, through its own compressed-tensors scheme; flashnext's where it has none) or "
    "flashnext (the INT8 tensor-core kernel int8_mma).")
VLLM_INT6_BITPLANE = EnvVar(
    "VLLM_INT6_BITPLANE", "1",
    "Patch int6-bitplane: 0 turns a bit-plane overlay's modules back into dense INT6 words at load and "
    "serves them with vLLM's own INT6 path.")
VLLM_HC_FUSED_DECODE = EnvVar(
    "VLLM_HC_FUSED_DECODE", "1",
    "Patch decode-04: 0 runs a decode step's hyper-connection mix through vLLM's unfused GEMMs and "
    "hc_silu / hc_gate_mix kernels again.")
VLLM_MOE_FUSED_DECODE = EnvVar(
    "VLLM_MOE_FUSED_DECODE", "1",
    "Patch decode-05: 0 routes a decode step's MoE block through vLLM's router GEMM, top-k and "
    "shared-expert gate again, and Marlin aligns its own blocks.")

VLLM_VIT_STREAM = EnvVar(
    "VLLM_VIT_STREAM", "1",
    "Patch vit-stream: 0 keeps the vision tower's blocks resident in device memory.")

VLLM_MTP_PP = EnvVar(
    "VLLM_MTP_PP", "1",
    "Patch mtp-01: 0 builds the MTP draft's embed_tokens and lm_head without the checkpoint's INT8 "
    "method again (stock vLLM, whose loader then refuses the release's INT8 draft tensors).")
VLLM_MTP_SLIM_DRAFT = EnvVar(
    "VLLM_MTP_SLIM_DRAFT", "1",
    "Patch mtp-02: 0 gives the draft head its own lm_head copy and a device embedding again under PP.")

VLLM_PP_DEFER_RECV = EnvVar(
    "VLLM_PP_DEFER_RECV", "1",
    "Patch decode-03: 0 receives the previous pipeline rank's tensors first thing in execute_model again.")

VLLM_GPU_STEP_TIME = EnvVar(
    "VLLM_GPU_STEP_TIME", "0",
    "Patch step-time: 1 times every CUDA graph replay (a decode step) with CUDA events, without a sync, "
    "and serves the times on /metrics as flashnext:gpu_step_seconds per rank (what `flashnext bench` shows).")
VLLM_GPU_STEP_TIME_DIR = EnvVar(
    "VLLM_GPU_STEP_TIME_DIR", "/tmp/flashnext-gpu-step-time",
    "Patch step-time: where each worker writes its step times for the API server's /metrics; give each "
    "server on one host its own.")

VLLM_EXACT_HOST_POOL = EnvVar(
    "VLLM_EXACT_HOST_POOL", "1",
    "Patch host-pool: 0 returns to PyTorch's caching host allocator (power-of-two rounding).")
VLLM_HOST_POOL_LOCK = EnvVar(
    "VLLM_HOST_POOL_LOCK", "/tmp/flashnext-host-pool.lock",
    "The lock file that serialises the free-RAM check and pinning across pipeline ranks.")

DECLARED: tuple[EnvVar, ...] = tuple(_declared)
# What the patched vLLM reads: the patches' switches and their settings.
ALL: tuple[EnvVar, ...] = tuple(v for v in DECLARED if v.kind == SERVING)

# Variables that serving profiles set and that neither vLLM (vllm.envs) nor the patch series reads,
# with the library that does.
THIRD_PARTY = {
    "PYTORCH_CUDA_ALLOC_CONF": "PyTorch's CUDA caching allocator",
    "NCCL_NVLS_ENABLE": "NCCL (NVLink SHARP / multicast)",
}
