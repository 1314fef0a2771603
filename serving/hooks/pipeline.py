"""Hooks of patch pp-ple: the PLE model under pipeline parallelism.

vLLM 0.33.0 refuses PP > 1 for a model with PLE layers, because, in the version that check was
written for, non-first ranks did not receive the raw input ids. In 0.33.0 they do
(``Qwen4ExpForConditionalGeneration.requires_raw_input_tokens``), so the refusal can go. What
remains is the KV cache of a rank that holds no layer of some group: the PLE short conv lives on
one rank only, and on the others vLLM 0.33.0 keeps the group's whole-model spec and makes a
cache tensor for a layer that rank does not have, so ``allocate_kv_cache`` dies in StopIteration.
"""

from __future__ import annotations

from flashnext.quant import envs


def pp_ple_enabled() -> bool:
    return envs.VLLM_PP_PLE.enabled()


def owned_layer_specs(group) -> list:
    """The ``(layer name, spec)`` pairs of a uniform-type KV cache group that belong to this
    worker: the group's own layer names, not every layer of the whole-model spec."""
    specs = group.kv_cache_spec.kv_cache_specs
    if not pp_ple_enabled():
        return list(specs.items())
    owned = set(group.layer_names)
    return [(name, spec) for name, spec in specs.items() if name in owned]


def on_first_rank(make):
    """Patch mem-01: ``make()`` on the first pipeline rank, a ``PPMissingLayer`` elsewhere.

    vLLM 0.33.0's qwen4_exp builds ``embed_tokens`` and ``lm_head`` on every rank although only
    the first embeds and only the last computes logits: 0.60 GiB each at INT8 (seed 000 §5).
    """
    return _on_rank(make, "is_first_rank")


def on_last_rank(make):
    """Patch mem-01: ``make()`` on the last pipeline rank, a ``PPMissingLayer`` elsewhere."""
    return _on_rank(make, "is_last_rank")


def _on_rank(make, which: str):
    from vllm.distributed import get_pp_group
    from vllm.model_executor.models.utils import PPMissingLayer

    if not envs.VLLM_PP_MISSING_LAYERS.enabled() or getattr(get_pp_group(), which):
        return make()
    return PPMissingLayer()
