"""INT6 bit-plane weights (:mod:`flashnext.quant.formats.bitplane`) as a vLLM linear method.

vLLM 0.34.0's compressed-tensors INT6 scheme refuses the planes on shape (``uint8 [N, 3K/4]``
where it expects dense 6-bit words), so a layer that holds them needs its own method. The
compressed-tensors scheme vLLM chose stays on ``layer.scheme``: it says the group size, and with
the planes not kept it does the work (the planes turned back into its dense words after loading),
so the dense path stays a switch away with the overlay still applied. Which layers hold planes is
patch int6-bitplane's decision (:mod:`flashnext.serving.hooks.int6_bitplane`).
"""

from __future__ import annotations

import torch

from flashnext.errors import FlashnextError
from flashnext.quant.formats.bitplane import bitplane_to_codes, bitplane_to_dense6
from flashnext.quant.formats.packing import dequantize_groups
from flashnext.quant.kernels._common import can_launch
from flashnext.quant.kernels.decode_mma import bitplane_matmul, warm_bitplane_matmul
from flashnext.serving.quantization.load_pattern import reallocate_as_repacked
from flashnext.serving.quantization.vllm_bases import linear_method_base, loads_with_weight_loader_v2


def _compiles_kernels(weights: torch.Tensor) -> bool:
    """Whether launching a kernel on ``weights`` compiles and loads it (on a GPU, not the interpreter)."""
    return weights.is_cuda


@loads_with_weight_loader_v2
class BitplaneLinearMethod(linear_method_base()):
    """INT6 bit-plane weights for a linear layer whose compressed-tensors scheme is on ``layer.scheme``.

    ``planes_kept``: multiply by the planes as loaded, every batch through
    :func:`~flashnext.quant.kernels.decode_mma.bitplane_matmul` (decode kernels up to 16 tokens,
    the tiled prefill GEMM above); otherwise hand the layer to the scheme over the dense words."""

    def __init__(self, quant_config, planes_kept: bool):
        self.quant_config = quant_config
        self.planes_kept = planes_kept

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        from vllm.model_executor.parameter import (BasevLLMParameter, GroupQuantScaleParameter,
                                                   ModelWeightParameter)

        scheme = layer.scheme
        if getattr(scheme, "num_bits", None) != 6 or not scheme.symmetric or scheme.group_size <= 0:
            raise FlashnextError(f"{layer.prefix}: the bit-plane overlay lists it, but the checkpoint's "
                                 "quantization config does not make it symmetric INT6 by groups")
        if input_size_per_partition != input_size:
            raise FlashnextError(f"{layer.prefix}: bit-plane rows cannot be split along K (tensor-parallel "
                                 "row split); serve it with tensor parallelism 1 or without the overlay")
        loader = extra_weight_attrs.get("weight_loader")
        rows, cols = sum(output_partition_sizes), input_size_per_partition
        if cols % 16 or cols % scheme.group_size:
            raise FlashnextError(f"{layer.prefix}: K={cols} does not fit the bit-plane layout in groups of "
                                 f"{scheme.group_size}")
        if not self.planes_kept:  # vLLM's own INT6 parameters and kernel, with planes loaded in their place
            scheme.create_weights(layer=layer, input_size=input_size, input_size_per_partition=cols,
                                  output_partition_sizes=output_partition_sizes, output_size=output_size,
                                  params_dtype=params_dtype, weight_loader=loader)
        else:
            layer.register_parameter("weight_scale", GroupQuantScaleParameter(
                data=torch.zeros(rows, cols // scheme.group_size, dtype=params_dtype), input_dim=1, output_dim=0,
                weight_loader=loader))
            layer.register_parameter("weight_shape", BasevLLMParameter(
                data=torch.empty(2, dtype=torch.int64), weight_loader=loader))
        layer.register_parameter("weight_packed", ModelWeightParameter(
            data=torch.zeros(rows, cols * 3 // 4, dtype=torch.uint8), input_dim=1, output_dim=0,
            weight_loader=loader))
        layer.bitplane_cols = cols

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.planes_kept:
            # both planes in one region of the dense words' size, moved once as a repack would
            reallocate_as_repacked(layer)
            if _compiles_kernels(layer.weight_packed):
                warm_bitplane_matmul(layer.weight_packed, layer.weight_scale)
            return
        from vllm.model_executor.parameter import PackedvLLMParameter

        dense = bitplane_to_dense6(layer.weight_packed.data, layer.bitplane_cols)
        layer.weight_packed = PackedvLLMParameter(data=dense, input_dim=1, output_dim=0, packed_dim=1,
                                                  packed_factor=layer.scheme.pack_factor,
                                                  weight_loader=layer.weight_packed.weight_loader)
        layer.scheme.process_weights_after_loading(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.planes_kept:
            return layer.scheme.apply_weights(layer, x, bias)
        flat = x.reshape(-1, x.shape[-1])
        if can_launch(flat, flat.shape[0]):
            out = bitplane_matmul(flat, layer.weight_packed, layer.weight_scale).to(x.dtype)
        else:  # off CUDA without the interpreter (vLLM's CPU build): no Triton
            weights = dequantize_groups(bitplane_to_codes(layer.weight_packed, layer.bitplane_cols),
                                        layer.weight_scale, x.dtype)
            out = torch.nn.functional.linear(flat, weights)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], -1)
