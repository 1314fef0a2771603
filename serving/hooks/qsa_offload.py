"""Patch qsa-offload: QSA main K/V rows in pinned host memory, staged prefill, the decode-07 row cache.

vLLM 0.33.0 keeps each QSA layer's main K/V (2 KiB per token at 2 KV heads of 256) in VRAM, which
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
* stores go to the host rows through unified addressing (vLLM's own cache writers) and invalidate
  the row cache; attention reads the selected rows (:mod:`flashnext.quant.kernels.qsa_row_cache`):
  decode-shaped steps through the row cache in the staging arena (decode-07,
  ``VLLM_QSA_ROW_CACHE=0`` turns it off), prefill steps window by window through the arena;
* nothing is allocated by a step. The arena (VRAM, the busiest rank's QSA layers x block_size
  rows on every rank) is allocated when the first QSA layer is built, inside vLLM's
  ``GPUModelRunner.load_model`` and its ``DeviceMemoryProfiler``: it counts as model memory,
  before ``Worker.determine_available_memory`` profiles. The host rows are sized by the KV cache
  config, so they are allocated when vLLM binds the compressed-key cache
  (``Worker.initialize_from_config`` -> ``initialize_kv_cache`` -> ``bind_kv_cache_to_layers``),
  before warm-up and CUDA graph capture.

HiSparse (vLLM 0.33.0's host-resident KV groups) was the other candidate: its planner already
leaves host-resident groups out of the device pool, but its host blocks are a second block space
with their own manager, connector and capacity (``hisparse_host_num_blocks``), built for MLA's
hot/cold split. Here the host rows must share the device group's block ids, so that the capacity
is the device's block count and one block table serves the compressed keys and the rows; the
layer simply has no device spec, and its pool is sized from the group it rides on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashnext import envs
from flashnext.errors import FlashnextError


def enabled() -> bool:
    return envs.VLLM_QSA_KV_OFFLOAD.enabled()


def row_cache_enabled() -> bool:
    return envs.VLLM_QSA_ROW_CACHE.enabled()


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

    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    state_page = max(spec.page_size_bytes for spec in model_cls.get_mamba_specs_from_config(vllm_config))
    spec = vllm_config.speculative_config
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


# --- the served layer -----------------------------------------------------------------------------


@dataclass
class OffloadedMetadata:
    """The part of the main layer's attention metadata that the QSA forward reads, built from the
    compressed-key group's metadata (the group whose blocks the host rows share)."""

    num_actual_tokens: int
    max_query_len: int
    num_prefills: int
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    token_to_req: torch.Tensor
    seq_lens: torch.Tensor


class RankArena:
    """The rank's staging arena and row cache, shared by its offloaded QSA layers.

    Seed 000 §5 and §7: the arena is ``(QSA layers on the busiest rank) x block_size`` rows on
    every rank, allocated at start-up; each rank splits it among its own QSA layers (with MTP:
    rank 2's 5 layers get 9,776 rows each, ranks 0 and 1 the same arena in 4 shares of 12,220).
    It is allocated while vLLM builds the model (``GPUModelRunner.load_model``, under its
    ``DeviceMemoryProfiler``), so vLLM counts it with the weights, before it profiles anything.
    """

    def __init__(self):
        self.layers: list[OffloadedQSA] = []
        self.cache = None
        self.planned_layers = 0

    def reserve(self, vllm_config, kv_heads: int, head_dim: int) -> None:
        """Allocate the arena once, on the device vLLM is building the model on."""
        if self.cache is not None:
            return
        inputs = _offload_inputs(vllm_config)
        if inputs is None:
            raise FlashnextError("VLLM_QSA_KV_OFFLOAD=1 needs a qwen4_exp model with QSA layers")
        from vllm.distributed import get_pp_group

        self.cache = rank_row_cache(*inputs, get_pp_group().rank_in_group, kv_heads, head_dim,
                                    torch.get_default_device())
        self.planned_layers = self.cache.num_layers

    def register(self, layer: "OffloadedQSA") -> int:
        if len(self.layers) >= self.planned_layers:
            raise RuntimeError(f"QSA offload: more QSA layers on this rank than the {self.planned_layers} planned")
        self.layers.append(layer)
        return len(self.layers) - 1


def rank_row_cache(text, pp: int, partition, draft_tokens: int, state_page: int, rank: int, kv_heads: int,
                   head_dim: int, device):
    """The arena and row cache of pipeline rank ``rank``: the busiest rank's QSA layers (the draft
    head's included) in blocks of the engine's block size, shared by this rank's QSA layers."""
    from flashnext.quant.kernels.qsa_row_cache import RowCache
    from flashnext.serving.capacity import kv

    per_rank = kv.qsa_layers_per_rank(text, pp, partition, draft_tokens)
    block_size = kv.offload_block_size(text, pp, partition, draft_tokens, state_page)
    return RowCache(per_rank[rank], kv.qsa_arena_blocks(per_rank), block_size, kv_heads, head_dim,
                    torch.bfloat16, device)


