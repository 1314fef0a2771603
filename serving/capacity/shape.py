"""What a serving profile asks of vLLM, read the way vLLM reads it.

This module is the only reader of a profile's vLLM arguments, and it reads them with vLLM 0.34.0's
own parsers (``EngineArgs``' for what the engine gets, ``vllm serve``'s for the profile loader's
check of the whole command line): a hand parse would miss the short forms (``-pp 3``), the ``=``
forms and the defaults vLLM applies, and then the plan, the preflight and the served engine would
each see a different profile.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import os
import sys
from pathlib import Path
from dataclasses import dataclass

from flashnext import envs
from flashnext.errors import FlashnextError, named
from flashnext.serving.capacity.vision import DEFAULT_MAX_PIXELS

# vLLM's own knob for an uneven pipeline split; a profile sets it in its environment.
PP_LAYER_PARTITION = "VLLM_PP_LAYER_PARTITION"
# What vLLM's OpenAI server takes where a profile leaves the batch unset, on a GPU below 70 GiB
# (EngineArgs.get_batch_defaults): the tokens and sequences a step may hold.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 256


# What import_vllm put in this process's environment for planning, and only for planning: a vLLM
# that `serve --engine native` starts from this process must not inherit it (VLLM_TARGET_DEVICE=cpu
# would make it serve on the CPU).
PLANNING_ENV: dict[str, str] = {}


def _set_for_planning(name: str, value: str) -> None:
    if name not in os.environ:
        os.environ[name] = PLANNING_ENV[name] = value


def import_vllm(why: str = "planning asks vLLM for its KV cache rules") -> None:
    """Import vLLM to plan or to parse only: no device is used, so any machine can plan for another."""
    from flashnext.serving import vllm_release

    _set_for_planning("VLLM_TARGET_DEVICE", "cpu")
    _set_for_planning("VLLM_LOGGING_LEVEL", "WARNING")
    if not any(Path("/dev").glob("nvidia[0-9]*")):
        # vLLM 0.34.0's CPU platform refuses to configure without Triton, and finds Triton usable
        # with no GPU driver only where CUDA_VISIBLE_DEVICES is set and empty. On a machine with no
        # NVIDIA device that hides nothing.
        _set_for_planning("CUDA_VISIBLE_DEVICES", "")
    try:
        importlib.import_module("vllm")
    except ImportError:
        raise FlashnextError(f"{why}: {vllm_release.support_line(None)}") from None


def engine_args(profile):
    """``profile.vllm_args`` as vLLM's ``EngineArgs`` command line parses them (a namespace of
    every engine argument, vLLM's defaults for those the profile leaves out)."""
    import_vllm()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args, _ = parser.parse_known_args(list(profile.vllm_args))
    return args


@functools.cache
def _serve_parser():
    import_vllm("reading a profile's vllm_args asks vLLM's own parser")
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@contextlib.contextmanager
def _environment_restored():
    """``os.environ`` as it was once the block ends. What :func:`import_vllm` sets is for reading in
    this process: `serve --engine native` reads the profile and then execs `vllm serve` with this
    process's environment, where VLLM_TARGET_DEVICE=cpu would serve on the CPU."""
    environment = os.environ.copy()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environment)


def parse_serve_command(argv: list[str], where: str) -> None:
    """Refuse, in one line beginning ``where``, the arguments of ``vllm serve`` that vLLM's own
    serve parser refuses (the parser ``vllm serve`` itself runs): an option it does not know, a value
    it does not take, a second model. The arguments only, not ``validate_parsed_serve_args``: that
    opens the files they name, which are the container's, not this host's."""
    from flashnext.output import held_back_output

    said = io.StringIO()
    refusal = None
    # vLLM and torch bind their log handlers to the streams of the moment as they import: give them
    # the process's own (a test runner's stand-ins would keep their notes), held back at the descriptors.
    with _environment_restored(), held_back_output(), contextlib.redirect_stdout(sys.__stdout__), \
            contextlib.redirect_stderr(sys.__stderr__):
        parser = _serve_parser()
        try:
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                parser.parse_args(argv)
        except SystemExit:
            errors = [line.partition(": error: ")[2] for line in said.getvalue().splitlines() if ": error: " in line]
            refusal = errors[-1] if errors else "it stops at them without serving (a help option?)"
        except (ValueError, TypeError) as e:  # FlexibleArgumentParser's own checks
            refusal = str(e).strip().splitlines()[0]
    if refusal is not None:
        from flashnext.serving.patches.series import VLLM_VERSION

        raise FlashnextError(f"{where}: vLLM {VLLM_VERSION}'s parser refuses them: {refusal}")


