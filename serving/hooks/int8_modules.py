"""Patch int8-modules: the release's INT8 ``embed_tokens`` and ``lm_head``, served as INT8.

The release stores ``embed_tokens`` and ``lm_head`` as compressed-tensors INT8, group 128
(``weight_packed`` int32 words, ``weight_scale``, ``weight_shape``; seed 000 §3.3, §7). vLLM 0.33.0
builds both without a quantization method, with a bf16 ``weight``, so its own loader refuses the
checkpoint (``There is no module or parameter named 'embed_tokens.weight_packed'``). With
``VLLM_INT8_MODULES=1`` (the default) the model hands both layers :class:`Int8EmbeddingMethod`
when the checkpoint's quantization config gives their names an INT8 group scheme:

* the embedding gathers the packed rows of the step's tokens and dequantizes just those;
* the LM head multiplies through :func:`flashnext.quant.kernels.decode_mma.int8_mma` (tensor
  cores, 16 rows a launch).

Both keep the checkpoint's bytes in memory: 1 byte per weight plus a bf16 scale per 128.
"""

from __future__ import annotations

import re

import torch
from torch.nn import Parameter

from flashnext import envs


def enabled() -> bool:
    return envs.VLLM_INT8_MODULES.enabled()


def _matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.fullmatch(target[3:], name) is not None
    return name == target or name.endswith("." + target)


def int8_group_size(quant_config, prefix: str) -> int | None:
    """The group size when ``quant_config`` (compressed-tensors) quantizes ``prefix`` as symmetric
    INT8 by groups, else None. vLLM's and the checkpoint's names differ in their leading parts
    (``language_model.model.embed_tokens`` against ``model.language_model.embed_tokens``), so a
    target matches the name or its trailing parts, as the release's targets are written."""
    schemes = getattr(quant_config, "target_scheme_map", None)
    if not schemes:
        return None
    candidates = [prefix] + [prefix.split(".", i)[-1] for i in range(1, prefix.count(".") + 1)]
    if any(_matches(t, name) for t in getattr(quant_config, "ignore", None) or () for name in candidates):
        return None
    for target, scheme in schemes.items():
        if any(_matches(target, name) for name in candidates):
            weights = scheme.get("weights")
            if (weights is not None and weights.num_bits == 8 and str(weights.type).endswith("int")
                    and weights.symmetric and str(weights.strategy).endswith("group") and weights.group_size):
                return int(weights.group_size)
            return None
    return None


def embedding_method(quant_config, prefix: str):
    """The quantization method for ``embed_tokens`` or ``lm_head`` at ``prefix``: INT8 where the
    checkpoint stores it so and the switch is on, else None (vLLM's own choice)."""
    if not enabled() or quant_config is None:
        return None
    group = int8_group_size(quant_config, prefix)
    return Int8EmbeddingMethod(group) if group else None


def _method_base():
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    return QuantizeMethodBase


class Int8EmbeddingMethod(_method_base()):
    """compressed-tensors INT8 (group) weights for a vocabulary-parallel embedding or LM head."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        from vllm.model_executor.utils import set_weight_attrs

        rows = sum(output_partition_sizes)
        if input_size_per_partition % 4 or input_size_per_partition % self.group_size:
            raise ValueError(f"INT8 {layer.__class__.__name__}: width {input_size_per_partition} is not a multiple "
                             f"of 4 and of the group size {self.group_size}")
        packed = Parameter(torch.empty(rows, input_size_per_partition // 4, dtype=torch.int32), requires_grad=False)
        scale = Parameter(torch.empty(rows, input_size_per_partition // self.group_size, dtype=params_dtype),
                          requires_grad=False)
        shape = Parameter(torch.empty(2, dtype=torch.int64), requires_grad=False)
        for name, param, attrs in (("weight_packed", packed, {"output_dim": 0, "input_dim": 1}),
                                   ("weight_scale", scale, {"output_dim": 0, "input_dim": 1}),
                                   ("weight_shape", shape, {})):
            layer.register_parameter(name, param)
            set_weight_attrs(param, {**attrs, **extra_weight_attrs})

    def dequantize_rows(self, layer: torch.nn.Module, rows: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 rows of the weight (all of them, or ``rows``), each exactly ``q * scale`` rounded once."""
        packed = layer.weight_packed if rows is None else layer.weight_packed[rows]
        scale = layer.weight_scale if rows is None else layer.weight_scale[rows]
        codes = packed.contiguous().view(torch.uint8).view(*packed.shape[:-1], -1).to(torch.int16) - 128
        groups = codes.view(*codes.shape[:-1], scale.shape[-1], self.group_size).float()
        return (groups * scale.float().unsqueeze(-1)).view(codes.shape).to(scale.dtype)

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return self.dequantize_rows(layer, input_)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from flashnext.quant.kernels.decode_mma import INTERPRETED, MAX_TOKENS, int8_mma

        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] and (flat.is_cuda or INTERPRETED):
            # Logits are taken for the sampled rows only (a few per request), so this is the path.
            out = torch.cat([int8_mma(chunk, layer.weight_packed, layer.weight_scale)
                             for chunk in flat.split(MAX_TOKENS)])
        else:  # a CPU backend with no Triton
            out = torch.nn.functional.linear(flat, self.dequantize_rows(layer))
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], -1)
