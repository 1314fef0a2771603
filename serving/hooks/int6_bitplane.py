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

Checkpoint and vLLM names differ in their leading parts (``model.language_model.layers.0...``
against ``language_model.model.layers.0...``) and vLLM merges some projections (``gate_up_proj``
from ``gate_proj`` and ``up_proj``); a module is matched from its ``layers.N`` part on, and a merged
layer is bit-plane when all of its parts are listed (some but not all is refused).
"""

from __future__ import annotations

import torch

from flashnext import envs
from flashnext.errors import FlashnextError
from flashnext.quant.formats.bitplane import LAYOUT, bitplane_to_codes, bitplane_to_dense6
from flashnext.quant.formats.packing import dequantize_groups
from flashnext.quant.kernels.decode_mma import INTERPRETED, MAX_TOKENS, bitplane_matmul, warm_bitplane_matmul
from flashnext.serving.hooks.vllm_bases import linear_method_base, loads_with_weight_loader_v2


def enabled() -> bool:
    return envs.VLLM_INT6_BITPLANE.enabled()


def _compiles_kernels(weights: torch.Tensor) -> bool:
    """Whether launching a kernel on ``weights`` compiles and loads it (on a GPU, not the interpreter)."""
    return weights.is_cuda


def recorded_modules(hf_config) -> set[str]:
    """The module names config.json's ``flashnext.int6_bitplane`` lists (empty without one); a
    record of another layout is refused."""
    section = getattr(hf_config, "flashnext", None)
    record = section.get("int6_bitplane") if isinstance(section, dict) else None
    if not record:
        return set()
    if record.get("layout") != LAYOUT:
        raise FlashnextError(f"config.json: flashnext.int6_bitplane has layout {record.get('layout')!r}; this "
                             f"flashnext serves {LAYOUT!r}. Rebuild the overlay with this version's repack-int6.")
    return set(record.get("modules", []))


def _layer_key(name: str) -> str | None:
    """``name`` from its ``layers.N`` part on (``layers.0.mlp.shared_expert.gate_proj``), with a
    leading ``mtp.`` kept apart; None for a name with no layer index."""
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            return ("mtp:" if parts[0] == "mtp" else "") + ".".join(parts[i:])
    return None


def bitplane_parts(prefix: str, packed_modules_mapping: dict[str, list[str]], recorded: set[str]) -> bool:
    """Whether vLLM's linear layer ``prefix`` holds bit-plane weights: its checkpoint part (or every
    part of a merged layer) is listed."""
    keys = {k for k in map(_layer_key, recorded) if k}
    head, _, last = prefix.rpartition(".")
    parts = [f"{head}.{p}" if head else p for p in packed_modules_mapping.get(last, [last])]
    listed = [_layer_key(p) in keys for p in parts]
    if any(listed) and not all(listed):
        raise FlashnextError(f"{prefix}: the bit-plane overlay lists only some of {parts}, which vLLM merges "
                             "into one layer; repack all of them or none")
    return all(listed)


def linear_method(quant_config, prefix: str, method):
    """The method for the linear layer at ``prefix`` that compressed-tensors chose (``method``, its
    scheme on ``layer.scheme``): :class:`BitplaneLinearMethod` for a listed INT6 module, else
    ``method`` unchanged."""
    from vllm.config import get_current_vllm_config

    model_config = get_current_vllm_config().model_config
    recorded = recorded_modules(model_config.hf_config) if model_config is not None else set()
    if not recorded or not bitplane_parts(prefix, getattr(quant_config, "packed_modules_mapping", {}) or {},
                                          recorded):
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