def extensible_kv_cache(profile) -> bool:
    """Whether vLLM serves the profile (on CUDA) with its extensible KV cache, sized from the memory
    measured free after warm-up, as ``VllmConfig._resolve_extensible_kv_cache`` settles it: as
    ``--enable-extensible-kv-cache`` says when given, else on unless the profile sizes the cache
    itself (``--kv-cache-memory-bytes``, ``--num-gpu-blocks-override``), runs elastic EP, or has a
    KV connector that reaches the cache through legacy CUDA IPC, its own memory pool, or FABRIC
    handles without an IMEX channel here. Computed rather than asked of vLLM, whose method asks the
    platform of this process (the CPU's, for planning), not the one the profile is served on
    (``tests/serving/test_preflight.py`` holds this to vLLM's method). One reading stays this
    process's: a connector that leaves ``kv_buffer_device`` out gets the planning platform's
    default, which only NIXL's answer depends on."""
    args = engine_args(profile)
    if args.enable_extensible_kv_cache is not None:
        return bool(args.enable_extensible_kv_cache)
    if args.kv_cache_memory_bytes is not None or args.num_gpu_blocks_override is not None or args.enable_elastic_ep:
        return False
    transfer = args.kv_transfer_config
    if transfer is None:
        return True
    from vllm.config.kv_transfer import KVCacheAccess
    from vllm.utils.vmm_driver import imex_channel_available

    access = transfer.kv_cache_access()
    if KVCacheAccess.LEGACY_IPC in access or transfer.uses_custom_mem_pool():
        return False
    return KVCacheAccess.EXPORTS_FD in access or KVCacheAccess.EXPORTS_FABRIC not in access or imex_channel_available()


def gpu_memory_utilization(profile) -> float:
    """The share of each GPU's memory the profile's engine takes, as vLLM resolves it
    (``CacheConfig.resolved_gpu_memory_utilization``): ``--gpu-memory-utilization`` when given,
    else a default that vLLM 0.34.0 picks by how the KV cache is sized (:func:`extensible_kv_cache`)."""
    given = engine_args(profile).gpu_memory_utilization  # first: without vLLM, the error that says so
    from vllm.config import CacheConfig

    cache = CacheConfig(gpu_memory_utilization=given, enable_extensible_kv_cache=extensible_kv_cache(profile))
    return float(cache.resolved_gpu_memory_utilization)


def layer_partition(profile) -> tuple[int, ...] | None:
    """The profile's ``VLLM_PP_LAYER_PARTITION``: decoder layers per pipeline rank, or None (vLLM's even split)."""
    text = profile.env.get(PP_LAYER_PARTITION, "").strip()
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise FlashnextError(f"profile {profile.name}: {PP_LAYER_PARTITION} {text!r} is not a comma-separated "
                             "list of layer counts") from None


def capture_sizes(compilation_config) -> tuple[int, ...]:
    """The step sizes the profile's engine captures CUDA graphs of: none with ``cudagraph_mode``
    NONE; the profile's list, else vLLM's default (up to 512 tokens; the ledger's decode rows are
    capped by the batch anyway)."""
    mode = compilation_config.cudagraph_mode
    if mode is not None and mode.name == "NONE":
        return ()
    return tuple(compilation_config.cudagraph_capture_sizes or (512,))


