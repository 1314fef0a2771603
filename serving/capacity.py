"""KV cache capacity plan for a ``qwen4_exp`` serving profile, computed with vLLM 0.33.0's own rules.

What is modelled is the system the profiles run (seed 000 §2 and §7): pipeline parallelism with the
QSA main K/V offloaded to pinned host memory (``VLLM_QSA_KV_OFFLOAD=1``). Per layer, the KV cache
specs are vLLM's own classes, with state shapes from vLLM's own calculators:

- each gated delta-net layer: a ``MambaSpec`` (conv state + fp32 SSM state);
- the PLE short conv (on the decoder layer before ``ple_layer_ids``): a ``MambaSpec``;
- each QSA layer, in VRAM: the indexer's compressed keys, one state of
  ``indexer_head_dim`` bf16 plus an 8-byte position per ``indexer_compress_ratio`` tokens (the seed's
  offload layout: 66 B/token at 128/4; vLLM 0.33.0's own compressed cache has no position and
  would be 64), and the raw-key ring (``CircularBufferSpec``, one block per request);
- in host memory, the QSA main K and V: ``2 x num_key_value_heads x head_dim`` bf16 per token.

The grouping is vLLM's ``get_kv_cache_groups`` over all ranks' layers with the block-outermost
layout (the only one that packs a rank's QSA layers into one page), each group is projected onto
each rank with vLLM's ``_project_kv_cache_groups_to_worker``, and a block's bytes on a rank come
from vLLM's ``_pool_bytes_per_block``. A request's blocks are each group's
``cdiv(max memory, page)``, summed, as ``get_max_concurrency_for_kv_cache_config`` does.

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

import importlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flashnext.manifests import manifest_path
from flashnext import envs
from flashnext.errors import FlashnextError
from flashnext.quant.records.jsonfile import read_json

ATTENTION_BLOCK_ALIGNMENT = 16
QSA_STATE_POSITION_BYTES = 8
KV_DTYPE_BYTES = 2  # bf16 K/V and keys
MANIFEST = manifest_path("qwen3.8-flash-next.json")


def base_manifest() -> dict:
    """The base checkpoint's pinned facts (:data:`MANIFEST`), read as every JSON input is."""
    return read_json(MANIFEST, "the base checkpoint's manifest")
# Transformers 5.18 renamed `qwen_sparse_attention` to `indexed_attention`; some releases say
# `full_attention` (vLLM 0.33.0 accepts all three).
QSA_LAYER_TYPES = ("full_attention", "qwen_sparse_attention", "indexed_attention")


@dataclass(frozen=True)
class TextConfig:
    """The part of a ``qwen4_exp`` text config that sizes the KV cache."""

    num_hidden_layers: int
    layer_types: tuple[str, ...]
    hidden_size: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    indexer_head_dim: int
    indexer_compress_ratio: int
    ple_layer_ids: tuple[int, ...]
    ple_conv_kernel_size: int
    ngram_size: int
    hc_count: int
    mtp_num_hidden_layers: int
    uses_mrope: bool

    @classmethod
    def from_dict(cls, config: dict, where: str) -> "TextConfig":
        text = config.get("text_config", config)
        try:
            n = int(text["num_hidden_layers"])
            types = text.get("layer_types")
            if types is None:
                interval = int(text["full_attention_interval"])
                types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
            rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
            return cls(
                num_hidden_layers=n,
                layer_types=tuple(types),
                hidden_size=int(text["hidden_size"]),
                num_key_value_heads=int(text["num_key_value_heads"]),
                head_dim=int(text["head_dim"]),
                linear_num_key_heads=int(text["linear_num_key_heads"]),
                linear_num_value_heads=int(text["linear_num_value_heads"]),
                linear_key_head_dim=int(text["linear_key_head_dim"]),
                linear_value_head_dim=int(text["linear_value_head_dim"]),
                linear_conv_kernel_dim=int(text["linear_conv_kernel_dim"]),
                indexer_head_dim=int(text["indexer_head_dim"]),
                indexer_compress_ratio=int(text["indexer_compress_ratio"]),
                ple_layer_ids=tuple(int(i) for i in text.get("ple_layer_ids") or ()),
                ple_conv_kernel_size=int(text.get("ple_conv_kernel_size", 4)),
                ngram_size=int(text.get("ngram_size", 3)),
                hc_count=int(text["hc_count"]),
                mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0)),
                uses_mrope="mrope_section" in rope,
            )
        except KeyError as missing:
            raise FlashnextError(f"{where}: the text config has no {missing.args[0]!r}") from None
        except (TypeError, ValueError) as bad:
            raise FlashnextError(f"{where}: malformed text config ({bad})") from None

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers:
            raise FlashnextError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - {"linear_attention", *QSA_LAYER_TYPES}
        if unknown:
            raise FlashnextError(f"unknown layer types {sorted(unknown)}")


