"""Checkpoint module names in the names of the vLLM model being built.

vLLM maps a checkpoint's names into its own through the model class's ``hf_to_vllm_mapper``, and
applies the same mapper to the quantization config before any layer asks it for a scheme
(``configure_quant_config``). The hooks decide per vLLM layer from facts the checkpoint states in
its own names (the bit-plane record, the quantization config's top-level targets), so they map
those through that same mapper, looked up the way vLLM looks it up, rather than through a rule
of their own.
"""

from __future__ import annotations


def rename_mapper(model_config=None):
    """The rename mapper vLLM applies to the quantization config of ``model_config``'s model (by
    default the current vLLM config's): its class's ``hf_to_vllm_mapper.get_rename_mapper()``.
    None where there is no model config or the class maps no names."""
    if model_config is None:
        from vllm.config import get_current_vllm_config

        model_config = get_current_vllm_config().model_config
    if model_config is None:
        return None
    from vllm.model_executor.models import ModelRegistry

    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config=model_config)
    mapper = getattr(model_cls, "hf_to_vllm_mapper", None)
    return None if mapper is None else mapper.get_rename_mapper()
