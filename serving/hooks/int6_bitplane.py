"""Patch int6-bitplane: serve the modules that ``flashnext repack-int6`` rewrote as INT6 bit planes.

A bit-plane overlay changes each listed module's ``weight_packed`` from compressed-tensors' dense
6-bit words to ``uint8 [N, 3K/4]`` planes (:mod:`flashnext.quant.formats.bitplane`) and lists the
modules in config.json (``flashnext.int6_bitplane``). vLLM 0.33.0's compressed-tensors INT6 scheme
refuses the planes on shape, so compressed-tensors' ``get_quant_method`` asks :func:`linear_method`
first, and the listed modules get :class:`BitplaneLinearMethod`:

* ``VLLM_INT6_BITPLANE=1`` (the default): the planes stay as loaded, and decode batches (1..16
  tokens) multiply through :func:`flashnext.quant.kernels.decode_mma.bitplane_matmul`; prefill
  through a bf16 GEMM over the dequantized weights;
* ``VLLM_INT6_BITPLANE=0``: after loading, the planes become the dense words again (the same bytes
  the original snapshot holds) and vLLM's own INT6 scheme takes over, so the dense path is the
  fallback with the overlay still applied.

The record lists checkpoint names (``model.language_model.layers.0...``); they are mapped into
vLLM's (``language_model.model.layers.0...``) by the model's own mapper, as vLLM maps the
quantization config (:mod:`.vllm_names`), and matched as compressed-tensors matches targets
(:func:`~flashnext.quant.formats.ct_config.covered_by`): a layer vLLM merges (``gate_up_proj`` from
``gate_proj`` and ``up_proj``) is bit-plane when all of its parts are listed (some but not all is
refused).
"""

from __future__ import annotations

import torch

from flashnext import envs
from flashnext.errors import FlashnextError
from flashnext.quant.formats.bitplane import BitplaneRecord, bitplane_to_codes, bitplane_to_dense6
from flashnext.quant.formats.ct_config import covered_by, vllm_module_name
from flashnext.quant.formats.packing import dequantize_groups
from flashnext.quant.kernels._common import INTERPRETED
from flashnext.quant.kernels.decode_mma import MMA_MAX_TOKENS as MAX_TOKENS
from flashnext.quant.kernels.decode_mma import bitplane_matmul, warm_bitplane_matmul
from flashnext.serving.hooks.vllm_bases import linear_method_base, loads_with_weight_loader_v2
from flashnext.serving.hooks.vllm_names import rename_mapper


def enabled() -> bool:
    return envs.VLLM_INT6_BITPLANE.enabled()


def _compiles_kernels(weights: torch.Tensor) -> bool:
    """Whether launching a kernel on ``weights`` compiles and loads it (on a GPU, not the interpreter)."""
    return weights.is_cuda


def recorded_modules(hf_config) -> set[str]:
    """The module names config.json's ``flashnext.int6_bitplane`` lists (empty without one); a
    record of another layout is refused (:class:`~flashnext.quant.formats.bitplane.BitplaneRecord`)."""
    record = BitplaneRecord.from_config(hf_config)
    return set() if record is None else set(record.modules)


_PARTLY_LISTED = ("{name}: the bit-plane overlay lists only some of {shards}, which vLLM merges into one layer; "
                  "repack all of them or none")


def bitplane_parts(prefix: str, packed_modules_mapping: dict[str, list[str]], recorded: set[str],
                   mapper=None) -> bool:
    """Whether vLLM's linear layer ``prefix`` holds bit-plane weights: its checkpoint module (or
    every part of a merged layer) is listed. ``mapper``: the model's rename mapper, which gives
    the listed checkpoint names in vLLM's names (None: the same names)."""
    listed = sorted(vllm_module_name(m, mapper) for m in recorded)
    return covered_by(listed, prefix, packed_modules_mapping, refusal=_PARTLY_LISTED)


def linear_method(quant_config, prefix: str, method):
    """The method for the linear layer at ``prefix`` that compressed-tensors chose (``method``, its
    scheme on ``layer.scheme``): :class:`BitplaneLinearMethod` for a listed INT6 module, else
    ``method`` unchanged."""
    from vllm.config import get_current_vllm_config

    model_config = get_current_vllm_config().model_config
    recorded = recorded_modules(model_config.hf_config) if model_config is not None else set()
    if not recorded or not bitplane_parts(prefix, getattr(quant_config, "packed_modules_mapping", {}) or {},
                                          recorded, rename_mapper(model_config)):
        return method
    return BitplaneLinearMethod(quant_config)


@loads_with_weight_loader_v2
class BitplaneLinearMethod(linear_method_base()):
    """INT6 bit-plane weights for a linear layer whose compressed-tensors scheme is on ``layer.scheme``."""

    def __init__(self, quant_config):
        self.quant_config = quant_config
        self.planes_kept = enabled()

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
        if 1 <= flat.shape[0] <= MAX_TOKENS and (flat.is_cuda or INTERPRETED):
            out = bitplane_matmul(flat, layer.weight_packed, layer.weight_scale).to(x.dtype)
        else:
            weights = dequantize_groups(bitplane_to_codes(layer.weight_packed, layer.bitplane_cols),
                                        layer.weight_scale, x.dtype)
            out = torch.nn.functional.linear(flat, weights)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], -1)
