"""Patch int8-modules: the release's INT8 ``embed_tokens``, ``lm_head`` and hyper-connection
mixers, served as INT8.

The release stores ``embed_tokens`` and ``lm_head`` as compressed-tensors INT8, group 128, and the
hyper-connection mixers' projections as INT8, group 64 (``weight_packed`` int32 words,
``weight_scale``, ``weight_shape``; seed 000 §3.3, §6). vLLM 0.33.0 builds all of them without a
quantization method, with a bf16 ``weight``, so its own loader refuses the checkpoint
(``There is no module or parameter named 'embed_tokens.weight_packed'``; for the mixers an
AttributeError in the merged layer's loader). With ``VLLM_INT8_MODULES=1`` (the default), where the
checkpoint's quantization config gives a layer's name a symmetric INT8 group scheme:

* ``embed_tokens`` and ``lm_head`` get :class:`Int8EmbeddingMethod`: the embedding gathers the
  packed rows of the step's tokens and dequantizes just those; the LM head multiplies through
  :func:`flashnext.quant.kernels.decode_mma.int8_mma` (tensor cores, 16 rows a launch);
* the mixers' linear layers get :class:`Int8LinearMethod` (through :func:`hc_quant_config`):
  ``int8_mma`` for decode batches, a dequantized bf16 GEMM for prefill. Patch decode-04
  (:mod:`.hc_decode`) reads the same words in its fused kernels.

All keep the checkpoint's bytes in memory: 1 byte per weight plus a bf16 scale per group.
"""

from __future__ import annotations

import torch

from flashnext import envs
from flashnext.quant.formats.ct_config import symmetric_int_group_size, vllm_scheme
from flashnext.quant.formats.packing import dequantize_groups, unpack_int32
from flashnext.quant.kernels._common import INTERPRETED
from flashnext.quant.kernels.decode_mma import MMA_MAX_TOKENS as MAX_TOKENS
from flashnext.quant.kernels.decode_mma import int8_mma
from flashnext.serving.hooks.vllm_bases import (linear_method_base, loads_with_weight_loader_v2,
                                                quantization_config_base, quantize_method_base)
from flashnext.serving.hooks.vllm_names import rename_mapper


def enabled() -> bool:
    return envs.VLLM_INT8_MODULES.enabled()


def int8_group_size(quant_config, prefix: str, mapper=None) -> int | None:
    """The group size when ``quant_config`` (vLLM's compressed-tensors config, which vLLM has
    already mapped into its module names) quantizes vLLM's module ``prefix`` as symmetric INT8 by
    groups, else None: :func:`~flashnext.quant.formats.ct_config.vllm_scheme`, the rule the
    builders resolve checkpoint names by, with ``mapper`` the model's rename mapper (by default
    the one vLLM applied: :func:`~.vllm_names.rename_mapper`)."""
    if not getattr(quant_config, "target_scheme_map", None):
        return None
    scheme = vllm_scheme(quant_config, prefix, rename_mapper() if mapper is None else mapper)
    return symmetric_int_group_size(scheme, 8)


def embedding_method(quant_config, prefix: str):
    """The quantization method for ``embed_tokens`` or ``lm_head`` at ``prefix``: INT8 where the
    checkpoint stores it so and the switch is on, else None (vLLM's own choice)."""
    if not enabled() or quant_config is None:
        return None
    group = int8_group_size(quant_config, prefix)
    return Int8EmbeddingMethod(group) if group else None


# Above this many weights a prefill GEMM goes through the kernel 16 rows at a time rather than
# materialise a bf16 copy (the LM head: 0.6 G weights).
DEQUANTIZE_LIMIT = 1 << 26


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weights ``q * s`` of compressed-tensors INT8 words (``int32 [rows, K/4]``), each rounded once."""
    return dequantize_groups(unpack_int32(packed, 8, packed.shape[1] * 4), scale, dtype)


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for ``x [M, K]``: the INT8 tensor-core kernel for decode batches and very large
    weights (16 rows a launch), else a bf16 GEMM over the dequantized weights."""
    kernel = x.is_cuda or INTERPRETED  # a CPU backend has no Triton
    if x.shape[0] and kernel and (x.shape[0] <= MAX_TOKENS or packed.numel() * 4 > DEQUANTIZE_LIMIT):
        return torch.cat([int8_mma(chunk, packed, scale) for chunk in x.split(MAX_TOKENS)])
    return torch.nn.functional.linear(x, dequantize(packed, scale, x.dtype))


