"""Patch int8-modules: the release's INT8 ``embed_tokens``, ``lm_head`` and hyper-connection
mixers, served as INT8.

The release stores ``embed_tokens`` and ``lm_head`` as compressed-tensors INT8, group 128, and the
hyper-connection mixers' projections as INT8, group 64 (``weight_packed`` int32 words,
``weight_scale``, ``weight_shape``; seed 000 §3.3, §6). vLLM 0.34.0 builds all of them without a
quantization method, with a bf16 ``weight``, so its own loader refuses the checkpoint
(``There is no module or parameter named 'embed_tokens.weight_packed'``; for the mixers an
AttributeError in the merged layer's loader). With ``VLLM_INT8_MODULES=1`` (the default), where the
checkpoint's quantization config gives a layer's name a symmetric INT8 group scheme:

* ``embed_tokens`` and ``lm_head`` get :class:`~flashnext.serving.quantization.int8.Int8EmbeddingMethod`
  (:func:`embedding_method`): the embedding gathers the packed rows of the step's tokens and
  dequantizes just those; the LM head multiplies through the INT8 tensor-core kernel;
* the mixers' linear layers get :class:`~flashnext.serving.quantization.int8.Int8LinearMethod`
  (through :func:`hc_quant_config`): the kernel for decode batches, a dequantized bf16 GEMM for
  prefill. Patch decode-04 (:mod:`.hc_decode`) reads the same words in its fused kernels.

The methods live in :mod:`flashnext.serving.quantization.int8`; this module decides which layers
get them.
"""

from __future__ import annotations

from flashnext import envs
from flashnext.quant.formats.ct_config import symmetric_int_group_size, vllm_scheme
from flashnext.serving.hooks.vllm_names import rename_mapper
from flashnext.serving.quantization.int8 import Int8EmbeddingMethod, Int8LayersConfig


def enabled() -> bool:
    return envs.VLLM_INT8_MODULES.enabled()


def int8_group_size(quant_config, prefix: str, mapper) -> int | None:
    """The group size when ``quant_config`` (vLLM's compressed-tensors config, which vLLM has
    already mapped into its module names) quantizes vLLM's module ``prefix`` as symmetric INT8 by
    groups, else None: :func:`~flashnext.quant.formats.ct_config.vllm_scheme`, the rule the
    builders resolve checkpoint names by, with ``mapper`` the rename mapper vLLM applied to this
    config (:func:`~.vllm_names.rename_mapper` of the model being built; None: names unmapped)."""
    if not getattr(quant_config, "target_scheme_map", None):
        return None
    return symmetric_int_group_size(vllm_scheme(quant_config, prefix, mapper), 8)


def embedding_method(quant_config, prefix: str, model_config=None):
    """The quantization method for ``embed_tokens`` or ``lm_head`` at ``prefix`` of the model
    ``model_config`` describes (by default the current vLLM config's): INT8 where the checkpoint
    stores it so and the switch is on, else None (vLLM's own choice)."""
    if not enabled() or quant_config is None:
        return None
    group = int8_group_size(quant_config, prefix, rename_mapper(model_config))
    return Int8EmbeddingMethod(group) if group else None


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
    mapper = rename_mapper()
    groups = {int8_group_size(quant_config, f"{parent}.{name}" if parent else name, mapper)
              for name in checkpoint_names}
    if len(groups) != 1 or None in groups:
        return None
    return Int8LayersConfig(groups.pop())
