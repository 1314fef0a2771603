"""The memory ledger: every byte flashnext's patches, hooks and kernels (and vLLM's KV pool and
vision tower beside them) hold on each pipeline rank's GPU and in pinned host memory, for a profile.

Each entry gives its device bytes once start-up is over (the model built and profiled, the KV cache
allocated and bound, the CUDA graphs captured), its device bytes at their peak while serving, its
pinned host bytes as allocated (rounded where PyTorch's caching host allocator takes them), and
which of vLLM's numbers it sits inside:

- ``weights``: allocated while vLLM builds and loads the model (``GPUModelRunner.load_model``,
  under its ``DeviceMemoryProfiler``), before anything is profiled;
- ``profiled peak``: a step's transients that vLLM's profile run (a ``max_num_batched_tokens``
  dummy step, the encoder's largest dummy image) makes too, whose blocks PyTorch's allocator keeps;
- ``KV memory``: the pool vLLM allocates from ``--kv-cache-memory-bytes``;
- ``none``: outside all three: allocated after the KV cache (at CUDA-graph capture, or mid-service),
  or host memory. Seed 000 ran the fullest 3090 with 24-34 MiB free (§5, §7): on the GPU, the
  entries here have that and nothing more.

One number has one home: every entry is computed by the sizing function its allocation site calls
(named in ``source``), from the model's text config and the serving shape ``plan`` reads. An entry
that lies inside another's bytes (``within``) is listed and not added again. ``flashnext plan``
prints the ledger; the preflight's host-RAM check, ``plan --host-ram`` and the rig planner count
the pinned terms of :func:`pinned_host_terms`, which sums the ledger's host entries.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from flashnext.serving.capacity.kv import qsa_arena_blocks, qsa_host_bytes_per_token, rank_layers, row_cache_bytes
from flashnext.serving.capacity.model import TextConfig, load_text_config, load_vision_config
from flashnext.serving.capacity.rules import HOST_HEADROOM, next_power_of_two, pinned_bytes
from flashnext.serving.capacity.shape import ServingShape
from flashnext.serving.capacity.vision import VIT_STREAM_SLOTS, slot_bytes, streamed_host_bytes

WEIGHTS, PROFILED_PEAK, KV_MEMORY, NONE = "weights", "profiled peak", "KV memory", "none"
BF16_BYTES = 2  # the release's K/V, router, PLE rows and its INT8 embedding's group scales
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: VocabParallelEmbedding pads its rows to it
# How the PLE table is served: the NVMe file (--ple-table), else pinned in that format
PLE_FORMATS = ("file", "nvfp4", "fp8", "bf16")
# What the draft loads as its embed_tokens (vLLM's _remap_mtp_weight_name), and how the release
# stores it (manifests/qwen3.8-flash-next.json "releases": embed_tokens INT8 g128, bf16 scales).
DRAFT_EMBED = "model.language_model.embed_tokens"
RELEASE_EMBED_GROUP = 128
RELEASE_HC_GROUP = 64  # the release's hyper-connection mixers: INT8 g64 (the same manifest's "releases")


@dataclass(frozen=True)
class LedgerEntry:
    """What one allocation holds on one rank, in bytes."""

    name: str
    owner: str  # the patch, hook or kernel; "vLLM" for its own pool and tower
    gpu_startup: int
    gpu_peak: int
    pinned_host: int
    inside: str  # WEIGHTS, PROFILED_PEAK, KV_MEMORY or NONE
    source: str  # the sizing function, shared with the allocation site
    within: str | None = None  # the entry whose bytes these are: listed, not added again
    term: str | None = None  # the preflight's host-RAM term that counts these pinned bytes
    note: str = ""
    # The checkpoint's own tensors laid out anew (the bytes vLLM loaded for them, replaced): plan's
    # VRAM table counts them in its weights column, not again as flashnext's (capacity/vram.py).
    checkpoint: bool = False

    @property
    def vllms(self) -> bool:
        """vLLM's own allocation (its KV pool, its vision tower), listed beside flashnext's."""
        return self.owner.startswith("vLLM")


@dataclass
class RankLedger:
    rank: int
    entries: list[LedgerEntry] = field(default_factory=list)

    def _sum(self, attr: str, inside: str | None = None) -> int:
        return sum(getattr(e, attr) for e in self.entries
                   if e.within is None and (inside is None or e.inside == inside))

    @property
    def gpu_startup(self) -> int:
        return self._sum("gpu_startup")

    @property
    def gpu_peak(self) -> int:
        return self._sum("gpu_peak")

    @property
    def pinned_host(self) -> int:
        return self._sum("pinned_host")

    @property
    def gpu_outside_vllm(self) -> int:
        """Device bytes at their peak that none of vLLM's numbers holds: what the headroom must."""
        return self._sum("gpu_peak", NONE)

    def to_json(self) -> dict:
        return {"rank": self.rank, "entries": [dataclasses.asdict(e) for e in self.entries],
                "gpu_startup_bytes": self.gpu_startup, "gpu_peak_bytes": self.gpu_peak,
                "pinned_host_bytes": self.pinned_host, "gpu_outside_vllm_bytes": self.gpu_outside_vllm}


