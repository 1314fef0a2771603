"""Hooks of patch pp-ple: the PLE model under pipeline parallelism.

vLLM 0.33.0 refuses PP > 1 for a model with PLE layers, because, in the version that check was
written for, non-first ranks did not receive the raw input ids. In 0.33.0 they do
(``Qwen4ExpForConditionalGeneration.requires_raw_input_tokens``), so the refusal can go. What
remains is the KV cache of a rank that holds no layer of some group: the PLE short conv lives on
one rank only, and on the others vLLM 0.33.0 keeps the group's whole-model spec and makes a
cache tensor for a layer that rank does not have, so ``allocate_kv_cache`` dies in StopIteration.
"""

from __future__ import annotations

from flashnext import envs


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
    the first embeds and only the last computes logits: 0.60 GiB each at INT8 (seed 000 §6).
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


def deferred_intermediate_tensors(pp_group, tp_group):
    """Patch decode-03: the previous rank's hidden states, received when first read.

    vLLM 0.33.0's worker calls ``irecv_tensor_dict`` first thing in ``execute_model``; its
    metadata ``recv_object`` blocks until the previous rank has launched its forward and sent, and
    only then does this rank prepare inputs and attention metadata (3.2-3.5 ms of Python for this
    model). Deferred, the preparation overlaps the previous rank's GPU work; the receive happens
    when the model runner reads ``.tensors`` right before the forward, so the device order stays
    receive, forward, send. Returns None with ``VLLM_PP_DEFER_RECV=0`` (the stock path).
    """
    if not envs.VLLM_PP_DEFER_RECV.enabled():
        return None
    return _deferred_class()(lambda: pp_group.irecv_tensor_dict(all_gather_group=tp_group))


_DEFERRED = None


def _deferred_class():
    global _DEFERRED
    if _DEFERRED is not None:
        return _DEFERRED
    from vllm.sequence import IntermediateTensors

    class DeferredRecvIntermediateTensors(IntermediateTensors):
        def __init__(self, receive) -> None:
            object.__setattr__(self, "_receive", receive)
            object.__setattr__(self, "_received", False)

        def wait_for_comm(self) -> None:
            """Receive now if not yet (idempotent); the worker calls it after every step, so a step
            whose runner never read ``.tensors`` still matches the previous rank's send."""
            if object.__getattribute__(self, "_received"):
                return
            object.__setattr__(self, "_received", True)
            tensors, handles, postprocess = object.__getattribute__(self, "_receive")()
            assert tensors is not None
            for handle in handles:
                handle.wait()
            for fn in postprocess:
                fn()
            object.__setattr__(self, "tensors", tensors)

        def __getattribute__(self, name: str):
            if name == "tensors" and not object.__getattribute__(self, "_received"):
                object.__getattribute__(self, "wait_for_comm")()
            return object.__getattribute__(self, name)

    _DEFERRED = DeferredRecvIntermediateTensors
    return _DEFERRED