@dataclass(frozen=True)
class ServingShape:
    """What the plan needs from a profile's vLLM arguments and environment."""

    pipeline_parallel_size: int
    max_model_len: int
    kv_cache_memory_bytes: int
    prefix_caching: bool
    num_speculative_tokens: int
    layer_partition: tuple[int, ...] | None
    qsa_kv_offload: bool
    exact_host_pool: bool
    images: bool = True  # not --language-model-only
    vit_stream: bool = True
    max_pixels: int = DEFAULT_MAX_PIXELS
    speculative_method: str | None = None  # --speculative-config's method ("mtp")
    engram_cpu_offload: bool = True  # --engram-config's cpu_offload: vLLM pins the PLE table on the host
    mtp_slim_draft: bool = True  # patch mtp-02 (VLLM_MTP_SLIM_DRAFT)
    ple_table_file: bool = False  # the profile's environment names a PLE table file (VLLM_PLE_MMAP_PATH)
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # a step's tokens: a prefill chunk's query rows
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    cudagraph_capture_sizes: tuple[int, ...] = ()  # none: every step eager
    moe_fused_decode: bool = True  # patch decode-05 (VLLM_MOE_FUSED_DECODE)
    hc_fused_decode: bool = True  # patch decode-04 (VLLM_HC_FUSED_DECODE)
    qsa_row_cache: bool = True  # decode-07 (VLLM_QSA_ROW_CACHE)

    @classmethod
    def from_profile(cls, profile, kv_cache_memory_bytes: int | None = None,
                     prefix_caching: bool | None = None) -> "ServingShape":
        """Read the profile's arguments with vLLM's own engine-argument parser."""
        args = engine_args(profile)
        kv_bytes = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else args.kv_cache_memory_bytes
        if not kv_bytes:
            raise FlashnextError(
                f"profile {profile.name} sets no --kv-cache-memory-bytes; pass {named('kv_cache_memory_bytes')} N")
        if not args.max_model_len:
            raise FlashnextError(f"profile {profile.name} sets no --max-model-len")
        spec = args.speculative_config or {}  # the parser has read the JSON of these two into dicts
        mm_kwargs = args.mm_processor_kwargs or {}
        engram = args.engram_config  # an EngramConfig where given; vLLM's default offloads the table
        enabled = prefix_caching if prefix_caching is not None else bool(args.enable_prefix_caching)
        return cls(
            pipeline_parallel_size=int(args.pipeline_parallel_size),
            max_model_len=int(args.max_model_len),
            kv_cache_memory_bytes=int(kv_bytes),
            prefix_caching=enabled,
            num_speculative_tokens=int(spec.get("num_speculative_tokens", 0) or 0),
            layer_partition=layer_partition(profile),
            qsa_kv_offload=envs.VLLM_QSA_KV_OFFLOAD.enabled_in(profile.env),
            exact_host_pool=envs.VLLM_EXACT_HOST_POOL.enabled_in(profile.env),
            images=not args.language_model_only,
            vit_stream=envs.VLLM_VIT_STREAM.enabled_in(profile.env),
            max_pixels=int(mm_kwargs.get("max_pixels", DEFAULT_MAX_PIXELS)),
            speculative_method=spec.get("method"),
            # vLLM 0.34.0's disk_offload (the table read from the checkpoint's shards each step)
            # takes precedence over cpu_offload and pins no table (Qwen4ExpNGramEmbedding.__init__)
            engram_cpu_offload=True if engram is None else bool(engram.cpu_offload and not engram.disk_offload),
            mtp_slim_draft=envs.VLLM_MTP_SLIM_DRAFT.enabled_in(profile.env),
            ple_table_file=bool(profile.env.get(envs.VLLM_PLE_MMAP_PATH.name, "").strip()),
            max_num_batched_tokens=int(args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS),
            max_num_seqs=int(args.max_num_seqs or DEFAULT_MAX_NUM_SEQS),
            cudagraph_capture_sizes=capture_sizes(args.compilation_config),
            moe_fused_decode=envs.VLLM_MOE_FUSED_DECODE.enabled_in(profile.env),
            hc_fused_decode=envs.VLLM_HC_FUSED_DECODE.enabled_in(profile.env),
            qsa_row_cache=envs.VLLM_QSA_ROW_CACHE.enabled_in(profile.env),
        )
