"""The KV cache of a ``qwen4_exp`` model with the QSA K/V offloaded, as vLLM 0.34.0 lays it out.

Per layer, the KV cache specs are vLLM's own classes, with state shapes from vLLM's own calculators:

- each gated delta-net layer: a ``MambaSpec`` (conv state + fp32 SSM state);
- the PLE short conv (on the decoder layer before ``ple_layer_ids``): a ``MambaSpec``;
- each QSA layer, in VRAM: the indexer's compressed keys (one ``indexer_head_dim`` bf16 key per
  ``indexer_compress_ratio`` tokens, 64 B/token at 128/4) and the raw-key ring (one block per
  request), each the spec vLLM's own cache module states (``QSACompressedKeyCache`` and
  ``QSARawKeyCache.get_kv_cache_spec``), not a copy of it;
- in host memory, the QSA main K and V: ``2 x num_key_value_heads x head_dim`` bf16 per token.

The grouping is vLLM's ``get_kv_cache_groups`` over all ranks' layers with the block-outermost
layout (the only one that packs a rank's QSA layers into one page), and each group is projected
onto each rank with vLLM's ``_project_kv_cache_groups_to_worker``.

The block-size rule (:func:`offload_block_size`) and the arena (:func:`qsa_arena_blocks`) live here
because the served engine takes them from here (``hooks/qsa_offload.py``): what ``plan`` prints and
what the engine allocates are one computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashnext.errors import FlashnextError
from flashnext.serving.capacity.model import TextConfig, is_qsa
from flashnext.serving.capacity.shape import PP_LAYER_PARTITION, ServingShape, import_vllm

ATTENTION_BLOCK_ALIGNMENT = 16
# The block-size rule budgets each compressed key with the 8-byte position the seed's offload
# stored beside it (66 B/token at 128/4). vLLM 0.34.0's compressed key has none (64 B/token, the
# spec the plan lays out); the rule keeps the seed's budget, so the block size, the arena and every
# capacity number stay the ones seed 000 served and measured (9,776 and 12,144 tokens), and the QSA
# page (5 x 64 x 9,776 = 3,128,320 B) sits within the state page (3,227,648 B) as the rule intends.
BLOCK_RULE_POSITION_BYTES = 8
KV_DTYPE_BYTES = 2  # bf16 K/V and keys


def rank_layers(num_layers: int, pp: int, partition: tuple[int, ...] | None) -> list[range]:
    """Decoder layers per pipeline rank, as vLLM's ``get_pp_indices`` splits them: ``partition``'s
    counts in rank order, else ``num_layers // pp`` each with the remainder given one layer each to
    the ranks before the last (``tests/serving/test_capacity.py`` holds this to vLLM's function).

    Computed rather than asked of ``get_pp_indices``, which reads the partition from the process
    environment: the plan is for a profile's environment, not this process's."""
    if partition is not None:
        if len(partition) != pp or sum(partition) != num_layers or min(partition) < 0:
            raise FlashnextError(
                f"{PP_LAYER_PARTITION} {','.join(map(str, partition))} does not split {num_layers} layers "
                f"into {pp} ranks")
        counts = list(partition)
    else:
        counts = [num_layers // pp] * pp
        for i in range(2, num_layers % pp + 2):
            counts[-i] += 1
    starts = [sum(counts[:rank]) for rank in range(pp)]
    return [range(start, start + count) for start, count in zip(starts, counts)]


def ring_capacity(text: TextConfig, num_speculative_tokens: int) -> int:
    """Raw-key ring rows: an open compression group plus the draft rows, in whole groups."""
    ratio = text.indexer_compress_ratio
    return -(-(ratio + num_speculative_tokens) // ratio) * ratio


def block_rule_bytes_per_token(text: TextConfig) -> int:
    """The VRAM a QSA layer's compressed keys take per token by the block-size rule: the seed's
    state, the key and its position (:data:`BLOCK_RULE_POSITION_BYTES`), over the compression ratio."""
    state_bytes = text.indexer_head_dim * KV_DTYPE_BYTES + BLOCK_RULE_POSITION_BYTES
    if state_bytes % text.indexer_compress_ratio:
        raise FlashnextError(f"a {state_bytes}-byte QSA state does not split over {text.indexer_compress_ratio} tokens")
    return state_bytes // text.indexer_compress_ratio


def qsa_host_bytes_per_token(text: TextConfig) -> int:
    return 2 * text.num_key_value_heads * text.head_dim * KV_DTYPE_BYTES


def qsa_layers_per_rank(text: TextConfig, pp: int, partition: tuple[int, ...] | None,
                        num_speculative_tokens: int) -> list[int]:
    """QSA layers on each pipeline rank; the MTP draft head's run on the last rank."""
    ranks = rank_layers(text.num_hidden_layers, pp, partition)
    per_rank = [sum(is_qsa(text.layer_types[i]) for i in r) for r in ranks]
    per_rank[-1] += text.mtp_num_hidden_layers if num_speculative_tokens else 0
    return per_rank


def offload_block_size(text: TextConfig, pp: int, partition: tuple[int, ...] | None, num_speculative_tokens: int,
                       state_page_bytes: int) -> int:
    """The attention block size with the QSA K/V offloaded (seed 000 §2, §7): the largest multiple
    of 16 (and of the raw-key ring and the compression ratio) at which the busiest rank's QSA layers
    fit one state page at the seed's 66 B/token (:func:`block_rule_bytes_per_token`). The block size
    is common to all ranks, so the busiest one decides; the served engine (patch qsa-offload) takes
    its block size from here."""
    per_token = block_rule_bytes_per_token(text)
    alignment = math.lcm(ATTENTION_BLOCK_ALIGNMENT, ring_capacity(text, num_speculative_tokens),
                         text.indexer_compress_ratio)
    busiest = max(qsa_layers_per_rank(text, pp, partition, num_speculative_tokens))
    block_size = (state_page_bytes // (busiest * per_token)) // alignment * alignment if busiest else alignment
    if block_size == 0:
        raise FlashnextError(
            f"{busiest} QSA layers x {per_token} B/token do not fit one {state_page_bytes}-byte state page "
            f"at a block of {alignment} tokens")
    return block_size


def qsa_arena_blocks(qsa_per_rank: list[int]) -> int:
    """Blocks of rows in each rank's staging arena: one per QSA layer of the busiest rank (seed 000
    §7: 5 x 9,776 rows with MTP on every rank, so that a prefill stages as many blocks anywhere)."""
    return max(qsa_per_rank, default=0)


def row_cache_bytes(text: TextConfig, layers: int, arena_blocks: int, block_size: int) -> tuple[int, int]:
    """A rank's arena rows and its decode-07 row-cache state (tags, hitmarks, bids, epochs), in
    bytes, as :class:`~flashnext.quant.kernels.qsa_row_cache.RowCache` allocates them."""
    from flashnext.quant.kernels.qsa_row_cache import row_cache_tensors, tensor_bytes

    tensors = row_cache_tensors(layers, arena_blocks, block_size, text.num_key_value_heads, text.head_dim)
    arena = tensor_bytes(*tensors.pop("arena"))
    return arena, sum(tensor_bytes(*t) for t in tensors.values())


def qsa_arena(text: TextConfig, qsa_per_rank: list[int], block_size: int) -> tuple[int, list[int], list[int]]:
    """The arena's rows, the row-cache rows each layer of each rank gets, and each rank's arena
    bytes (the rows and the row-cache state); a rank without QSA layers holds none."""
    blocks = qsa_arena_blocks(qsa_per_rank)
    rows = blocks * block_size
    shares = [rows // n if n else 0 for n in qsa_per_rank]
    arena_bytes = [sum(row_cache_bytes(text, n, blocks, block_size)) if n else 0 for n in qsa_per_rank]
    return rows, shares, arena_bytes


def _vllm_config(prefix_caching: bool):
    from vllm.config import VllmConfig

    config = VllmConfig()
    config.cache_config.kv_cache_layout = "BLHNC"
    config.cache_config.mamba_cache_mode = "align" if prefix_caching else "none"
    return config


def mamba_block_size(shape: ServingShape, block_size: int) -> int:
    """The state specs' block size as vLLM sets it: the attention block in mamba align mode (the
    offload's ``align_block_size``), else the whole context (``HybridAttentionMambaModelConfig``)."""
    return block_size if shape.prefix_caching else shape.max_model_len


def _state_specs(text: TextConfig, shape: ServingShape, block_size: int = 1):
    """vLLM's MambaSpecs for a gated delta-net layer and for the PLE short conv, as each layer's
    ``MambaBase.get_kv_cache_spec`` states them (its state shapes and dtypes from vLLM's own
    calculators, its backend, an alignment of 1) at a state block of ``block_size``."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    mode = "align" if shape.prefix_caching else "none"
    spec = shape.num_speculative_tokens
    common = dict(block_size=block_size, mamba_cache_mode=mode, num_speculative_blocks=spec, state_alignment=1,
                  block_stride_alignment=1)
    gdn = MambaSpec(
        shapes=MambaStateShapeCalculator.gated_delta_net_state_shape(
            1, text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
            text.linear_value_head_dim, text.linear_conv_kernel_dim, spec),
        dtypes=MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto", "float32"),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN, **common)
    conv_state_len = (text.ple_conv_kernel_size - 1) * text.ngram_size
    ple = MambaSpec(
        shapes=MambaStateShapeCalculator.short_conv_state_shape(
            1, text.hidden_size * text.hc_count, conv_state_len + 1, spec),
        dtypes=MambaStateDtypeCalculator.short_conv_state_dtype(torch.bfloat16, "auto"),
        mamba_type=MambaAttentionBackendEnum.SHORT_CONV, tp_replicated=True, **common)
    return gdn, ple


def _qsa_specs(text: TextConfig, shape: ServingShape, block_size: int, is_draft: bool):
    """The VRAM-resident caches of one offloaded QSA layer, compressed keys and the raw-key ring,
    as vLLM's own cache modules state them: built as ``Qwen4ExpQSAIndexer`` builds them (bf16
    indexer keys, the default ``indexer_kv_dtype``), asked with ``get_kv_cache_spec`` and
    customised for their backend as the engine's ``get_kv_cache_spec`` does, a draft layer's marked
    as the drafter's (``is_draft``). The configs they read are stood in for: the plan has no model
    to build a ``VllmConfig`` of, and they read the block size, the draft tokens and a registry of
    layer names only."""
    import dataclasses
    import types

    import torch
    from vllm.config import CacheConfig
    from vllm.models.qwen4_exp.common.qsa_indexer import (QSAIndexerBackend, QSACompressedKeyCache,
                                                          QSARawKeyCache)
    from vllm.v1.worker.gpu.attn_utils import customize_attention_spec

    cache_config = CacheConfig(block_size=block_size)
    config = types.SimpleNamespace(compilation_config=types.SimpleNamespace(static_forward_context={}),
                                   num_speculative_tokens=shape.num_speculative_tokens)
    common = dict(dtype=torch.bfloat16, compress_ratio=text.indexer_compress_ratio, cache_config=cache_config,
                  vllm_config=config)
    compressed = QSACompressedKeyCache(head_size=text.indexer_head_dim, prefix="compressed_key_cache", **common)
    ring = QSARawKeyCache(head_size=text.indexer_head_dim, cache_rope_positions=text.uses_mrope,
                          prefix="raw_key_cache", **common)
    specs = [customize_attention_spec(QSAIndexerBackend, cache.get_kv_cache_spec(config))
             for cache in (compressed, ring)]
    return tuple(dataclasses.replace(spec, is_draft=True) if is_draft else spec for spec in specs)


@dataclass
class KVCacheLayout:
    """What vLLM 0.34.0 makes of the model's KV cache specs: the whole-model groups and each
    rank's projection of them, with the inputs that produced them."""

    block_size: int
    state_page_bytes: int
    ranks: list[range]
    qsa_layers_per_rank: list[int]
    rank_specs: list[dict]  # layer name -> KVCacheSpec, per rank
    state_specs: tuple  # the gated delta-net and PLE short-conv MambaSpecs
    groups: list  # vLLM KVCacheGroupSpec, whole model
    projected: list[list]  # per rank
    vllm_config: object


def kv_cache_layout(text: TextConfig, shape: ServingShape) -> KVCacheLayout:
    """Build every rank's layer specs and group them with vLLM 0.34.0's ``get_kv_cache_groups``."""
    if not shape.qsa_kv_offload:
        raise FlashnextError(
            "the plan models the QSA K/V offload of seed 000 (VLLM_QSA_KV_OFFLOAD=1); this profile does not set it")
    import_vllm()
    from vllm.v1.core.kv_cache_planning import _project_kv_cache_groups_to_worker, get_kv_cache_groups

    pp = shape.pipeline_parallel_size
    ranks = rank_layers(text.num_hidden_layers, pp, shape.layer_partition)
    mtp_layers = text.mtp_num_hidden_layers if shape.num_speculative_tokens else 0
    ple_layers = {i - 1 for i in text.ple_layer_ids}

    qsa_per_rank = qsa_layers_per_rank(text, pp, shape.layer_partition, shape.num_speculative_tokens)
    gdn, ple = _state_specs(text, shape)
    state_page = max(gdn.page_size_bytes, ple.page_size_bytes if ple_layers else 0)
    block_size = offload_block_size(text, pp, shape.layer_partition, shape.num_speculative_tokens, state_page)
    gdn, ple = _state_specs(text, shape, mamba_block_size(shape, block_size))

    rank_specs: list[dict] = []
    for rank, layers in enumerate(ranks):
        specs: dict = {}
        for i in layers:
            if is_qsa(text.layer_types[i]):
                compressed, ring = _qsa_specs(text, shape, block_size, is_draft=False)
                specs[f"model.layers.{i}.self_attn.indexer.compressed_key_cache"] = compressed
                specs[f"model.layers.{i}.self_attn.indexer.raw_key_cache"] = ring
            else:
                specs[f"model.layers.{i}.linear_attn"] = gdn
            if i in ple_layers:
                specs[f"model.layers.{i}.ple"] = ple
        if rank == pp - 1:
            for j in range(mtp_layers):
                compressed, ring = _qsa_specs(text, shape, block_size, is_draft=True)
                name = f"mtp.layers.{text.num_hidden_layers + j}.self_attn.indexer"
                specs[f"{name}.compressed_key_cache"] = compressed
                specs[f"{name}.raw_key_cache"] = ring
        rank_specs.append(specs)

    config = _vllm_config(shape.prefix_caching)
    merged = {name: spec for specs in rank_specs for name, spec in specs.items()}
    groups = get_kv_cache_groups(config, dict(merged))
    projected = [_project_kv_cache_groups_to_worker(groups, specs) for specs in rank_specs]
    return KVCacheLayout(block_size, state_page, ranks, qsa_per_rank, rank_specs, (gdn, ple), groups, projected,
                         config)
