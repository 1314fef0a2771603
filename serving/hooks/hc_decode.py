"""Patch decode-04: a decode step's hyper-connection mix in two fused kernels.

vLLM 0.34.0 runs each GatedResidual mix as a GEMM, ``hc_silu``, a second GEMM and ``hc_gate_mix``
(six kernels, about 32 us on a 3090, 96 times a token; seed 000 §3.3). When the mixer's projections
are INT8 (patch int8-modules) and the step has 1..16 tokens, :func:`mix` runs the same arithmetic,
rounded at the same points, in :func:`flashnext.quant.kernels.hc_mix.hc_mix`'s two kernels, which
read the checkpoint's INT8 words in place. Otherwise it returns None and vLLM's path runs.
``VLLM_HC_FUSED_DECODE=0`` turns it off.
"""

from __future__ import annotations

import torch

from flashnext import envs
from flashnext.quant.kernels._common import can_launch
from flashnext.quant.kernels.decode_mma import MMA_MAX_TOKENS
from flashnext.quant.kernels.hc_mix import HC_COUNT, hc_mix
from flashnext.serving.quantization.int8 import Int8LinearMethod


def enabled() -> bool:
    return envs.VLLM_HC_FUSED_DECODE.enabled()


def mix(module: torch.nn.Module, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(block_input, injection)`` of vLLM's ``GatedResidual`` ``module`` for the normalized
    streams ``xn``, or None where the fused kernels do not apply."""
    if (not enabled() or module.hc_count != HC_COUNT or xn.dtype != torch.bfloat16
            or not can_launch(xn, MMA_MAX_TOKENS)):
        return None
    import vllm.envs

    if vllm.envs.VLLM_BATCH_INVARIANT:  # vLLM's own fused HC kernel stands aside here too
        return None
    down = module.input_mix_weight_down_block_inject if module.use_combine else module.input_mix_weight_down
    up = module.input_mix_weight_up
    if not all(isinstance(layer.quant_method, Int8LinearMethod) for layer in (down, up)):
        return None
    return hc_mix(xn, (down.weight_packed, down.weight_scale), (up.weight_packed, up.weight_scale),
                  module.hc_lowrank, module.hc_count)