def _int8_parameters(layer: torch.nn.Module, rows: int, cols: int, group: int, dtype: torch.dtype,
                     weight_loader=None) -> None:
    """``weight_packed``, ``weight_scale`` and ``weight_shape`` as compressed-tensors stores them,
    as vLLM parameters (so merged layers load each shard into its rows); zeros, so rows no
    checkpoint tensor fills (alignment padding) multiply to zero."""
    from vllm.model_executor.parameter import BasevLLMParameter, GroupQuantScaleParameter, PackedvLLMParameter

    if cols % 4 or cols % group:
        raise ValueError(f"INT8 {layer.__class__.__name__}: width {cols} is not a multiple of 4 and of the "
                         f"group size {group}")
    layer.register_parameter("weight_packed", PackedvLLMParameter(
        data=torch.zeros(rows, cols // 4, dtype=torch.int32), input_dim=1, output_dim=0, packed_dim=1,
        packed_factor=4, weight_loader=weight_loader))
    layer.register_parameter("weight_scale", GroupQuantScaleParameter(
        data=torch.zeros(rows, cols // group, dtype=dtype), input_dim=1, output_dim=0, weight_loader=weight_loader))
    layer.register_parameter("weight_shape", BasevLLMParameter(
        data=torch.empty(2, dtype=torch.int64), weight_loader=weight_loader))


@loads_with_weight_loader_v2
class Int8LinearMethod(linear_method_base()):
    """compressed-tensors INT8 (group) weights for a linear layer, kept as stored."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        _int8_parameters(layer, sum(output_partition_sizes), input_size_per_partition, self.group_size,
                         params_dtype, extra_weight_attrs.get("weight_loader"))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = int8_linear(x.reshape(-1, x.shape[-1]), layer.weight_packed, layer.weight_scale)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], -1)


class Int8LayersConfig(quantization_config_base()):
    """What a linear layer that vLLM builds with no quantization config is handed instead: every
    linear layer it builds gets :class:`Int8LinearMethod`."""

    def __init__(self, group_size: int):
        super().__init__()
        self.group_size = group_size

    def get_name(self) -> str:
        return "flashnext-int8"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 75

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict):
        raise NotImplementedError("built by flashnext.serving.hooks.int8_modules.hc_quant_config, not from a file")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.linear import LinearBase

        return Int8LinearMethod(self.group_size) if isinstance(layer, LinearBase) else None


def hc_quant_config(prefix: str, checkpoint_names: list[str]) -> Int8LayersConfig | None:
    """The quantization config for a hyper-connection projection at ``prefix`` that the checkpoint
    stores as ``checkpoint_names`` (two for the merged down/inject layer): INT8 where the current
    vLLM config quantizes every one of them as an INT8 group scheme and the switch is on, else None
    (vLLM's bf16 layer)."""
    from vllm.config import get_current_vllm_config

    quant_config = get_current_vllm_config().quant_config
    if not enabled() or quant_config is None:
        return None
    parent = prefix.rpartition(".")[0]
    groups = {int8_group_size(quant_config, f"{parent}.{name}" if parent else name) for name in checkpoint_names}
    if len(groups) != 1 or None in groups:
        return None
    return Int8LayersConfig(groups.pop())


class Int8EmbeddingMethod(quantize_method_base()):
    """compressed-tensors INT8 (group) weights for a vocabulary-parallel embedding or LM head."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        from vllm.model_executor.utils import set_weight_attrs

        attrs = dict(extra_weight_attrs)
        _int8_parameters(layer, sum(output_partition_sizes), input_size_per_partition, self.group_size, params_dtype,
                         attrs.pop("weight_loader", None))
        for name in ("weight_packed", "weight_scale", "weight_shape"):
            set_weight_attrs(getattr(layer, name), attrs)

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        rows = dequantize(layer.weight_packed[input_.reshape(-1)], layer.weight_scale[input_.reshape(-1)],
                          layer.weight_scale.dtype)
        return rows.view(*input_.shape, -1)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # Logits are taken for the sampled rows only (a few per request): the kernel's case.
        out = int8_linear(x.reshape(-1, x.shape[-1]), layer.weight_packed, layer.weight_scale)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], -1)
