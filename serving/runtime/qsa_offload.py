"""The offloaded QSA layer's engine-side state (patch qsa-offload): the rank's staging arena and
row cache, and each layer's exact-size pinned host rows and its forward over them.

What the patch's call sites reach is :mod:`flashnext.serving.hooks.qsa_offload`, which decides
whether the offload applies and reads vLLM's config; this module holds what lives for the
engine's life once it does. Seed 000 §5 and §7 give the arena's sizing; the kernels are
:mod:`flashnext.quant.kernels.qsa_row_cache`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flashnext import envs
from flashnext.errors import FlashnextError


@functools.cache
def offloaded_metadata_type() -> type:
    """vLLM's main-attention metadata (``Qwen4ExpQSAMetadata``, what ``_run_qsa`` hands the indexer
    and ``impl.forward``) with the two facts the offloaded forward reads besides: whether the step
    has prefills, and each request's context length (the blocks a staged prefill copies). Made on
    first use so that importing this module (the arena tests do) does not import vLLM's models."""
    from vllm.models.qwen4_exp.common.qsa import Qwen4ExpQSAMetadata

    @dataclass
    class OffloadedMetadata(Qwen4ExpQSAMetadata):
        """The main layer has no KV cache group, so vLLM builds it no metadata: this one is built
        from the compressed-key group's (the group whose blocks the host rows share)."""

        num_prefills: int
        seq_lens: torch.Tensor

    return OffloadedMetadata


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

    def reserve(self, inputs: tuple, kv_heads: int, head_dim: int) -> None:
        """Allocate the arena once, on the device vLLM is building the model on; ``inputs`` are the
        block-size rule's (the hook's ``offload_inputs``)."""
        if self.cache is not None:
            return
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

# What vLLM's _logical_to_physical_qsa_slots, which OffloadedQSA.main_metadata calls, holds at its
# peak for each token: eight int64 values (the request and position as int64, the logical block,
# the clamped indices, the physical block, the slot and its parts) and the validity flag.
ROW_SLOT_BYTES_PER_TOKEN = 8 * 8 + 1


def row_slots_bytes(tokens: int) -> int:
    """The device bytes :meth:`OffloadedQSA.main_metadata` allocates at their peak for a step of
    ``tokens`` tokens, freed when the layer's ``_run_qsa`` returns; ``flashnext plan``'s ledger
    counts them (tests/serving/test_engine_ledger.py holds this to the engine)."""
    return tokens * ROW_SLOT_BYTES_PER_TOKEN


class OffloadedQSA:
    """One QSA layer's host rows and its share of the rank's arena."""

    def __init__(self, layer, vllm_config, inputs: tuple):
        if layer.kv_cache_torch_dtype != torch.bfloat16:
            raise FlashnextError("VLLM_QSA_KV_OFFLOAD=1 serves a bf16 QSA K/V cache only; drop --kv-cache-dtype "
                                 "or set VLLM_QSA_KV_OFFLOAD=0")
        self.layer = layer
        self.cache_config = vllm_config.cache_config
        ARENA.reserve(inputs, layer.num_kv_heads, layer.head_dim)
        self.arena = ARENA.cache
        self.index = ARENA.register(self)
        self.pinned = None
        # vLLM binds the compressed-key cache, and with it these rows (patch: _QSAIndexerCache.bind_kv_cache).
        layer.indexer.compressed_key_cache.qsa_offload = self

    @property
    def block_size(self) -> int:
        return self.cache_config.block_size

    def bind(self, compressed: torch.Tensor) -> None:
        """Called when vLLM binds the compressed-key cache (``initialize_kv_cache``, before CUDA graph
        capture): allocate the host rows, as many blocks as that cache has, exactly (patch
        host-pool), and bind their UVA view as the layer's cache in the ``(blocks, heads, tokens,
        2 * head_dim)`` view vLLM's writers take. A second bind (vLLM's CUDA-graph memory profile
        binds a minimal cache first, then the real one) releases the first pool. The rank's first
        layer then launches the prefill kernels once (``RowCache.warm``): compiled at start-up, not
        at the first prefill."""
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
        if self.index == 0:  # once a rank: its QSA layers launch the same variants
            self.arena.warm(self.host_kv, layer.num_heads, layer.topk_indices_buffer.shape[1] - 1)

    @property
    def host_kv(self) -> torch.Tensor:
        return self.layer.kv_cache.transpose(1, 2)

    def main_metadata(self, metadata: dict):
        """Called by ``_run_qsa`` for ``metadata[layer_name]``, which vLLM no longer builds: the step's
        bounds, block table and each token's host row, from the compressed-key group's metadata
        (``QSAIndexerMetadata``). The slots go to the indexer (the fused writer stores K/V there)
        or to ``impl.do_kv_cache_update``, and to :meth:`forward`'s invalidation."""
        from vllm.models.qwen4_exp.common.qsa_indexer import _logical_to_physical_qsa_slots

        side = metadata[self.layer.indexer.compressed_key_cache.prefix]
        n = side.num_actual_tokens
        slots = _logical_to_physical_qsa_slots(side.block_table, side.token_to_req[:n],
                                               side.logical_positions[:n], self.block_size)
        return offloaded_metadata_type()(num_actual_tokens=n, max_query_len=side.max_query_len,
                                         block_table=side.block_table, slot_mapping=slots,
                                         num_prefills=side.num_prefills, seq_lens=side.seq_lens)

    def forward(self, layer, query, kv_cache, attn_metadata, output, *, token_to_req, use_prefill_config,
                output_gate) -> torch.Tensor:
        """Called by ``_run_qsa`` in place of ``Qwen4ExpQSAImpl.forward``, with its arguments, after this
        step's K/V rows were stored: sparse attention of the step's query rows over the host rows
        the indexer selected (``layer.topk_indices_buffer``, as vLLM's impl reads it), into
        ``output``. ``kv_cache`` is the layer's host view bound by :meth:`bind`."""
        from flashnext.quant.kernels import qsa_row_cache as kernels

        # the rows just stored change what cached copies of those slots hold
        self.arena.invalidate(self.index, attn_metadata.slot_mapping)
        n = attn_metadata.num_actual_tokens
        output.zero_()
        if n == 0:
            return output
        host_kv = kv_cache.transpose(1, 2)
        q, out = query[:n], output[:n]
        gate = output_gate[:n].reshape(q.shape)
        token_to_req, table = token_to_req[:n], attn_metadata.block_table
        indices = layer.topk_indices_buffer[:n]
        # use_prefill_config: a query longer than 1 + num_speculative_tokens rows, i.e. not decode-shaped
        if not use_prefill_config and n <= kernels.ROW_CACHE_MAX_ROWS and envs.VLLM_QSA_ROW_CACHE.enabled():
            return self.arena.attend(self.index, q, host_kv, indices, table, token_to_req, gate, out)
        if attn_metadata.num_prefills:
            return self.arena.staged(q, host_kv, indices, table, token_to_req, attn_metadata.seq_lens, gate, out)
        return kernels.host_attention(q, host_kv, indices, table, token_to_req, gate, out)
