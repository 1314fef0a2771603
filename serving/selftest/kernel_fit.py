"""Kernel fit: do the demo checkpoint's quantized layers fit the GPU kernels vLLM picks for them?

vLLM 0.34.0's own ``qwen4_exp`` model is built on the CPU from a config.json (no weights needed),
once per compute capability, with vLLM's own ``CompressedTensorsConfig``: every quantized linear
layer runs ``CompressedTensorsWNA16.create_weights`` and so ``choose_mp_linear_kernel``, every MoE
block ``CompressedTensorsWNA16MoEMethod`` and so ``select_wna16_moe_backend``. Each layer is then
held to the rules of the kernel it is meant for: Marlin's ``can_implement`` for INT4/INT8 linear
layers, Humming's for INT6, ``check_moe_marlin_supports_config`` for the routed experts.

The one stand-in: the CUDA platform, as the kernel chooser sees it. vLLM's ``CudaPlatform`` cannot
be imported without libcuda, so :class:`CapabilityStandIn` is vLLM's ``Platform`` with the CUDA enum
and a fixed capability, put in place of ``current_platform`` only in vLLM's quantization, kernel and
MoE-oracle modules while a model is built; the layers themselves are built by the CPU platform.

Run as ``python -m flashnext.serving.selftest.kernel_fit CONFIG_DIR OUT.json [PLE_REQUEST PLE_OUT]``
in a fresh interpreter (the selftest does, with the patched vLLM tree first on the path); with the
last two, the interpreter first reads the PLE overlays back through vLLM (:mod:`.ple_formats`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import socket
import sys

CAPABILITIES = (86, 90)  # the RTX 3090; the H100/H200
_CHOOSER_MODULES = ("vllm.model_executor.kernels", "vllm.model_executor.layers.quantization",
                    "vllm.model_executor.layers.fused_moe.oracle", "vllm.model_executor.layers.fused_moe.experts")
STAND_IN = ("the CUDA platform as vLLM's kernel chooser sees it (a Platform with the CUDA enum and the "
            "capability under test): vLLM's CudaPlatform needs libcuda to import")


def _stand_in_class():
    from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

    class CapabilityStandIn(Platform):
        _enum = PlatformEnum.CUDA
        device_name = "cuda"
        device_type = "cuda"
        dispatch_key = "CUDA"
        capability = 86

        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(cls.capability // 10, cls.capability % 10)

    return CapabilityStandIn


@contextlib.contextmanager
def kernels_see_capability(capability: int):
    """``current_platform`` is the stand-in at ``capability`` in the chooser's modules (and for
    their lazy ``from vllm.platforms import current_platform``), and the CPU platform elsewhere."""
    import vllm.platforms as platforms

    for name in ("vllm.model_executor.layers.fused_moe.oracle.int_wna16",
                 "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
                 "compressed_tensors_moe_wna16",
                 "vllm.model_executor.kernels.linear"):
        importlib.import_module(name)
    real = platforms.current_platform
    stand_in_cls = _stand_in_class()
    stand_in_cls.capability = capability
    stand_in = stand_in_cls()
    swapped = [m for name, m in list(sys.modules.items())
               if m is not None and name.startswith(_CHOOSER_MODULES) and getattr(m, "current_platform", None) is real]
    for m in swapped:
        m.current_platform = stand_in
    previous = platforms._current_platform
    platforms._current_platform = stand_in
    try:
        yield
    finally:
        for m in swapped:
            m.current_platform = real
        platforms._current_platform = previous


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def one_rank(config) -> None:
    """vLLM's distributed state as one gloo rank, set up once per interpreter (the PLE read-back
    runs in the same interpreter before the kernel fit)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():
        with set_current_vllm_config(config):
            init_distributed_environment(world_size=1, rank=0,
                                         distributed_init_method="tcp://127.0.0.1:" + _free_port(), local_rank=0,
                                         backend="gloo")
            initialize_model_parallel(1, 1)
    torch.set_default_dtype(torch.bfloat16)