def load_text_config(path: Path | None = None) -> TextConfig:
    """The base checkpoint's text config (pinned in ``manifests/``), or a snapshot's ``config.json``."""
    if path is None:
        where, data = str(MANIFEST), base_manifest()["text_config"]
    else:
        path = Path(path)
        config = path / "config.json" if path.is_dir() else path
        if not config.exists():  # a FIFO or a device exists: read_json refuses it as what it is
            raise FlashnextError(f"{config}: no such config.json")
        where, data = str(config), read_json(config, "the model config")
    return TextConfig.from_dict(data, where)


# Bytes each parameter of a streamed vision block is aligned to in its device slot (patch vit-stream).
VIT_SLOT_ALIGN = 256
# vLLM's default for Qwen3-VL's image processor without --mm-processor-kwargs max_pixels: 16,384
# tokens of 32 x 32 px (seed 000 §6: startup profiling then assumes a 16.7 MP image).
DEFAULT_MAX_PIXELS = 16384 * 32 * 32
# transformers' Qwen3-VL vision config default (a 48 x 48 grid of learned positions)
QWEN3_VL_POSITIONS = 2304


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's sizes (pinned in ``manifests/``); its weights are bf16."""

    depth: int
    hidden_size: int
    intermediate_size: int
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_mergers: int

    @classmethod
    def from_dict(cls, v: dict, where: str) -> "VisionConfig":
        try:
            return cls(int(v["depth"]), int(v["hidden_size"]), int(v["intermediate_size"]), int(v["patch_size"]),
                       int(v["temporal_patch_size"]), int(v["in_channels"]), int(v["spatial_merge_size"]),
                       int(v["out_hidden_size"]), int(v.get("num_position_embeddings", QWEN3_VL_POSITIONS)),
                       len(v.get("deepstack_visual_indexes") or ()))
        except KeyError as missing:
            raise FlashnextError(f"{where}: the vision config has no {missing.args[0]!r}") from None

    def block_parameter_bytes(self) -> list[int]:
        """One block's parameters (vLLM's Qwen3_VisionBlock: two LayerNorms, qkv, proj, fc1, fc2)."""
        h, i = self.hidden_size, self.intermediate_size
        counts = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, i * h, i, h * i, h]
        return [2 * c for c in counts]

    def block_bytes(self) -> int:
        return sum(self.block_parameter_bytes())

    def slot_bytes(self) -> int:
        """A device slot of vit-stream: the block's parameters, each aligned as BlockStream lays them out."""
        return sum(-(-b // VIT_SLOT_ALIGN) * VIT_SLOT_ALIGN for b in self.block_parameter_bytes())

    def other_bytes(self) -> int:
        """Patch embedding, position embedding and the merger(s): resident either way."""
        h, m = self.hidden_size, self.spatial_merge_size ** 2
        patch = h * self.in_channels * self.temporal_patch_size * self.patch_size ** 2 + h
        merged = h * m
        merger = 2 * h + merged * merged + merged + merged * self.out_hidden_size + self.out_hidden_size
        deepstack = 2 * merged + merged * merged + merged + merged * self.out_hidden_size + self.out_hidden_size
        return 2 * (patch + self.num_position_embeddings * h + merger + self.deepstack_mergers * deepstack)

    def activation_bytes(self, max_pixels: int) -> int:
        """An estimate of the encoder's peak activations for one image of ``max_pixels``: a block's
        largest tensors alive at once (residual, qkv, attention output, MLP input and output) in bf16,
        plus the merged output embeddings."""
        patches = max_pixels // self.patch_size ** 2
        h, i = self.hidden_size, self.intermediate_size
        tokens = patches // self.spatial_merge_size ** 2
        return 2 * patches * (h + 3 * h + h + 2 * i) + 2 * tokens * self.out_hidden_size * (1 + self.deepstack_mergers)


def load_vision_config(path: Path | None = None) -> VisionConfig | None:
    """The base checkpoint's vision config, or a snapshot's; None for a text-only config."""
    if path is None:
        where, data = str(MANIFEST), base_manifest().get("vision_config")
    else:
        path = Path(path)
        config = path / "config.json" if path.is_dir() else path
        where, data = str(config), read_json(config, "the model config").get("vision_config")
    return VisionConfig.from_dict(data, where) if data else None


@dataclass
class VisionPlan:
    """The vision tower's device memory on the first pipeline rank (vit-first-rank); bytes."""

    streamed: bool  # patch vit-stream: two block slots instead of every block
    max_pixels: int
    resident_weight_bytes: int
    streamed_weight_bytes: int
    weight_bytes: int  # the one that applies
    activation_bytes: int  # estimate, one image of max_pixels
    vram_bytes: int  # weight_bytes + activation_bytes


def vision_plan(vision: VisionConfig, streamed: bool, max_pixels: int) -> VisionPlan:
    resident = vision.other_bytes() + vision.depth * vision.block_bytes()
    slots = min(2, vision.depth)
    stream = vision.other_bytes() + slots * vision.slot_bytes() if vision.depth > slots else resident
    weights = stream if streamed else resident
    activations = vision.activation_bytes(max_pixels)
    return VisionPlan(streamed, max_pixels, resident, stream, weights, activations, weights + activations)


@dataclass(frozen=True)
class ServingShape:
    """What the plan needs from a profile's vLLM arguments and environment."""

    pipeline_parallel_size: int
    max_model_len: int
    kv_cache_memory_bytes: int
    prefix_caching: bool
    num_speculative_tokens: int
    layer_partition: tuple[int, ...] | None
    qsa_kv_offload: bool
    exact_host_pool: bool
    images: bool = True  # not --language-model-only
    vit_stream: bool = True
    max_pixels: int = DEFAULT_MAX_PIXELS

    @classmethod
    def from_profile(cls, profile, kv_cache_memory_bytes: int | None = None,
                     prefix_caching: bool | None = None) -> "ServingShape":
        """Read the profile's arguments with vLLM's own engine-argument parser."""
        import_vllm()
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        args, _ = parser.parse_known_args(list(profile.vllm_args))
        kv_bytes = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else args.kv_cache_memory_bytes
        if not kv_bytes:
            raise FlashnextError(
                f"profile {profile.name} sets no --kv-cache-memory-bytes; pass --kv-cache-memory-bytes N")
        if not args.max_model_len:
            raise FlashnextError(f"profile {profile.name} sets no --max-model-len")
        spec = args.speculative_config or {}
        if isinstance(spec, str):
            spec = json.loads(spec)
        partition = profile.env.get("VLLM_PP_LAYER_PARTITION")
        mm_kwargs = args.mm_processor_kwargs or {}
        if isinstance(mm_kwargs, str):
            mm_kwargs = json.loads(mm_kwargs)
        enabled = prefix_caching if prefix_caching is not None else bool(args.enable_prefix_caching)
        return cls(
            pipeline_parallel_size=int(args.pipeline_parallel_size),
            max_model_len=int(args.max_model_len),
            kv_cache_memory_bytes=int(kv_bytes),
            prefix_caching=enabled,
            num_speculative_tokens=int(spec.get("num_speculative_tokens", 0) or 0),
            layer_partition=tuple(int(x) for x in partition.split(",")) if partition else None,
            qsa_kv_offload=envs.VLLM_QSA_KV_OFFLOAD.enabled_in(profile.env),
            exact_host_pool=envs.VLLM_EXACT_HOST_POOL.enabled_in(profile.env),
            images=not bool(getattr(args, "language_model_only", False)),
            vit_stream=envs.VLLM_VIT_STREAM.enabled_in(profile.env),
            max_pixels=int(mm_kwargs.get("max_pixels", DEFAULT_MAX_PIXELS)),
        )


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


def next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def rank_layers(num_layers: int, pp: int, partition: tuple[int, ...] | None) -> list[range]:
    """Decoder layers per pipeline rank, as vLLM's ``get_pp_indices`` splits them."""
    from vllm.distributed.utils import get_pp_indices

    if partition is not None and (len(partition) != pp or sum(partition) != num_layers):
        raise FlashnextError(
            f"VLLM_PP_LAYER_PARTITION {','.join(map(str, partition))} does not split {num_layers} layers "
            f"into {pp} ranks")
    # get_pp_indices reads the partition from the environment, as the served engine will.
    previous = os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
    try:
        if partition is not None:
            os.environ["VLLM_PP_LAYER_PARTITION"] = ",".join(map(str, partition))
        return [range(*get_pp_indices(num_layers, rank, pp)) for rank in range(pp)]
    finally:
        os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
        if previous is not None:
            os.environ["VLLM_PP_LAYER_PARTITION"] = previous


def import_vllm() -> None:
    """Import vLLM for planning only: no device is used, so any machine can plan for another."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        importlib.import_module("vllm")
    except ImportError:
        raise FlashnextError("planning asks vLLM 0.33.0 for its KV cache rules: pip install 'flashnext[serve]'") from None


def _vllm_config(prefix_caching: bool):
    from vllm.config import VllmConfig

    config = VllmConfig()
    config.cache_config.kv_cache_layout = "BLHNC"
    config.cache_config.mamba_cache_mode = "align" if prefix_caching else "none"
    return config


def _state_specs(text: TextConfig, shape: ServingShape):
    """vLLM's MambaSpecs for a gated delta-net layer and for the PLE short conv."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.v1.kv_cache_interface import MambaSpec

    mode = "align" if shape.prefix_caching else "none"
    spec = shape.num_speculative_tokens
    gdn = MambaSpec(
        shapes=MambaStateShapeCalculator.gated_delta_net_state_shape(
            1, text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
            text.linear_value_head_dim, text.linear_conv_kernel_dim, spec),
        dtypes=MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto", "float32"),
        block_size=1, mamba_cache_mode=mode, num_speculative_blocks=spec)
    conv_state_len = (text.ple_conv_kernel_size - 1) * text.ngram_size
    ple = MambaSpec(
        shapes=MambaStateShapeCalculator.short_conv_state_shape(
            1, text.hidden_size * text.hc_count, conv_state_len + 1, spec),
        dtypes=MambaStateDtypeCalculator.short_conv_state_dtype(torch.bfloat16, "auto"),
        block_size=1, mamba_cache_mode=mode, num_speculative_blocks=spec, tp_replicated=True)
    return gdn, ple


def _qsa_specs(text: TextConfig, shape: ServingShape, block_size: int, is_draft: bool):
    """The VRAM-resident caches of one offloaded QSA layer: compressed keys and the raw-key ring."""
    import torch
    from vllm.v1.kv_cache_interface import CircularBufferSpec, MLAAttentionSpec

    ratio = text.indexer_compress_ratio
    compressed = MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=qsa_state_bytes(text) // KV_DTYPE_BYTES,
        dtype=torch.bfloat16, tokens_per_state=ratio, is_draft=is_draft)
    # The ring holds an open compression group plus the draft rows, in whole groups (QSAKeyStateCache).
    ring_head = -(-text.indexer_head_dim // 4) * 4 + (12 if text.uses_mrope else 0)
    ring = CircularBufferSpec(
        block_size=ring_capacity(text, shape.num_speculative_tokens), num_kv_heads=1, head_size=ring_head, head_size_v=0,
        dtype=torch.bfloat16, is_draft=is_draft)
    return compressed, ring


def ring_capacity(text: TextConfig, num_speculative_tokens: int) -> int:
    """Raw-key ring rows: an open compression group plus the draft rows, in whole groups."""
    ratio = text.indexer_compress_ratio
    return -(-(ratio + num_speculative_tokens) // ratio) * ratio


def qsa_state_bytes(text: TextConfig) -> int:
    """One compressed QSA key as the seed's offload keeps it in VRAM: the key and its position."""
    return text.indexer_head_dim * KV_DTYPE_BYTES + QSA_STATE_POSITION_BYTES


def qsa_vram_bytes_per_token(text: TextConfig) -> int:
    state_bytes = qsa_state_bytes(text)
    if state_bytes % text.indexer_compress_ratio:
        raise FlashnextError(f"a {state_bytes}-byte QSA state does not split over {text.indexer_compress_ratio} tokens")
    return state_bytes // text.indexer_compress_ratio


def qsa_host_bytes_per_token(text: TextConfig) -> int:
    return 2 * text.num_key_value_heads * text.head_dim * KV_DTYPE_BYTES


def _is_qsa(layer_type: str) -> bool:
    return layer_type in QSA_LAYER_TYPES


def qsa_layers_per_rank(text: TextConfig, pp: int, partition: tuple[int, ...] | None,
                        num_speculative_tokens: int) -> list[int]:
    """QSA layers on each pipeline rank; the MTP draft head's run on the last rank."""
    ranks = rank_layers(text.num_hidden_layers, pp, partition)
    per_rank = [sum(_is_qsa(text.layer_types[i]) for i in r) for r in ranks]
    per_rank[-1] += text.mtp_num_hidden_layers if num_speculative_tokens else 0
    return per_rank


def offload_block_size(text: TextConfig, pp: int, partition: tuple[int, ...] | None, num_speculative_tokens: int,
                       state_page_bytes: int) -> int:
    """The attention block size with the QSA K/V offloaded (seed 000 §2, §7): the largest multiple
    of 16 (and of the raw-key ring and the compression ratio) at which the busiest rank's QSA layers
    fit one state page at the seed's 66 B/token. The block size is common to all ranks, so the
    busiest one decides; the served engine (patch qsa-offload) takes its block size from here."""
    per_token = qsa_vram_bytes_per_token(text)
    alignment = math.lcm(ATTENTION_BLOCK_ALIGNMENT, ring_capacity(text, num_speculative_tokens),
                         text.indexer_compress_ratio)
    busiest = max(qsa_layers_per_rank(text, pp, partition, num_speculative_tokens))
    block_size = (state_page_bytes // (busiest * per_token)) // alignment * alignment if busiest else alignment
    if block_size == 0:
        raise FlashnextError(
            f"{busiest} QSA layers x {per_token} B/token do not fit one {state_page_bytes}-byte state page "
            f"at a block of {alignment} tokens")
    return block_size


# The decode-07 row cache's bookkeeping per set of a layer: an int64 tag, an int32 hitmark and
# an int64 bid; and one int32 epoch per layer (flashnext.quant.kernels.qsa_row_cache.RowCache).
ROW_CACHE_SET_BYTES = 8 + 4 + 8
ROW_CACHE_EPOCH_BYTES = 4


def qsa_arena_blocks(qsa_per_rank: list[int]) -> int:
    """Blocks of rows in each rank's staging arena: one per QSA layer of the busiest rank (seed 000
    §7: 5 x 9,776 rows with MTP on every rank, so that a prefill stages as many blocks anywhere)."""
    return max(qsa_per_rank, default=0)


def qsa_arena(text: TextConfig, qsa_per_rank: list[int], block_size: int) -> tuple[int, list[int], list[int]]:
    """The arena's rows, the row-cache rows each layer of each rank gets, and each rank's arena
    bytes (the rows and the row-cache state); a rank without QSA layers holds none."""
    rows = qsa_arena_blocks(qsa_per_rank) * block_size
    row_bytes = qsa_host_bytes_per_token(text)  # one token's K and V of every KV head, as on the host
    shares = [rows // n if n else 0 for n in qsa_per_rank]
    arena_bytes = [rows * row_bytes + n * (share * ROW_CACHE_SET_BYTES + ROW_CACHE_EPOCH_BYTES) if n else 0
                   for n, share in zip(qsa_per_rank, shares)]
    return rows, shares, arena_bytes


@dataclass
class KVCacheLayout:
    """What vLLM 0.33.0 makes of the model's KV cache specs: the whole-model groups and each
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
    """Build every rank's layer specs and group them with vLLM 0.33.0's ``get_kv_cache_groups``."""
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

    rank_specs: list[dict] = []
    for rank, layers in enumerate(ranks):
        specs: dict = {}
        for i in layers:
            if _is_qsa(text.layer_types[i]):
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


def plan(text: TextConfig, shape: ServingShape) -> Plan:
    """Lay out the KV cache for ``text`` served as ``shape``, with vLLM 0.33.0's grouping."""
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
        notes=offload_notes(),
        qsa_arena_rows=arena_rows,
        qsa_row_cache_rows=row_cache_rows,
        qsa_arena_bytes=arena_bytes,
        vram_bytes_total=[v + a for v, a in zip(vram, arena_bytes)],
    )


def offload_notes() -> list[str]:
    """What the plan assumes that the serving image does not yet provide."""
    from flashnext.serving.patch_series import load_series

    if any(p.id == "qsa-offload" for p in load_series()):
        return []
    return ["the QSA K/V offload this plan models (seed 000) is not in vLLM 0.33.0 nor yet in flashnext's "
            "patch series: until it is, the image keeps QSA K/V in VRAM and holds fewer tokens than planned"]


# The model families `plan` can model, and how. A new family is one function from a profile (and
# its overrides) to a Plan, registered here; the preflight and `serve` ask the same table.
PLANNED_FAMILIES = ("qwen4_exp",)


def plan_profile(profile, kv_cache_memory_bytes: int | None = None, prefix_caching: bool | None = None,
                 model: Path | None = None) -> Plan:
    """The plan of ``profile`` (a :class:`~flashnext.serving.profiles.Profile`) for its model family;
    a family with no capacity model is a :class:`FlashnextError` that says so."""
    if profile.model_family not in PLANNED_FAMILIES:
        raise FlashnextError(f"profile {profile.name} serves {profile.model_family}; plan models "
                             f"{', '.join(PLANNED_FAMILIES)} profiles only")
    shape = ServingShape.from_profile(profile, kv_cache_memory_bytes, prefix_caching)
    result = plan(load_text_config(model), shape)
    vision = load_vision_config(model) if shape.images else None
    if vision is not None:
        result.vision = vision_plan(vision, shape.vit_stream, shape.max_pixels)
        result.vram_bytes_with_images = [v + (result.vision.vram_bytes if rank == 0 else 0)
                                         for rank, v in enumerate(result.vram_bytes)]
        result.vram_bytes_total[0] += result.vision.vram_bytes
    return result
