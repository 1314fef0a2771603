"""compressed-tensors INT8 group weights (``pack-quantized``, 8 bits) as vLLM quantization methods.

The release stores ``embed_tokens``, ``lm_head`` and the hyper-connection mixers' projections this
way (seed 000 §3.3, §6), and vLLM 0.34.0 builds those layers with a bf16 ``weight``. The methods
here keep the checkpoint's bytes as loaded (``weight_packed`` int32 words, ``weight_scale``,
``weight_shape``: 1 byte a weight plus a bf16 scale a group) and multiply through
:func:`flashnext.quant.kernels.decode_mma.int8_matmul`. Which layers get them is patch
int8-modules' decision (:mod:`flashnext.serving.hooks.int8_modules`).
"""

from __future__ import annotations

import torch

from flashnext import envs
from flashnext.quant.kernels.decode_mma import int8_matmul, int8_weights
from flashnext.serving.quantization.load_pattern import reallocate_as_repacked
from flashnext.serving.quantization.vllm_bases import (linear_method_base, loads_with_weight_loader_v2,
                                                       quantization_config_base, quantize_method_base)


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


class _Int8Matmul:
    """``apply`` for a layer holding INT8 words, shared by the linear and the embedding method
    (an LM head's logits are taken for the sampled rows only, a few per request: the kernel's case)."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = int8_matmul(x.reshape(-1, x.shape[-1]), layer.weight_packed, layer.weight_scale)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], -1)


@loads_with_weight_loader_v2
class Int8LinearMethod(_Int8Matmul, linear_method_base()):
    """compressed-tensors INT8 (group) weights for a linear layer, kept as stored."""

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        _int8_parameters(layer, sum(output_partition_sizes), input_size_per_partition, self.group_size,
                         params_dtype, extra_weight_attrs.get("weight_loader"))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        reallocate_as_repacked(layer)  # the words stay as loaded, and move once as a repack would


def vllm_lm_head_scheme(group_size: int, input_size_per_partition: int, output_partition_sizes: list[int],
                        input_size: int, output_size: int, params_dtype: torch.dtype):
    """vLLM's own ``CompressedTensorsWNA16`` scheme for an INT8 LM head of this shape, where vLLM's
    mixed-precision kernel chooser has a kernel for it on this platform (Marlin on the 3090; on
    Hopper whichever of Machete, Marlin and Humming it ranks first) and
    ``VLLM_INT8_LM_HEAD_KERNEL`` is ``vllm``; else None (the CPU: no INT8 kernel there)."""
    if envs.VLLM_INT8_LM_HEAD_KERNEL.get().strip().lower() != "vllm":
        return None
    from vllm.model_executor.kernels.linear import MPLinearLayerConfig, choose_mp_linear_kernel
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 import (
        WNA16_SUPPORTED_TYPES_MAP, CompressedTensorsWNA16)

    config = MPLinearLayerConfig(full_weight_shape=(input_size, output_size),
                                 partition_weight_shape=(input_size_per_partition, sum(output_partition_sizes)),
                                 weight_type=WNA16_SUPPORTED_TYPES_MAP[8], act_type=params_dtype,
                                 group_size=group_size, zero_points=False)
    try:
        choose_mp_linear_kernel(config)
    except ValueError:  # no kernel here for INT8 groups: flashnext's own
        return None
    return CompressedTensorsWNA16("group", 8, group_size, symmetric=True, layer_name="lm_head")


class Int8EmbeddingMethod(_Int8Matmul, quantize_method_base()):
    """compressed-tensors INT8 (group) weights for a vocabulary-parallel embedding or LM head.

    An embedding keeps the words as stored and dequantizes the step's rows. An LM head
    (``ParallelLMHead``) multiplies through vLLM's own kernel where its chooser has one
    (:func:`vllm_lm_head_scheme`: vLLM's scheme makes the parameters, repacks them after loading
    and runs the GEMM, so the choice stays vLLM's), and through flashnext's INT8 kernel only where
    it has none: measured on the H200, Humming took 204-219 us at the LM head against
    ``int8_mma``'s 234 (``docs/benchmarks.md``)."""

    def __init__(self, group_size: int):
        super().__init__(group_size)
        self.scheme = None

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        from vllm.model_executor.utils import set_weight_attrs

        attrs = dict(extra_weight_attrs)
        weight_loader = attrs.pop("weight_loader", None)
        if isinstance(layer, ParallelLMHead):
            self.scheme = vllm_lm_head_scheme(self.group_size, input_size_per_partition, output_partition_sizes,
                                              input_size, output_size, params_dtype)
        if self.scheme is not None:
            self.scheme.create_weights(layer, output_size=output_size, input_size=input_size,
                                       output_partition_sizes=output_partition_sizes,
                                       input_size_per_partition=input_size_per_partition,
                                       params_dtype=params_dtype, weight_loader=weight_loader)
            layer.scheme = self.scheme  # where vLLM's linear layers keep theirs (the selftest's kernel fit reads it)
        else:
            _int8_parameters(layer, sum(output_partition_sizes), input_size_per_partition, self.group_size,
                             params_dtype, weight_loader)
        for name in ("weight_packed", "weight_scale", "weight_shape"):
            set_weight_attrs(getattr(layer, name), attrs)

    @property
    def kernel(self) -> str:
        """What multiplies: vLLM's kernel class name, or flashnext's ``int8_matmul``."""
        return type(self.scheme.kernel).__name__ if self.scheme is not None else "int8_matmul"

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.scheme is not None:
            self.scheme.process_weights_after_loading(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.scheme is not None:
            return self.scheme.apply_weights(layer, x, bias)
        return super().apply(layer, x, bias)

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        if self.scheme is not None:
            raise RuntimeError("an LM head with vLLM's kernel holds repacked words: it is not an embedding")
        ids = input_.reshape(-1)  # only the step's rows are dequantized (decode_mma.gathered_rows_bytes)
        rows = int8_weights(layer.weight_packed[ids], layer.weight_scale[ids], layer.weight_scale.dtype)
        return rows.view(*input_.shape, -1)


class Int8LayersConfig(quantization_config_base()):
    """What a layer that vLLM builds with no quantization config is handed instead: every linear
    layer it builds gets :class:`Int8LinearMethod` with ``group_size``."""

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
