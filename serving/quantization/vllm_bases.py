"""vLLM's base classes for the quantization methods of this folder, which the hooks choose. A method
module is imported from inside a patched vLLM; fetching the bases through these functions keeps
vLLM out of the import of anything else in flashnext (the command lines never import it). It sits
here, under the hooks, so that both the methods and the hooks import it downward
(docs/architecture.md, "The layers")."""

from __future__ import annotations


def quantize_method_base():
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    return QuantizeMethodBase


def linear_method_base():
    from vllm.model_executor.layers.linear import LinearMethodBase

    return LinearMethodBase


def quantization_config_base():
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    return QuantizationConfig


def loads_with_weight_loader_v2(cls):
    """Register a linear method with vLLM's list of those whose layers load through
    ``weight_loader_v2`` (parameter classes that know their shards)."""
    from vllm.model_executor.layers.linear import register_weight_loader_v2_supported_method

    return register_weight_loader_v2_supported_method(cls)