def _build(config_dir: str):
    """vLLM's config and model class for ``config_dir``, one gloo rank, ready to build."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.model_executor.model_loader.utils import configure_quant_config
    from vllm.model_executor.models import ModelRegistry

    model_config = ModelConfig(model=config_dir, max_model_len=4096, skip_tokenizer_init=True, dtype="bfloat16")
    config = VllmConfig(model_config=model_config, cache_config=CacheConfig())
    config.engram_config.cpu_offload = False  # the PLE table in (CPU) device memory: nothing to pin here
    one_rank(config)
    importlib.import_module("vllm.models.qwen4_exp.nvidia.model")
    qsa = importlib.import_module("vllm.models.qwen4_exp.nvidia.qsa")
    # QSA never runs flash-attn's varlen kernel over its cache; the probe only guards an import
    # that a CPU build lacks.
    qsa.is_flash_attn_varlen_func_available = lambda: True
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    if config.quant_config is not None:
        configure_quant_config(config.quant_config, model_cls)
    return config, model_cls


def _verdict(ok_reason) -> str:
    ok, reason = ok_reason
    return "ok" if ok else (reason or "refused")


def _linear_rows(name: str, layer, capability: int) -> dict:
    from vllm.model_executor.kernels.linear.mixed_precision.humming import HummingLinearKernel
    from vllm.model_executor.kernels.linear.mixed_precision.marlin import MarlinLinearKernel

    scheme = layer.scheme
    c = scheme.kernel.config
    marlin, humming = _verdict(MarlinLinearKernel.can_implement(c)), _verdict(HummingLinearKernel.can_implement(c))
    wanted = marlin if scheme.num_bits in (4, 8) else humming
    return {"layer": name, "kind": "linear", "weight_type": str(c.weight_type).removeprefix("ScalarType."),
            "group_size": c.group_size, "k": c.partition_weight_shape[0], "n": c.partition_weight_shape[1],
            "capability": capability, "kernel": type(scheme.kernel).__name__, "marlin": marlin, "humming": humming,
            "reasons": [] if wanted == "ok" else [f"{'Marlin' if scheme.num_bits in (4, 8) else 'Humming'}: {wanted}"],
            "fits": wanted == "ok"}


def _moe_row(name: str, layer, capability: int) -> dict:
    from vllm.model_executor.layers.quantization.utils.marlin_utils import check_moe_marlin_supports_config

    method, moe = layer.quant_method, layer.moe_config
    fits = check_moe_marlin_supports_config(moe, method.group_size, allow_tile_padding=True)
    marlin = "ok" if fits else (f"hidden {moe.hidden_dim} must be a multiple of 128 and the intermediate size "
                                f"{moe.intermediate_size_per_partition_unpadded} of the group size {method.group_size}")
    return {"layer": name, "kind": "moe", "weight_type": str(method.quant_type).removeprefix("ScalarType."),
            "group_size": method.group_size, "k": moe.hidden_dim, "n": moe.intermediate_size_per_partition_unpadded,
            "capability": capability, "kernel": f"{method.wna16_backend.value} ({method.experts_cls.__name__})",
            "marlin": marlin, "humming": "not used for the routed experts",
            "reasons": [] if fits else [f"Marlin MoE: {marlin}"], "fits": fits}


def check(config_dir: str, capabilities=CAPABILITIES) -> dict:
    """Build the model once per capability; every quantized layer's kernel and its verdict."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16 import (  # noqa: E501
        CompressedTensorsWNA16MoEMethod,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 import (
        CompressedTensorsWNA16,
    )

    config, model_cls = _build(config_dir)
    rows, errors = [], []
    for capability in capabilities:
        # A second build registers the same attention layers again: start from an empty context.
        config.compilation_config.static_forward_context.clear()
        with set_current_vllm_config(config), kernels_see_capability(capability):
            try:
                model = model_cls(vllm_config=config, prefix="")
            except (ValueError, NotImplementedError, AssertionError) as e:
                # vLLM's chooser found no kernel for a layer: its reasons are the message.
                errors.append(f"capability {capability / 10:.1f}: vLLM could not build the model: "
                              + " ".join(str(e).split())[:600])
                continue
            for name, module in model.named_modules():
                if isinstance(getattr(module, "scheme", None), CompressedTensorsWNA16) and module.scheme.kernel is not None:
                    rows.append(_linear_rows(name, module, capability))
                elif isinstance(getattr(module, "quant_method", None), CompressedTensorsWNA16MoEMethod):
                    rows.append(_moe_row(name, module, capability))
        del model
    return {"layers": rows, "errors": errors}


def ple_read_back(request_path: str, out: str) -> None:
    """The PLE formats' read-back (:func:`.ple_formats.read_back`), its result (or why it failed)
    written to ``out`` whatever happens, so that the kernel fit after it runs either way."""
    from pathlib import Path

    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    from flashnext.serving.selftest import ple_formats

    request = json.loads(Path(request_path).read_text())
    try:
        first = next(iter(request["views"].values()), None)
        if first is not None:
            model_config = ModelConfig(model=first, max_model_len=4096, skip_tokenizer_init=True, dtype="bfloat16")
            one_rank(VllmConfig(model_config=model_config, cache_config=CacheConfig()))
        result = {"formats": ple_formats.read_back(request, Path(out).parent)}
    except Exception as e:  # reported as the check's failure; the kernel fit still runs
        result = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
    Path(out).write_text(json.dumps(result))


def main(argv: list[str]) -> int:
    """``CONFIG_DIR OUT.json [PLE_REQUEST.json PLE_OUT.json]``: the kernel fit, after the PLE
    formats' read-back when asked (one interpreter: vLLM's import is paid once)."""
    config_dir, out, *ple = argv
    if ple:
        ple_read_back(*ple)
    result = check(config_dir)
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
