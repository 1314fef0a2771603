"""compressed-tensors as vLLM reads it, with the layers flashnext's overlays rewrote given their own
methods: registered through vLLM's ``register_quantization_config`` under compressed-tensors' own
name, so checkpoints keep ``quant_method: compressed-tensors`` and need no ``--quantization``.

vLLM's registry lets a registered config replace a built-in one of the same name (its
``get_quantization_config`` lays the registered configs over its own table), which is how a
plugin extends a quantization method without a diff: :class:`FlashnextCompressedTensorsConfig` is
vLLM's ``CompressedTensorsConfig`` (every scheme, loader and kernel choice its own), and only asks
:func:`flashnext.serving.hooks.int6_bitplane.linear_method` about the linear layers vLLM gives a
``CompressedTensorsLinearMethod``.
"""

from __future__ import annotations

from functools import cache

# compressed-tensors' name in vLLM's registry and in a checkpoint's quantization_config.
QUANT_METHOD = "compressed-tensors"


@cache
def config_class():
    """The registered config class (built on first use: its base is vLLM's, imported then)."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
        CompressedTensorsLinearMethod,
    )

    from flashnext.serving.hooks import int6_bitplane

    class FlashnextCompressedTensorsConfig(CompressedTensorsConfig):
        """vLLM's compressed-tensors config; a bit-plane overlay's INT6 layers get their method."""

        def get_quant_method(self, layer, prefix: str):
            method = super().get_quant_method(layer, prefix)
            # exactly vLLM's linear method: a transform method (or any other) is left as chosen
            if type(method) is CompressedTensorsLinearMethod:
                return int6_bitplane.linear_method(self, prefix, method)
            return method

    return FlashnextCompressedTensorsConfig


def register() -> None:
    """Patch int6-bitplane's plugin registration (idempotent: vLLM may load plugins again)."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    register_quantization_config(QUANT_METHOD)(config_class())