ARENA = RankArena()


def attach(layer, vllm_config) -> "OffloadedQSA | None":
    """Called at the end of ``Qwen4ExpQSAAttention.__init__``: the layer's offload, or None when the
    switch is off."""
    if not enabled():
        return None
    return OffloadedQSA(layer, vllm_config)


class OffloadedQSA:
    """One QSA layer's host rows and its share of the rank's arena."""

    def __init__(self, layer, vllm_config):
        if layer.kv_cache_torch_dtype != torch.bfloat16:
            raise FlashnextError("VLLM_QSA_KV_OFFLOAD=1 serves a bf16 QSA K/V cache only; drop --kv-cache-dtype "
                                 "or set VLLM_QSA_KV_OFFLOAD=0")
        self.layer = layer
        self.cache_config = vllm_config.cache_config
        self.decode_rows = 1 + vllm_config.num_speculative_tokens
        ARENA.reserve(vllm_config, layer.num_kv_heads, layer.head_dim)
        self.arena = ARENA.cache
        self.index = ARENA.register(self)
        self.pinned = None
        # vLLM binds the compressed-key cache, and with it these rows (patch: _QSAStateCache.bind_kv_cache).
        layer.indexer.compressed_key_cache.qsa_offload = self

    @property
    def block_size(self) -> int:
        return self.cache_config.block_size

    def bind(self, compressed: torch.Tensor) -> None:
        """Called when vLLM binds the compressed-key cache (``initialize_kv_cache``, before CUDA graph
        capture): allocate the host rows, as many blocks as that cache has, exactly (patch
        host-pool), and bind their UVA view as the layer's cache in the ``(blocks, heads, tokens,
        2 * head_dim)`` view vLLM's writers take. A second bind (vLLM's CUDA-graph memory profile
        binds a minimal cache first, then the real one) releases the first pool."""
        from flashnext.serving.runtime.host_pool import pinned_empty, release, uva_view

        if self.arena.arena.shape[1] != self.block_size:
            raise RuntimeError(f"QSA offload: the arena was sized for blocks of {self.arena.arena.shape[1]} tokens, "
                               f"the engine runs {self.block_size}")
        layer = self.layer
        shape = (compressed.shape[0], self.block_size, layer.num_kv_heads, 2 * layer.head_dim)
        previous, self.pinned = self.pinned, None
        layer.kv_cache = torch.tensor([])
        if previous is not None:
            release(previous)
        self.pinned = pinned_empty(shape, torch.bfloat16, register=compressed.is_cuda)
        host = uva_view(self.pinned) if compressed.is_cuda else self.pinned
        layer.kv_cache = host.transpose(1, 2)
        self.arena.invalidate_all()  # the rows behind every tag are new

    @property
    def host_kv(self) -> torch.Tensor:
        return self.layer.kv_cache.transpose(1, 2)

    def main_metadata(self, metadata: dict) -> OffloadedMetadata:
        from vllm.models.qwen4_exp.common.qsa_cache import _logical_to_physical_qsa_slots

        side = metadata[self.layer.indexer.compressed_key_cache.prefix]
        n = side.num_actual_tokens
        slots = _logical_to_physical_qsa_slots(side.block_table, side.token_to_req[:n],
                                               side.logical_positions[:n], self.block_size)
        return OffloadedMetadata(n, side.max_query_len, side.num_prefills, slots, side.block_table,
                                 side.token_to_req, side.seq_lens)

    def stored(self, metadata: OffloadedMetadata) -> None:
        """After this step's rows were written: cached copies of those slots are stale."""
        self.arena.invalidate(self.index, metadata.slot_mapping)

    def attend(self, query, metadata: OffloadedMetadata, output, output_gate, selection) -> torch.Tensor:
        """Sparse attention of this step's query rows over their selected host rows, into ``output``."""
        from flashnext.quant.kernels import qsa_row_cache as kernels

        n = metadata.num_actual_tokens
        output.zero_()
        if n == 0:
            return output
        q, out = query[:n], output[:n]
        gate = output_gate[:n].reshape(q.shape)
        token_to_req, table = metadata.token_to_req[:n], metadata.block_table
        indices = selection[:n]
        if metadata.max_query_len <= self.decode_rows and n <= kernels.ROW_CACHE_MAX_ROWS and row_cache_enabled():
            return self.arena.attend(self.index, q, self.host_kv, indices, table, token_to_req, gate, out)
        if metadata.num_prefills:
            return self.arena.staged(q, self.host_kv, indices, table, token_to_req, metadata.seq_lens, gate, out)
        return kernels.host_attention(q, self.host_kv, indices, table, token_to_req, gate, out)
