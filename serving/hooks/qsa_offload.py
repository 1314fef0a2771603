"""Patch qsa-offload: QSA main K/V rows in pinned host memory, staged prefill, the decode-07 row cache.

vLLM 0.34.0 keeps each QSA layer's main K/V (2 KiB per token at 2 KV heads of 256) in VRAM, which
limits the 3x3090 system to about 122k tokens of context (seed 000 §1). With
``VLLM_QSA_KV_OFFLOAD=1``:

* the main attention layer asks for no device KV cache (the patch's ``get_kv_cache_spec``); what stays in VRAM
  per QSA layer is the indexer's compressed keys and its raw-key ring, vLLM's own side caches;
* the K/V rows live in an exact-size pinned host pool (patch host-pool), one per layer, with as many
  blocks as the compressed-key group has: one block table addresses both, so a row's host slot is
  ``block * block_size + offset`` of the compressed group's block (:meth:`OffloadedQSA.bind`);
* the attention block size is the largest multiple of 16 at which the busiest rank's QSA layers
  (the draft head's included) fit one state page (:func:`align_block_size`, the rule of
  :func:`flashnext.serving.capacity.offload_block_size`): 12,144 tokens, 9,776 with MTP;
* with no group of its own the layer gets no metadata from vLLM: ``_run_qsa`` takes a
  ``Qwen4ExpQSAMetadata`` built from the compressed-key group's (:meth:`OffloadedQSA.main_metadata`),
  whose slots send vLLM's own cache writers (the fused one in the indexer, or
  ``impl.do_kv_cache_update``) to the host rows through unified addressing;
* :meth:`OffloadedQSA.forward` takes ``Qwen4ExpQSAImpl.forward``'s place and arguments: it drops
  the stored slots from the row cache and reads the selected rows
  (:mod:`flashnext.quant.kernels.qsa_row_cache`): decode-shaped steps through the row cache in the
  staging arena (decode-07, ``VLLM_QSA_ROW_CACHE=0`` turns it off), prefill steps window by window
  through the arena;
* a step allocates only what ``flashnext plan``'s memory ledger lists (decode partials, each
  token's host-row slot; tests/serving/test_engine_ledger.py holds the engine to it). The arena
  (VRAM, the busiest rank's QSA layers x block_size rows on every rank) is allocated when the
  first QSA layer is built, inside vLLM's
  ``GPUModelRunner.load_model`` and its ``DeviceMemoryProfiler``: it counts as model memory,
  before ``Worker.determine_available_memory`` profiles. The host rows are sized by the KV cache
  config, so they are allocated when vLLM binds the compressed-key cache
  (``Worker.initialize_from_config`` -> ``initialize_kv_cache`` -> ``bind_kv_cache_to_layers``),
  before warm-up and CUDA graph capture.

HiSparse (vLLM 0.34.0's host-resident KV groups) was the other candidate: its planner already
leaves host-resident groups out of the device pool, but its host blocks are a second block space
with their own manager, connector and capacity (``hisparse_host_num_blocks``), built for MLA's
hot/cold split. Here the host rows must share the device group's block ids, so that the capacity
is the device's block count and one block table serves the compressed keys and the rows; the
layer simply has no device spec, and its pool is sized from the group it rides on.
"""

from __future__ import annotations

from flashnext import envs
from flashnext.errors import FlashnextError
from flashnext.serving.runtime.qsa_offload import OffloadedQSA


def enabled() -> bool:
    return envs.VLLM_QSA_KV_OFFLOAD.enabled()


# --- configuration: the block size the engine uses ---------------------------------------------------


def _offload_inputs(vllm_config):
    """What the seed's block-size and arena rules read from ``vllm_config``: the text config, the
    pipeline split, the draft tokens and the state page; None where the offload does not apply
    (switch off, or not a ``qwen4_exp`` model with QSA layers)."""
    if not enabled():
        return None
    model_config = vllm_config.model_config
    text = getattr(model_config, "hf_text_config", None)
    if text is None or getattr(text, "indexer_n_heads", None) is None:
        return None
    from flashnext.serving.capacity.model import TextConfig

    config = TextConfig.from_dict(text.to_dict(), "the served model's config")
    from vllm.model_executor.models import ModelRegistry

    spec = vllm_config.speculative_config
    # the draft head's config names its own class (Qwen4ExpMTP), which has no state specs: the
    # state pages, like the block size they set, are the target model's
    served = spec.target_model_config if spec is not None and spec.target_model_config is not None else model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(served.architecture, model_config=served)
    state_page = max(spec.page_size_bytes for spec in model_cls.get_mamba_specs_from_config(vllm_config))
    import vllm.envs as vllm_envs

    partition = vllm_envs.VLLM_PP_LAYER_PARTITION  # vLLM's own knob, read as get_pp_indices reads it
    return (config, vllm_config.parallel_config.pipeline_parallel_size,
            tuple(int(x) for x in partition.split(",")) if partition else None,
            spec.num_speculative_tokens if spec is not None else 0, state_page)


def engine_block_size(vllm_config) -> int | None:
    """The attention block size for ``vllm_config`` with the offload, or None where it does not apply."""
    inputs = _offload_inputs(vllm_config)
    if inputs is None:
        return None
    from flashnext.serving.capacity.kv import offload_block_size

    return offload_block_size(*inputs)


def align_block_size(vllm_config) -> bool:
    """Called first in ``Platform._align_hybrid_block_size``: with the offload, set the block size
    by the seed's rule and leave the state pages unpadded (the QSA group's page is at most one state
    page). Returns whether it did, so vLLM's own alignment (which sizes the attention page from the
    main K/V that is no longer in VRAM) is skipped."""
    block_size = engine_block_size(vllm_config)
    if block_size is None:
        return False
    cache_config = vllm_config.cache_config
    cache_config.block_size = block_size
    if cache_config.mamba_cache_mode == "align":
        cache_config.mamba_block_size = block_size
    cache_config.mamba_page_size_padded = None
    return True


# --- the served layer: its state lives in serving/runtime/qsa_offload.py ------------------------------


def attach(layer, vllm_config) -> "OffloadedQSA | None":
    """Called at the end of ``Qwen4ExpQSAAttention.__init__``: the layer's offload, or None when the
    switch is off."""
    if not enabled():
        return None
    inputs = _offload_inputs(vllm_config)
    if inputs is None:
        raise FlashnextError("VLLM_QSA_KV_OFFLOAD=1 needs a qwen4_exp model with QSA layers")
    return OffloadedQSA(layer, vllm_config, inputs)
