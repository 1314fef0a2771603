"""The ``qwen4_exp`` family's capacity plan: the numbers ``flashnext plan`` prints for a profile.

What is modelled is the system the profiles run (seed 000 §2 and §7): pipeline parallelism with the
QSA main K/V offloaded to pinned host memory (``VLLM_QSA_KV_OFFLOAD=1``), laid out by vLLM 0.34.0
(:mod:`~flashnext.serving.capacity.kv`). A block's bytes on a rank come from vLLM's
``_pool_bytes_per_block``; a request's blocks are each group's ``cdiv(max memory, page)``, summed, as
``get_max_concurrency_for_kv_cache_config`` does.

The attention block size is the one the seed picked: the largest multiple of 16 (and of the ring
and compression sizes) at which the busiest rank's QSA layers still fit in one state page, because
the block size is common to all ranks and a larger one would widen every rank's block.

How that reproduces the seed's table: the 12-layer QSA group needs about three state pages, so
vLLM packs two gated delta-net states per group (18 groups), plus one PLE short-conv group: the
seed's "19" state groups, each one page per request (two in mamba align mode, three with one MTP
draft token). The seed's "+1" is the raw-key ring's block; the seed's prose credits it to the PLE
short conv, but the totals (42, 61, 85) are the same either way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from flashnext.serving.capacity.kv import kv_cache_layout, qsa_arena, qsa_host_bytes_per_token
from flashnext.serving.capacity.model import (ModelConfig, TextConfig, load_text_config, load_vision_config,
                                              read_model_config)
from flashnext.serving.capacity.rules import next_power_of_two
from flashnext.serving.capacity.shape import ServingShape, import_vllm
from flashnext.serving.capacity.vision import VisionPlan, vision_plan


@dataclass
class GroupPlan:
    kind: str  # gdn, ple_short_conv, qsa_compressed_key, qsa_key_ring
    layers: list[str]
    blocks_per_request: int
    layers_per_rank: list[int]


@dataclass
class Plan:
    """The numbers ``flashnext plan`` prints; every size in bytes."""

    block_size: int
    state_page_bytes: int
    bytes_per_block: list[int]  # per rank
    blocks: int
    blocks_per_request: int
    capacity_tokens: int
    concurrency: float
    max_model_len: int
    kv_cache_memory_bytes: int
    prefix_caching: bool
    num_speculative_tokens: int
    layers_per_rank: list[int]
    qsa_layers_per_rank: list[int]
    vram_bytes: list[int]  # the KV pool each rank allocates
    pinned_host_bytes: int  # exact-size pools (patch host-pool)
    pinned_host_bytes_pow2: int  # what PyTorch's caching host allocator would pin
    pinned_host_bytes_per_rank: list[int]
    pinned_host_bytes_needed: int  # the one that applies to this profile
    tokens_per_mib_vram: float
    tokens_per_gib_host: float
    groups: list[GroupPlan] = field(default_factory=list)
    # What the plan assumes that the serving image lacks: nothing since patch qsa-offload is in the
    # series, so always empty; kept because `plan --json` readers look for the key.
    notes: list[str] = field(default_factory=list)
    vision: VisionPlan | None = None  # None: text only (or a text-only config)
    vram_bytes_with_images: list[int] = field(default_factory=list)  # vram_bytes plus the tower on rank 0
    # The QSA staging arena / decode-07 row cache (patch qsa-offload), allocated at model load,
    # outside --kv-cache-memory-bytes: the busiest rank's QSA layers x block_size rows on every
    # rank that has QSA layers, split among that rank's layers.
    qsa_arena_rows: int = 0
    qsa_row_cache_rows: list[int] = field(default_factory=list)  # per QSA layer, per rank (0: none)
    qsa_arena_bytes: list[int] = field(default_factory=list)  # per rank: the arena and its row-cache state
    vram_bytes_total: list[int] = field(default_factory=list)  # KV pool + arena (+ the tower on rank 0)

    def to_json(self) -> dict:
        return asdict(self)


def plan(text: TextConfig, shape: ServingShape) -> Plan:
    """Lay out the KV cache for ``text`` served as ``shape``, with vLLM 0.34.0's grouping."""
    import_vllm()
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.kv_cache_planning import _pool_bytes_per_block
    from vllm.v1.kv_cache_interface import AttentionSpec, CircularBufferSpec, MambaSpec

    layout = kv_cache_layout(text, shape)
    config, groups, projected = layout.vllm_config, layout.groups, layout.projected
    block_size, qsa_per_rank = layout.block_size, layout.qsa_layers_per_rank
    merged = {name: spec for specs in layout.rank_specs for name, spec in specs.items()}
    gdn, ple = layout.state_specs
    bytes_per_block = [_pool_bytes_per_block(config, g) for g in projected]
    blocks = min(shape.kv_cache_memory_bytes // b for b in bytes_per_block)

    group_plans = []
    for index, group in enumerate(groups):
        spec = merged[group.layer_names[0]]
        if isinstance(spec, (MambaSpec, CircularBufferSpec)):
            per_request = cdiv(spec.max_memory_usage_bytes(config), spec.page_size_bytes)
        else:
            assert isinstance(spec, AttentionSpec)
            per_request = spec.max_num_blocks_per_req(config, shape.max_model_len)
        kind = ("gdn" if spec == gdn else "ple_short_conv" if spec == ple
                else "qsa_key_ring" if isinstance(spec, CircularBufferSpec) else "qsa_compressed_key")
        group_plans.append(GroupPlan(kind, list(group.layer_names), per_request,
                                     [len(p[index].layer_names) for p in projected]))
    per_request = sum(g.blocks_per_request for g in group_plans)

    host_per_layer = blocks * block_size * qsa_host_bytes_per_token(text)
    host_per_rank = [n * host_per_layer for n in qsa_per_rank]
    exact = sum(host_per_rank)
    pow2 = sum(qsa_per_rank) * next_power_of_two(host_per_layer)
    tokens_per_block = shape.max_model_len / per_request
    arena_rows, row_cache_rows, arena_bytes = qsa_arena(text, qsa_per_rank, block_size)
    vram = [blocks * b for b in bytes_per_block]
    return Plan(
        block_size=block_size,
        state_page_bytes=layout.state_page_bytes,
        bytes_per_block=bytes_per_block,
        blocks=blocks,
        blocks_per_request=per_request,
        capacity_tokens=blocks * shape.max_model_len // per_request,
        concurrency=blocks / per_request,
        max_model_len=shape.max_model_len,
        kv_cache_memory_bytes=shape.kv_cache_memory_bytes,
        prefix_caching=shape.prefix_caching,
        num_speculative_tokens=shape.num_speculative_tokens,
        layers_per_rank=[len(r) for r in layout.ranks],
        qsa_layers_per_rank=qsa_per_rank,
        vram_bytes=vram,
        pinned_host_bytes=exact,
        pinned_host_bytes_pow2=pow2,
        pinned_host_bytes_per_rank=host_per_rank,
        pinned_host_bytes_needed=exact if shape.exact_host_pool else pow2,
        tokens_per_mib_vram=tokens_per_block / (max(bytes_per_block) / 2**20),
        tokens_per_gib_host=tokens_per_block / (sum(qsa_per_rank) * block_size * qsa_host_bytes_per_token(text) / 2**30),
        groups=group_plans,
        qsa_arena_rows=arena_rows,
        qsa_row_cache_rows=row_cache_rows,
        qsa_arena_bytes=arena_bytes,
        vram_bytes_total=[v + a for v, a in zip(vram, arena_bytes)],
    )


def plan_profile(profile, kv_cache_memory_bytes: int | None = None, prefix_caching: bool | None = None,
                 model: Path | ModelConfig | None = None) -> Plan:
    """The plan of a ``qwen4_exp`` ``profile`` for ``model`` (a snapshot directory or its
    ``config.json``, or that config already read; None: the pinned base checkpoint), its vision tower
    on the first rank included."""
    shape = ServingShape.from_profile(profile, kv_cache_memory_bytes, prefix_caching)
    model = read_model_config(model)  # once, for the text and the vision config
    result = plan(load_text_config(model), shape)
    vision = load_vision_config(model) if shape.images else None
    if vision is not None:
        result.vision = vision_plan(vision, shape.vit_stream, shape.max_pixels)
        result.vram_bytes_with_images = [v + (result.vision.vram_bytes if rank == 0 else 0)
                                         for rank, v in enumerate(result.vram_bytes)]
        result.vram_bytes_total[0] += result.vision.vram_bytes
    return result