@dataclass
class Ledger:
    ranks: list[RankLedger]

    def to_json(self) -> dict:
        return {"ranks": [r.to_json() for r in self.ranks]}


@dataclass(frozen=True)
class PinnedTerm:
    """One allocation that stays pinned in host memory for the server's life."""

    name: str
    bytes: int  # as allocated: power-of-two rounded when PyTorch's allocator takes it
    why: str


# --- the model facts the host terms read -----------------------------------------------------------

def _model_config(deployment):
    """The config.json the plan reads (the Deployment's, read once), or the pinned manifest's."""
    return deployment.model_config if deployment is not None else None


def _served(deployment):
    """The model vLLM serves (:attr:`~flashnext.serving.deployment.Deployment.served_model`, opened
    once, the overlays merged); None for the pinned base checkpoint."""
    return deployment.served_model if deployment is not None else None


def manifest_table_allocations(fmt: str) -> list[int]:
    """The pinned base checkpoint's PLE table as vLLM allocates it in ``fmt`` (bf16, nvfp4, fp8)."""
    from flashnext.quant.formats import float_rows
    from flashnext.serving.capacity.model import base_manifest

    table = base_manifest()["ple_table"]
    rows, d = int(table["padded_rows"]), int(table["row_elements"])
    return {"bf16": [rows * d * BF16_BYTES], "fp8": [rows * d],
            "nvfp4": [rows * d // 2, rows * d // float_rows.NVFP4_BLOCK]}[fmt]


def ple_table_allocations(model) -> list[int]:
    """The pinned allocations of the PLE tables, in bytes, of ``model`` (the served model, a
    :class:`~flashnext.quant.checkpoint.snapshot.Snapshot`: a Deployment's ``served_model``; None:
    the pinned manifest): one a table (its BF16 rows, from the shards and config); for a table that
    ``flashnext ple build --format`` quantized (config.json's ``ple_embedding_dtype``), vLLM's method
    allocates its ``weight`` (NVFP4 codes or FP8 rows) and, for NVFP4, its ``weight_scale`` blocks,
    each whole."""
    from flashnext.serving.capacity.model import base_manifest

    if model is None:
        table = base_manifest()["ple_table"]
        return [int(table["padded_rows"]) * int(table["row_elements"]) * BF16_BYTES]
    from flashnext.quant.overlays.ple_quant import quantized_table_allocations
    from flashnext.quant.ple.table import find_ple_source

    if model.text_config.get("ple_embedding_dtype") is not None:
        return quantized_table_allocations(model)
    layers = sorted(set(model.text_config.get("ple_layer_ids") or ()))
    return [find_ple_source(model, i).file_size for i in range(len(layers))]


def ple_table_bytes(model) -> int:
    """The PLE tables' bytes as vLLM holds them (:func:`ple_table_allocations`)."""
    return sum(ple_table_allocations(model))


def draft_embedding_bytes(model) -> int:
    """The MTP draft's ``embed_tokens`` as patch mtp-02 pins it at PP > 1: for the pinned base
    checkpoint (``model`` None) the release's INT8 g128 rows (``hooks/mtp.py``'s
    :func:`draft_embedding_pinned_bytes`, what ``finish_draft_embedding`` pins); for a served model
    (as for :func:`ple_table_allocations`) its tensors of that embedding (INT8 words and scales, or
    bf16 rows), per row as stored, over the vocabulary padded to 64 rows as vLLM's
    ``VocabParallelEmbedding`` allocates it."""
    from flashnext.quant.checkpoint.snapshot import text_config_of
    from flashnext.serving.capacity.model import base_manifest
    from flashnext.serving.hooks.mtp import draft_embedding_pinned_bytes

    text = text_config_of(base_manifest()) if model is None else model.text_config
    vocab, hidden = int(text["vocab_size"]), int(text["hidden_size"])
    if model is None:
        return draft_embedding_pinned_bytes(vocab, hidden, RELEASE_EMBED_GROUP, BF16_BYTES)
    from flashnext.errors import FlashnextError

    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    quantized = [f"{DRAFT_EMBED}.weight_packed", f"{DRAFT_EMBED}.weight_scale"]
    names = quantized if all(n in model.weight_map for n in quantized) else [f"{DRAFT_EMBED}.weight"]
    total = 0
    for name in names:
        _, entry = model.entry(name)
        if not entry.shape or entry.shape[0] != vocab:
            raise FlashnextError(f"{model.root}: {name} has shape {list(entry.shape)}; config.json's vocab_size "
                                 f"is {vocab}")
        total += entry.nbytes // vocab * padded
    return total


# --- the entries ------------------------------------------------------------------------------------

def _ple_ranks(text: TextConfig, ranks: list[range]) -> list[int]:
    """The rank of each PLE layer: the decoder layer before each of ``ple_layer_ids`` holds it."""
    return [next(r for r, layers in enumerate(ranks) if i - 1 in layers) for i in sorted(set(text.ple_layer_ids))]


def _file_backed(shape: ServingShape, ple_table: Path | None, ple_format: str | None) -> bool:
    return ple_table is not None or shape.ple_table_file or ple_format == "file"


def _decode_rows(shape: ServingShape) -> tuple[int, int]:
    """``(the query rows of the largest CUDA graph a decode step replays, those of the largest decode
    step that runs eagerly)``, 0 for none: a step is padded to the smallest captured size that holds
    it; one larger than every captured size (``max_num_seqs`` x (1 + draft tokens) rows at most)
    runs eagerly, beside the graphs' pool."""
    rows = shape.max_num_seqs * (1 + shape.num_speculative_tokens)
    sizes = shape.cudagraph_capture_sizes
    holding = [s for s in sizes if s >= rows]
    if holding:
        return min(holding), 0
    return max(sizes, default=0), rows


def _bitplane_layers(deployment) -> list[tuple[str, int, int, int]]:
    """The layers the served config.json lists as INT6 bit planes (patch int6-bitplane), as vLLM
    builds them: ``(module, N, K, group)`` from the served tensors (``uint8 [N, 3K/4]`` planes and
    their group scales), the modules of one parent with the same K merged as vLLM merges gate and
    up (or q, k and v); none for the pinned base checkpoint."""
    from flashnext.quant.formats.bitplane import BitplaneRecord

    config = deployment.served_config if deployment is not None else None
    record = BitplaneRecord.from_config(config) if config is not None else None
    if record is None:
        return []
    served = _served(deployment)
    merged: dict[tuple[str, int, int], int] = {}
    for module in record.modules:
        _, planes = served.entry(f"{module}.weight_packed")
        _, scales = served.entry(f"{module}.weight_scale")
        rows, k = planes.shape[0], planes.shape[1] * 4 // 3
        key = (module.rpartition(".")[0], k, k // scales.shape[1])
        merged[key] = merged.get(key, 0) + rows
    return [(parent, rows, k, group) for (parent, k, group), rows in merged.items()]


def _int8_embedding_group(deployment) -> int | None:
    """The group size of the INT8 ``embed_tokens`` that int8-modules' embedding method serves (the
    target's on the first rank, the MTP draft's own at PP > 1): the release's for the pinned base
    checkpoint; for a served model, the scheme its config.json's quantization config gives that
    tensor (None where it is no symmetric INT8 group scheme: vLLM's own bf16 embedding)."""
    if deployment is None or deployment.model is None:
        return RELEASE_EMBED_GROUP
    from flashnext.quant.formats.ct_config import (is_compressed_tensors, quantization_config_of, scheme_for,
                                                   symmetric_int_group_size)

    config = deployment.served_config
    quantization = quantization_config_of(config) if config is not None else None
    if not is_compressed_tensors(quantization):
        return None
    return symmetric_int_group_size(scheme_for(quantization, DRAFT_EMBED), 8)


# the patch whose layers call decode_mma with each of configs' rows
_DECODE_MMA_OWNERS = {"hc_down_inject": "decode-04", "int8_mma": "int8-modules", "bitplane_mma": "int6-bitplane"}


def _decode_mma_calls(text: TextConfig, shape: ServingShape, ranks: list[range],
                      deployment) -> list[list[tuple[str, int, int, int]]]:
    """Each rank's calls of decode_mma's tensor-core GEMM for 1..16 tokens, as ``(configs' row, N, K,
    group)``: the hyper-connection mixers' INT8 projections (int8-modules), their down/inject through
    decode-04's fused mix where it is on (its up then runs in decode-04's own kernel), and the layers
    a bit-plane overlay lists (int6-bitplane: the GEMM past the GEMV's tokens, and its warm-up).
    The LM head's INT8 words go through vLLM's own kernel on a GPU (Marlin, Machete)."""
    from flashnext.quant.kernels.hc_mix import HC_COUNT, mixer_shapes

    calls: list[list[tuple[str, int, int, int]]] = [[] for _ in ranks]
    if text.hc_lowrank:
        down, up = mixer_shapes(text.hidden_size, text.hc_count, text.hc_lowrank)
        fused = shape.hc_fused_decode and text.hc_count == HC_COUNT
        mixers = [("hc_down_inject", *down)] if fused else [("int8_mma", *down), ("int8_mma", *up)]
        for rank in calls:
            rank += [(*call, RELEASE_HC_GROUP) for call in mixers]
    for module, n, k, group in _bitplane_layers(deployment):
        layer = re.search(r"\blayers\.(\d+)\.", module)
        if module.startswith("mtp."):  # the draft's layers live with the last rank
            where = [len(ranks) - 1]
        elif layer:
            where = [r for r, layers in enumerate(ranks) if int(layer.group(1)) in layers]
        else:
            where = range(len(ranks))
        for r in where:
            if ("bitplane_mma", n, k, group) not in calls[r]:
                calls[r].append(("bitplane_mma", n, k, group))
    return calls


def _host_entries(text: TextConfig, shape: ServingShape, plan, ranks: list[range], deployment,
                  ple_table: Path | None, ple_format: str | None) -> list[list[LedgerEntry]]:
    """Each rank's pinned host entries: the preflight's terms and what it does not count yet."""
    exact = shape.exact_host_pool
    pp = len(ranks)
    out: list[list[LedgerEntry]] = [[] for _ in range(pp)]
    per_layer = plan.blocks * plan.block_size * qsa_host_bytes_per_token(text)
    for r, n in enumerate(plan.qsa_layers_per_rank):
        if n:
            out[r].append(LedgerEntry(
                "QSA K/V host rows", "qsa-offload, host-pool", 0, 0, n * pinned_bytes(per_layer, exact), NONE,
                "kv.qsa_host_bytes_per_token x plan blocks x block size, a pool a layer", term="QSA K/V",
                note=f"{n} layer(s) x {plan.blocks} blocks x {plan.block_size:,} tokens x "
                     f"{qsa_host_bytes_per_token(text):,} B, bound at KV cache allocation"))
    ple_ranks = _ple_ranks(text, ranks) if text.ple_layer_ids else []
    if ple_ranks and not _file_backed(shape, ple_table, ple_format) and shape.engram_cpu_offload:
        served = _served(deployment)
        allocations = (manifest_table_allocations(ple_format) if ple_format and served is None
                       else ple_table_allocations(served))
        why = (f"the table pinned as {ple_format}" if ple_format else "no --ple-table") + \
            ": vLLM's engram cpu_offload pins it whole"
        out[ple_ranks[0]].append(LedgerEntry(
            "PLE table (pinned)", "vLLM engram cpu_offload, host-pool", 0, 0,
            sum(pinned_bytes(n, exact) for n in allocations), NONE, "ple_table_allocations", term="PLE table",
            note=why))
    if ple_ranks and _file_backed(shape, ple_table, ple_format) and text.ple_ngram_heads:
        from flashnext.serving.runtime.ple_file import staged_rows_shape

        rows, heads, dim = staged_rows_shape(shape.max_num_batched_tokens, text.ple_ngram_heads, text.ple_head_dim)
        for r in ple_ranks:
            out[r].append(LedgerEntry(
                "ple-mmap host staging", "ple-mmap", 0, 0, next_power_of_two(rows * heads * dim * BF16_BYTES), NONE,
                "runtime/ple_file.staged_rows_shape", term="PLE staging rows",
                note="torch.empty(pin_memory=True) at the first stage (the profile run), rounded by "
                     "PyTorch's caching host allocator"))
    if shape.speculative_method == "mtp" and pp > 1 and shape.mtp_slim_draft:
        out[-1].append(LedgerEntry(
            "MTP draft embedding", "mtp-02, host-pool", 0, 0, pinned_bytes(draft_embedding_bytes(_served(deployment)), exact), NONE,
            "hooks/mtp.draft_embedding_pinned_bytes", term="MTP draft embedding",
            note="patch mtp-02 (VLLM_MTP_SLIM_DRAFT): read through UVA views, no device copy"))
    vision = plan.vision
    if vision is not None and vision.streamed and vision.streamed_weight_bytes < vision.resident_weight_bytes:
        tower = load_vision_config(_model_config(deployment))
        out[0].append(LedgerEntry(
            "vit-stream host rows", "vit-stream, host-pool", 0, 0, pinned_bytes(streamed_host_bytes(tower), exact),
            NONE, "vision.streamed_host_bytes", term="ViT blocks",
            note=f"patch vit-stream: {tower.depth} blocks in one pinned row each"))
        loading = sum(next_power_of_two(n) for n in tower.linear_parameter_bytes())
        out[0].append(LedgerEntry(
            "ViT linears pinned by vLLM's post-load step", "vLLM device_loading_context (vit-stream)", 0, 0, 0, NONE,
            "VisionConfig.linear_parameter_bytes, each rounded as PyTorch pins it",
            note=f"during load only: vLLM's post-load step takes the CPU-built tower's linears to the GPU "
                 f"and back into torch.empty_like(pin_memory=True), {loading / 2**20:,.1f} MiB; vit-stream's "
                 f"install copies them into its rows and returns them (torch.accelerator.empty_host_cache)"))
    return out


def _gpu_entries(text: TextConfig, shape: ServingShape, plan, ranks: list[range], deployment,
                 ple_table: Path | None,
                 ple_format: str | None) -> list[list[LedgerEntry]]:
    from flashnext.quant.kernels import configs
    import torch

    from flashnext.quant.kernels.qsa_row_cache import partials_bytes, staged_scratch, tensor_bytes, warm_tensors
    from flashnext.serving.runtime.qsa_offload import row_slots_bytes

    pp = len(ranks)
    out: list[list[LedgerEntry]] = [[] for _ in range(pp)]
    for r in range(pp):
        out[r].append(LedgerEntry(
            "KV cache pool", "vLLM (qsa-offload's block size)", plan.vram_bytes[r], plan.vram_bytes[r], 0, KV_MEMORY,
            "plan: blocks x vLLM's _pool_bytes_per_block",
            note=f"{plan.blocks} blocks x {plan.bytes_per_block[r]:,} B"))
    arena_blocks = qsa_arena_blocks(plan.qsa_layers_per_rank)
    block_bytes = plan.block_size * qsa_host_bytes_per_token(text)
    compressed = next((g for g in plan.groups if g.kind == "qsa_compressed_key"), None)
    table_width = compressed.blocks_per_request if compressed else 1
    scratch = staged_scratch(shape.max_num_batched_tokens, text.num_attention_heads, text.head_dim, arena_blocks,
                             block_bytes, plan.blocks, shape.max_num_seqs * table_width) if arena_blocks else None
    graph_rows, eager_rows = _decode_rows(shape)
    splits = configs.default_config("qsa_attention").splits
    for r, n in enumerate(plan.qsa_layers_per_rank):
        if not n:
            continue
        arena, state = row_cache_bytes(text, n, arena_blocks, plan.block_size)
        out[r].append(LedgerEntry(
            "QSA staging arena", "qsa-offload", arena, arena, 0, WEIGHTS, "qsa_row_cache.row_cache_tensors",
            note=f"{arena_blocks} blocks x {plan.block_size:,} rows of {qsa_host_bytes_per_token(text):,} B, "
                 "built with the first QSA layer"))
        out[r].append(LedgerEntry(
            "decode-07 row-cache state", "qsa-offload (decode-07)", state, state, 0, WEIGHTS,
            "qsa_row_cache.row_cache_tensors",
            note=f"{n} layer(s) x {arena_blocks * plan.block_size // n:,} sets: tag, hitmark, bid; an epoch each"))
        if scratch.in_arena:
            out[r].append(LedgerEntry(
                "staged-prefill scratch", "qsa-offload (qsa_row_cache.staged_attention)", 0, scratch.nbytes, 0,
                WEIGHTS, "qsa_row_cache.staged_scratch", within="QSA staging arena",
                note=f"the arena's last {arena_blocks - scratch.window_blocks} block(s): fp32 state of "
                     f"{scratch.rows} rows, {scratch.chunk_rows}-row partials, block tables; windows of "
                     f"{scratch.window_blocks} blocks"))
        else:
            out[r].append(LedgerEntry(
                "staged-prefill scratch", "qsa-offload (qsa_row_cache.staged_attention)", 0, scratch.nbytes, 0,
                NONE, "qsa_row_cache.staged_scratch",
                note="the arena cannot hold it beside one staged block: allocated by each prefill step"))
        topk = text.indexer_budget + text.indexer_compress_ratio - 1
        warm = partials_bytes(splits, 1, text.num_attention_heads, text.head_dim) + sum(
            tensor_bytes(shape, dtype or torch.bfloat16)
            for shape, dtype in warm_tensors(text.num_attention_heads, text.head_dim, topk, plan.blocks).values())
        out[r].append(LedgerEntry(
            "prefill kernels' warm-up", "qsa-offload (RowCache.warm)", warm, warm, 0, NONE,
            "qsa_row_cache.warm_tensors, partials_bytes",
            note="at the KV cache's bind, before the CUDA graphs: one query row over every host block, "
                 "so that no prefill compiles a kernel while serving; freed into PyTorch's cache"))
        graph_partials = partials_bytes(splits, graph_rows, text.num_attention_heads, text.head_dim)
        eager_partials = partials_bytes(splits, eager_rows, text.num_attention_heads, text.head_dim)
        out[r].append(LedgerEntry(
            "decode-07 partials", "qsa-offload (decode-07)", graph_partials, graph_partials + eager_partials, 0,
            NONE, "qsa_row_cache.partials_bytes",
            note=f"{splits} splits, fp32: " + "; ".join(
                ([f"{graph_rows} rows in the CUDA graphs' pool (captured after the KV cache)"] if graph_rows else [])
                + ([f"{eager_rows} rows in each eager decode step"] if eager_rows else []))))
        graph_slots = row_slots_bytes(graph_rows)
        out[r].append(LedgerEntry(
            "QSA row slots", "qsa-offload (OffloadedQSA.main_metadata)", graph_slots,
            graph_slots + row_slots_bytes(shape.max_num_batched_tokens), 0, NONE, "runtime/qsa_offload.row_slots_bytes",
            note=f"each step's host row of every token, worked out by each QSA layer and freed when it returns: "
                 f"{shape.max_num_batched_tokens} tokens in an eager step"
                 + (f", {graph_rows} in the CUDA graphs' pool" if graph_rows else "")))
    if shape.moe_fused_decode and text.num_experts:
        from flashnext.serving.hooks.moe_decode import router_rows_shape

        experts, hidden = router_rows_shape(text.num_experts, text.hidden_size)
        per_block = experts * hidden * BF16_BYTES
        mtp = text.mtp_num_hidden_layers if shape.num_speculative_tokens else 0
        for r, layers in enumerate(ranks):
            blocks = len(layers) + (mtp if r == pp - 1 else 0)
            out[r].append(LedgerEntry(
                "decode-05 router rows", "decode-05 (hooks/moe_decode.merge_router_rows)",
                blocks * per_block, blocks * per_block, 0, WEIGHTS, "hooks/moe_decode.router_rows_shape",
                note=f"{blocks} MoE blocks x [{experts}, {hidden}] bf16, made by each block's post-load hook "
                     "(vLLM's finalize_model_weights) from the router's and shared gate's weights, which it "
                     "replaces: the bytes vLLM holds for them, in one allocation a block", checkpoint=True))
        from flashnext.quant.kernels.moe_route import route_scratch_bytes
        from flashnext.serving.hooks.moe_decode import MAX_FUSED_TOKENS

        partials, counters = route_scratch_bytes(text.num_experts, text.hidden_size)
        captured = any(s <= MAX_FUSED_TOKENS for s in shape.cudagraph_capture_sizes)
        for r in range(pp):
            out[r].append(LedgerEntry(
                "decode-05 split-K scratch", "decode-05 (moe_route.route)", counters + (partials if captured else 0),
                counters + partials, 0, NONE, "moe_route.route_scratch_bytes",
                note="a fused step's fp32 split-K partials (at most one split a K step), in the CUDA graphs' pool "
                     "or each eager step of 1..4 tokens, and the split-K counters its first launch keeps; its "
                     "logits and top-k stand where vLLM's router puts its own"))
    calls = _decode_mma_calls(text, shape, ranks, deployment)
    if any(calls):
        from flashnext.quant.kernels.decode_mma import MMA_MAX_TOKENS, mma_scratch_bytes

        captured = any(s <= MMA_MAX_TOKENS for s in shape.cudagraph_capture_sizes)
        for r, rank_calls in enumerate(calls):
            if not rank_calls:
                continue
            scratch = {call: mma_scratch_bytes(*call) for call in rank_calls}
            (kernel, n, k, _), (partials, _) = max(scratch.items(), key=lambda item: item[1][0])
            counters = max(c for _, c in scratch.values())
            owners = sorted({_DECODE_MMA_OWNERS[call[0]] for call in rank_calls})
            out[r].append(LedgerEntry(
                "decode_mma split-K scratch", f"{', '.join(owners)} (decode_mma)",
                counters + (partials if captured else 0), counters + partials * (2 if captured else 1), 0, NONE,
                "decode_mma.mma_scratch_bytes",
                note=f"one call's fp32 split-K partials, at most {partials:,} B ({kernel} [{n}, {k}]): in the CUDA "
                     "graphs' pool and again in an eager step of 1..16 tokens; and the split-K counters the first "
                     "launch keeps (at the load where a bit-plane layer warms its kernels, else at the capture)"))
    group = _int8_embedding_group(deployment)
    if group:
        from flashnext.quant.kernels.decode_mma import gathered_rows_bytes

        rows = gathered_rows_bytes(shape.max_num_batched_tokens, text.hidden_size, group)
        draft = shape.speculative_method == "mtp" and pp > 1
        for r in sorted({0, pp - 1} if draft else {0}):
            out[r].append(LedgerEntry(
                "INT8 embedding's rows", "int8-modules (Int8EmbeddingMethod.embedding)" + (", mtp-01" if r else ""),
                0, rows, 0, PROFILED_PEAK, "decode_mma.gathered_rows_bytes",
                note=f"a step's {shape.max_num_batched_tokens} rows of the "
                     + ("MTP draft's own embedding (the target's is on rank 0)" if r else "embedding") +
                     ": the INT8 words and scales gathered, their codes and the fp32 product, beside the bf16 rows "
                     "that stand where vLLM's embedding's would; vLLM's profile run embeds a step of the budget"
                     + (" (at PP=1 the draft shares this embedding)" if not r and shape.speculative_method == "mtp"
                        and pp == 1 else "")))
    vision = plan.vision
    if vision is not None:
        tower = None
        if vision.streamed and vision.streamed_weight_bytes < vision.resident_weight_bytes:
            tower = load_vision_config(_model_config(deployment))
        slots = VIT_STREAM_SLOTS * slot_bytes(tower.block_parameter_bytes()) if tower else 0
        resident = vision.weight_bytes - slots
        out[0].append(LedgerEntry(
            "vision tower (resident)", "vLLM (vit-first-rank)", resident, resident, 0, WEIGHTS,
            "VisionConfig.other_bytes" + (" (vit-stream)" if tower else " + its blocks")))
        if tower:
            out[0].append(LedgerEntry(
                "vit-stream block slots", "vit-stream", slots, slots, 0, WEIGHTS, "vision.slot_bytes",
                note=f"{VIT_STREAM_SLOTS} slots of one block, at the model's post-load step"))
        out[0].append(LedgerEntry(
            "vision encoder activations", "vLLM", 0, vision.activation_bytes, 0, PROFILED_PEAK,
            "VisionConfig.activation_bytes (an estimate)",
            note=f"one {vision.max_pixels:,}-pixel image; vLLM profiles the encoder with it"))
    if text.ple_layer_ids and _file_backed(shape, ple_table, ple_format) and text.ple_ngram_heads:
        from flashnext.serving.runtime.ple_file import staged_rows_shape

        rows, heads, dim = staged_rows_shape(shape.max_num_batched_tokens, text.ple_ngram_heads, text.ple_head_dim)
        for r in _ple_ranks(text, ranks):
            out[r].append(LedgerEntry(
                "ple-mmap staged rows", "ple-mmap", rows * heads * dim * BF16_BYTES, rows * heads * dim * BF16_BYTES,
                0, WEIGHTS, "runtime/ple_file.staged_rows_shape",
                note=f"[{rows}, {heads}, {dim}] bf16, built with the model"))
    return out


def ledger(text: TextConfig, shape: ServingShape, plan, *, deployment=None, ple_table: Path | None = None,
           ple_format: str | None = None) -> Ledger:
    """The ledger of ``text`` served as ``shape`` with ``plan`` (its :func:`~.qwen4_exp.plan`, the
    vision tower in it where the profile serves images); ``deployment``, ``ple_table`` and
    ``ple_format`` say where the host terms' facts come from, as for :func:`pinned_host_terms`."""
    ranks = rank_layers(text.num_hidden_layers, shape.pipeline_parallel_size, shape.layer_partition)
    gpu = _gpu_entries(text, shape, plan, ranks, deployment, ple_table, ple_format)
    host = _host_entries(text, shape, plan, ranks, deployment, ple_table, ple_format)
    return Ledger([RankLedger(r, gpu[r] + host[r]) for r in range(len(ranks))])


def profile_ledger(profile, plan, *, deployment=None, ple_format: str | None = None) -> Ledger:
    """The ledger of ``profile`` with its ``plan``: a profile that serves the PLE table from a file
    (``uses_ple_table``: ``serve`` refuses it without ``--ple-table``) is counted with the file unless
    ``ple_format`` says otherwise. ``deployment``: where the model facts come from, as for
    :func:`pinned_host_terms`."""
    shape = ServingShape.from_profile(profile, plan.kv_cache_memory_bytes, plan.prefix_caching)
    if ple_format is None and profile.uses_ple_table:
        ple_format = "file"
    text = load_text_config(_model_config(deployment))
    return ledger(text, shape, plan, deployment=deployment, ple_format=ple_format)


# --- the preflight's host terms, from the ledger ---------------------------------------------------

TERMS = ("QSA K/V", "PLE table", "PLE staging rows", "MTP draft embedding", "ViT blocks")


def pinned_host_terms(shape, plan, deployment=None, ple_format: str | None = None) -> list[PinnedTerm]:
    """Every host allocation the preflight counts for a profile served as ``shape`` (a
    :class:`~flashnext.serving.capacity.ServingShape`) with ``plan``, each as it is allocated: the
    ledger's host entries with a term, summed over ranks. The model facts are ``deployment``'s
    (:class:`~flashnext.serving.deployment.Deployment`: its config.json and its served model, read
    once, and its PLE table file), as ``plan`` is; None: the pinned base checkpoint. ``ple_format``
    (for the base checkpoint, as ``flashnext plan`` asks): the table served from a file, or pinned
    in that format; None: as the profile and the model say."""
    text = load_text_config(_model_config(deployment))
    ple_table = deployment.ple_table if deployment is not None else None
    ranks = rank_layers(text.num_hidden_layers, shape.pipeline_parallel_size, shape.layer_partition)
    entries = [e for rank in _host_entries(text, shape, plan, ranks, deployment, ple_table, ple_format)
               for e in rank if e.term]
    whys = {"QSA K/V": f"{sum(plan.qsa_layers_per_rank)} layers x {plan.blocks} blocks (flashnext plan)"}
    terms = []
    for name in TERMS:
        counted = [e for e in entries if e.term == name]
        if counted or name == "QSA K/V":  # the plan's pools are a term even where they are empty
            terms.append(PinnedTerm(name, sum(e.pinned_host for e in counted), whys.get(name, counted[0].note)))
    return terms


def host_fit(shape, plan, terms: list[PinnedTerm], available: int) -> tuple[bool, int | None]:
    """Whether ``terms`` and the pool's headroom fit ``available`` host bytes, and the largest
    ``--kv-cache-memory-bytes`` whose QSA K/V would fit beside the rest (None without the
    exact-size pool, whose pools PyTorch rounds, or when no block fits)."""
    need = sum(t.bytes for t in terms)
    others = need - plan.pinned_host_bytes_needed
    per_block = plan.pinned_host_bytes_needed / plan.blocks
    fits = max(int((available - HOST_HEADROOM - others) // per_block), 0) if shape.exact_host_pool else 0
    return need + HOST_HEADROOM <= available, (fits * max(plan.bytes_per_block) if fits else None)


# --- as text ------------------------------------------------------------------------------------------

def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}" if n else "-"


def markdown(result: Ledger) -> str:
    """The ledger as one Markdown table a rank (MiB), with each rank's totals: what ``flashnext plan``
    prints and docs/serving.md shows."""
    lines = []
    for rank in result.ranks:
        lines += [f"rank {rank.rank}:", "",
                  "| entry | owner | GPU at start-up (MiB) | GPU serving peak (MiB) | pinned host (MiB) | inside |",
                  "|---|---|--:|--:|--:|---|"]
        for e in rank.entries:
            inside = f"{e.inside} (within the {e.within})" if e.within else e.inside
            lines.append(f"| {e.name} | {e.owner} | {_mib(e.gpu_startup)} | {_mib(e.gpu_peak)} | "
                         f"{_mib(e.pinned_host)} | {inside} |")
        lines.append(f"| **total** | | **{_mib(rank.gpu_startup)}** | **{_mib(rank.gpu_peak)}** | "
                     f"**{_mib(rank.pinned_host)}** | outside vLLM's numbers: {_mib(rank.gpu_outside_vllm)} MiB |")
        lines.append("")
    return "\n".join(lines).rstrip("\n")
