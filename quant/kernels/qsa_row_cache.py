"""QSA sparse attention over K/V rows in pinned host memory, with a VRAM row cache (seed 000 §5).

With the QSA main K/V offloaded, one token's K and V (all KV heads of the rank, 2 KiB at 2 x 256
bf16) are one *row* of a host pool ``[num_blocks, block_size, kv_heads, 2 * head_dim]``, addressed
by its physical slot ``block * block_size + offset``. The GPU reads the rows the indexer selected
through unified addressing, over PCIe. Consecutive decode steps select mostly the same rows
(72% overlap with the previous step, 86% with the last four), so the VRAM staging arena, idle
during decode, doubles as a direct-mapped row cache (decode-07):

* each QSA layer owns ``sets`` consecutive arena rows; a slot lives in set ``slot % sets``, its
  tag is the slot, ``-1`` is empty. The key is the physical slot, so requests that share prefix
  blocks share cached rows;
* host rows change only when stored, so :func:`invalidate_slots` drops a stored slot's row; a
  staged prefill overwrites the arena and :meth:`RowCache.invalidate_all` drops every tag.

One step of one layer is two launches after the invalidation:

1. :func:`plan_row_cache` (the only grid-wide step): a column whose slot is cached writes
   ``hitmark[set] = epoch``; a missing column bids ``claim[set] = max(epoch << 32 | slot)``;
2. :func:`row_cache_attention`: split-K sparse attention that loads each row through one pointer,
   ``where(hit, arena_row, host_row)``, and writes a missed row and its tag only where its bid won
   and nothing hit the set this step.

A set that was hit is never written in that step, and a set that may be written is never read as
a hit (its hitmark is not the epoch), so tags can be read and written in the same launch. Epochs
make hitmarks and bids expire without clearing; :class:`RowCache` clears them when the epoch
counter wraps. A hit reads the same bytes as the host row and the tile arithmetic is unchanged, so
the output is bit-identical to reading everything from the host.

Prefill does not use the cache: :func:`staged_attention` copies whole blocks of the context from
the host pool into the arena with DMA, a window of blocks at a time, and runs the same kernel over
each window, one program per query row and KV head; each window's result is folded into a running
fp32 state (:func:`_fold_kernel`), gated once at the end. Its scratch (the state, one chunk of
partials, the block remap) lies in the arena's last blocks, which then stage no window
(:func:`staged_scratch`): a prefill allocates no device memory, however many windows its context
spans (seed 000 §5: the staged prefill ran within the 95 MiB staging arena), and its kernels'
variants do not depend on the window count.

Launch configurations (``configs``' ``qsa_attention`` rows) fit the RTX 3090's 99 KiB of shared
memory per block by construction (``tests/quant/kernels/test_qsa_row_cache.py`` compiles them for
sm_86 and checks). The torch references are in :mod:`.reference`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashnext.quant.kernels import configs
from flashnext.quant.kernels._common import INTERPRETED
from flashnext.quant.kernels.configs import AttentionConfig

EMPTY_TAG = -1
_EMPTY = tl.constexpr(EMPTY_TAG)  # the same, as kernels read a global
# Decode-shaped batches (at most this many query rows) use the row cache: one launch
# configuration, compiled when the CUDA graphs are captured. Larger eager batches would load
# more kernel variants while serving, which the fullest 3090 cannot afford (seed 000 §5: an OOM).
ROW_CACHE_MAX_ROWS = 12
PLAN_BLOCK = 32  # selected columns per program of the plan
# The sizes of the engine's tables (vLLM's block-table width and its stride, the blocks of the host
# rows or of an arena window, the batch's requests) are plain arguments, not specialized on: the
# kernels' variants are then the model's and the block size's alone, which the warm-up at bind
# (RowCache.warm) knows before vLLM has built a block table.
ENGINE_SIZES = ["stride_table_req", "num_requests", "num_blocks", "table_width"]
# The epoch lives in the high 32 bits of a bid and in an int32 hitmark.
EPOCH_LIMIT = 2**31 - 1


@triton.jit
def _column_slots(indices_ptr, stride_indices_row, block_table_ptr, stride_table_req, row, request, num_requests,
                  num_blocks, table_width, columns, count, TOPK: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """The physical slots of a row's selected columns, and which of them are valid."""
    token = tl.load(indices_ptr + row * stride_indices_row + columns, mask=(columns < TOPK) & (columns < count),
                    other=-1)
    safe_token = tl.maximum(token, 0)
    page = safe_token // PAGE_SIZE
    valid = (token >= 0) & (request >= 0) & (request < num_requests) & (page < table_width)
    safe_request = tl.minimum(tl.maximum(request, 0), num_requests - 1)
    block = tl.load(block_table_ptr + safe_request * stride_table_req + tl.minimum(page, table_width - 1),
                    mask=valid, other=-1)
    valid &= (block >= 0) & (block < num_blocks)
    slot = tl.maximum(block, 0).to(tl.int64) * PAGE_SIZE + (safe_token % PAGE_SIZE)
    return slot, valid


@triton.jit(do_not_specialize=["num_slots"])  # one variant for a store of any size (a 16-token one too)
def _invalidate_kernel(tags_ptr, slots_ptr, num_slots, sets, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + offsets, mask=offsets < num_slots, other=-1).to(tl.int64)
    live = (offsets < num_slots) & (slot >= 0)
    where = tl.where(live, slot % sets, 0)
    tag = tl.load(tags_ptr + where, mask=live, other=_EMPTY)
    tl.store(tags_ptr + where, tl.full(where.shape, _EMPTY, tl.int64), mask=live & (tag == slot))


@triton.jit(do_not_specialize=ENGINE_SIZES)
def _plan_kernel(indices_ptr, stride_indices_row, block_table_ptr, stride_table_req, token_to_req_ptr, tags_ptr,
                 hitmark_ptr, claim_ptr, epoch_ptr, sets, num_requests, num_blocks, table_width, TOPK: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    epoch = tl.load(epoch_ptr)
    request = tl.load(token_to_req_ptr + row)
    count = tl.load(indices_ptr + row * stride_indices_row + TOPK)
    slot, valid = _column_slots(indices_ptr, stride_indices_row, block_table_ptr, stride_table_req, row, request,
                                num_requests, num_blocks, table_width, columns, count, TOPK, PAGE_SIZE)
    where = tl.where(valid, slot % sets, 0)
    tag = tl.load(tags_ptr + where, mask=valid, other=_EMPTY)
    hit = valid & (tag == slot)
    tl.store(hitmark_ptr + where, tl.full(where.shape, epoch, tl.int32), mask=hit)
    bid = (tl.full(where.shape, epoch, tl.int64) << 32) | slot
    tl.atomic_max(claim_ptr + where, bid, mask=valid & ~hit)


@triton.jit(do_not_specialize=["num_rows", "split_offset", *ENGINE_SIZES])
def _attention_kernel(q_ptr, host_ptr, arena_ptr, indices_ptr, block_table_ptr, token_to_req_ptr, tags_ptr,
                      hitmark_ptr, claim_ptr, partial_out_ptr, partial_lse_ptr, epoch_ptr, sets, softmax_scale,
                      stride_q_row, stride_q_head, stride_host_block, stride_host_token, stride_indices_row,
                      stride_table_req, num_rows, num_requests, num_blocks, table_width, split_offset,
                      TOPK: tl.constexpr, PAGE_SIZE: tl.constexpr,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
                      KV_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK: tl.constexpr, USE_CACHE: tl.constexpr, DOT_FP32: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    request = tl.load(token_to_req_ptr + row)
    count = tl.load(indices_ptr + row * stride_indices_row + TOPK)
    heads = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    first_head = kv_head * GROUP
    query = tl.load(q_ptr + row * stride_q_row + (first_head + heads[:, None]) * stride_q_head + dims[None, :],
                    mask=heads[:, None] < GROUP, other=0.0)
    row_width = KV_HEADS * 2 * HEAD_DIM
    head_offset = kv_head * 2 * HEAD_DIM
    scale = softmax_scale * 1.4426950408889634  # exp2-based online softmax
    running_max = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    normalizer = tl.zeros((BLOCK_M,), tl.float32)
    accumulator = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    num_tiles = tl.cdiv(tl.minimum(count, TOPK), BLOCK)
    for tile in range(split, num_tiles, NUM_SPLITS):
        columns = tile * BLOCK + tl.arange(0, BLOCK)
        slot, valid = _column_slots(indices_ptr, stride_indices_row, block_table_ptr, stride_table_req, row,
                                    request, num_requests, num_blocks, table_width, columns, count, TOPK,
                                    PAGE_SIZE)
        host_row = host_ptr + (slot // PAGE_SIZE) * stride_host_block + (slot % PAGE_SIZE) * stride_host_token
        if USE_CACHE:
            epoch = tl.load(epoch_ptr)
            where = tl.where(valid, slot % sets, 0)
            marked = tl.load(hitmark_ptr + where, mask=valid, other=0) == epoch
            # Only a set hit this step is read: no program writes it in this launch.
            tag = tl.load(tags_ptr + where, mask=valid & marked, other=_EMPTY)
            hit = valid & marked & (tag == slot)
            cached_row = arena_ptr + where * row_width
            row_ptr = tl.where(hit, cached_row, host_row) + head_offset
        else:
            row_ptr = host_row + head_offset
        keys = tl.load(row_ptr[None, :] + dims[:, None], mask=valid[None, :], other=0.0)
        values = tl.load(row_ptr[:, None] + HEAD_DIM + dims[None, :], mask=valid[:, None], other=0.0)
        if USE_CACHE:
            bid = tl.load(claim_ptr + where, mask=valid & ~marked, other=0)
            won = valid & ~marked & (bid == ((tl.full(where.shape, epoch, tl.int64) << 32) | slot))
            target = cached_row + head_offset
            tl.store(target[None, :] + dims[:, None], keys, mask=won[None, :])
            tl.store(target[:, None] + HEAD_DIM + dims[None, :], values, mask=won[:, None])
            tl.store(tags_ptr + where, slot, mask=won & (kv_head == 0))
        if DOT_FP32:
            scores = tl.dot(query.to(tl.float32), keys.to(tl.float32)) * scale
        else:
            scores = tl.dot(query, keys) * scale
        scores = tl.where(valid[None, :], scores, -1.0e30)
        next_max = tl.maximum(running_max, tl.max(scores, axis=1))
        alpha = tl.math.exp2(running_max - next_max)
        probabilities = tl.where(valid[None, :], tl.math.exp2(scores - next_max[:, None]), 0.0)
        weights = probabilities.to(values.dtype)
        if DOT_FP32:
            accumulator = tl.dot(weights.to(tl.float32), values.to(tl.float32), acc=accumulator * alpha[:, None])
        else:
            accumulator = tl.dot(weights, values, acc=accumulator * alpha[:, None])
        normalizer = normalizer * alpha + tl.sum(probabilities, axis=1)
        running_max = next_max
    has_values = normalizer > 0
    out = tl.where(has_values[:, None], accumulator / tl.maximum(normalizer, 1.0e-30)[:, None], 0.0)
    lse = tl.where(has_values, running_max + tl.math.log2(tl.maximum(normalizer, 1.0e-30)), -float("inf"))
    part = ((split_offset + split) * num_rows + row).to(tl.int64)
    mask = heads < GROUP
    tl.store(partial_out_ptr + (part * NUM_Q_HEADS + first_head + heads[:, None]) * HEAD_DIM + dims[None, :], out,
             mask=mask[:, None])
    tl.store(partial_lse_ptr + part * NUM_Q_HEADS + first_head + heads, lse, mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _merge_kernel(partial_out_ptr, partial_lse_ptr, gate_ptr, out_ptr, num_rows, stride_gate_row,
                  stride_out_row, HEAD_DIM: tl.constexpr, NUM_Q_HEADS: tl.constexpr, PARTS: tl.constexpr,
                  BLOCK_PARTS: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    parts = tl.arange(0, BLOCK_PARTS)
    dims = tl.arange(0, HEAD_DIM)
    live = parts < PARTS
    index = parts.to(tl.int64) * num_rows + row
    lse = tl.load(partial_lse_ptr + index * NUM_Q_HEADS + head, mask=live, other=-float("inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top > -float("inf"), top, 0.0)  # no part saw a row: every weight is exp2(-inf) = 0
    weights = tl.where(live, tl.math.exp2(lse - top), 0.0)
    total = tl.sum(weights, axis=0)
    partial = tl.load(partial_out_ptr + (index[:, None] * NUM_Q_HEADS + head) * HEAD_DIM + dims[None, :],
                      mask=live[:, None], other=0.0)
    merged = tl.where(total > 0, tl.sum(partial * weights[:, None], axis=0) / total, 0.0)
    # Round to bf16 before the gate, as vLLM's unfused path does.
    merged = merged.to(out_ptr.dtype.element_ty).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_gate_row + head * HEAD_DIM + dims).to(tl.float32)
    tl.store(out_ptr + row * stride_out_row + head * HEAD_DIM + dims, merged * tl.sigmoid(gate))


@triton.jit(do_not_specialize=["num_rows"])
def _fold_kernel(state_out_ptr, state_lse_ptr, part_out_ptr, part_lse_ptr, num_rows, HEAD_DIM: tl.constexpr,
                 NUM_Q_HEADS: tl.constexpr):
    """``state (+)= part`` for one query row and head: two log-sum-exp weighted means, as
    :func:`_merge_kernel` weighs its parts (lse in log2 units)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    at = row.to(tl.int64) * NUM_Q_HEADS + head
    lse_state = tl.load(state_lse_ptr + at)
    lse_part = tl.load(part_lse_ptr + at)
    top = tl.maximum(lse_state, lse_part)
    top = tl.where(top > -float("inf"), top, 0.0)  # neither saw a row: both weights exp2(-inf) = 0
    w_state = tl.math.exp2(lse_state - top)
    w_part = tl.math.exp2(lse_part - top)
    total = w_state + w_part
    state = tl.load(state_out_ptr + at * HEAD_DIM + dims)
    part = tl.load(part_out_ptr + at * HEAD_DIM + dims)
    merged = tl.where(total > 0, (state * w_state + part * w_part) / tl.maximum(total, 1.0e-30), 0.0)
    tl.store(state_out_ptr + at * HEAD_DIM + dims, merged)
    tl.store(state_lse_ptr + at, tl.where(total > 0, top + tl.math.log2(tl.maximum(total, 1.0e-30)),
                                          -float("inf")))


def _config(q: torch.Tensor) -> AttentionConfig:
    return configs.config_for("qsa_attention", device=q.device)


def block_m(group: int) -> int:
    return max(16, triton.next_power_of_2(group))  # tl.dot needs 16 rows


def _check(q, host_kv, indices, block_table, token_to_req):
    if q.ndim != 3 or host_kv.ndim != 4 or host_kv.shape[3] != 2 * q.shape[2]:
        raise ValueError("expected q [rows, heads, D] and host K/V [blocks, block_size, kv_heads, 2*D]")
    if q.shape[1] % host_kv.shape[2]:
        raise ValueError("query heads must be a multiple of the KV heads")
    if indices.ndim != 2 or indices.shape[0] != q.shape[0] or indices.shape[1] < 2:
        raise ValueError("indices must be [rows, selection + 1] with the count in the last column")
    if token_to_req.shape != (q.shape[0],) or block_table.ndim != 2:
        raise ValueError("token_to_req must have one entry per row and block_table two dimensions")
    if host_kv.stride(3) != 1 or host_kv.stride(2) != host_kv.shape[3]:
        raise ValueError("a host K/V row must be contiguous")
    if not (indices.dtype == block_table.dtype == token_to_req.dtype == torch.int32):
        raise ValueError("indices, block_table and token_to_req must be int32")


def _attention_launch(q, host_kv, arena, indices, block_table, token_to_req, cache, partial_out, partial_lse,
                      split_offset: int, config: AttentionConfig, num_blocks: int | None = None) -> None:
    rows, num_q_heads, head_dim = q.shape
    kv_heads = host_kv.shape[2]
    group = num_q_heads // kv_heads
    if cache is None:
        tags = hitmark = claim = epoch = indices  # unused: USE_CACHE compiles their accesses out
        sets, cached = 1, False
    else:
        tags, hitmark, claim, epoch, sets, cached = cache
    _attention_kernel[(rows, kv_heads, config.splits)](
        q, host_kv, arena, indices, block_table, token_to_req, tags, hitmark, claim, partial_out, partial_lse,
        epoch, sets, head_dim ** -0.5, q.stride(0), q.stride(1), host_kv.stride(0), host_kv.stride(1),
        indices.stride(0), block_table.stride(0), rows, block_table.shape[0],
        host_kv.shape[0] if num_blocks is None else num_blocks, block_table.shape[1], split_offset,
        TOPK=indices.shape[1] - 1, PAGE_SIZE=host_kv.shape[1], GROUP=group,
        HEAD_DIM=head_dim, NUM_Q_HEADS=num_q_heads, KV_HEADS=kv_heads, NUM_SPLITS=config.splits,
        BLOCK_M=block_m(group), BLOCK=config.block, USE_CACHE=cached, DOT_FP32=INTERPRETED, num_warps=config.warps,
        num_stages=config.stages)


def _merge(partial_out, partial_lse, gate, out) -> torch.Tensor:
    parts, rows, num_q_heads, head_dim = partial_out.shape
    gate = gate.reshape(rows, num_q_heads * head_dim)
    flat = out.view(rows, num_q_heads * head_dim)
    _merge_kernel[(rows, num_q_heads)](partial_out, partial_lse, gate, flat, rows, gate.stride(0), flat.stride(0),
                                       HEAD_DIM=head_dim, NUM_Q_HEADS=num_q_heads, PARTS=parts,
                                       BLOCK_PARTS=triton.next_power_of_2(parts), num_warps=2, num_stages=1)
    return out


FP32_BYTES = 4


def partials_bytes(parts: int, rows: int, q_heads: int, head_dim: int) -> int:
    """The fp32 partial outputs and log-sum-exps of ``parts`` splits of ``rows`` query rows: what
    :func:`host_attention` and :func:`row_cache_attention` allocate a call (in a CUDA graph's pool
    when captured), and ``flashnext plan``'s ledger counts."""
    return parts * rows * q_heads * (head_dim + 1) * FP32_BYTES


def _partials(parts: int, q: torch.Tensor):
    rows, heads, dim = q.shape
    return (torch.empty((parts, rows, heads, dim), dtype=torch.float32, device=q.device),
            torch.empty((parts, rows, heads), dtype=torch.float32, device=q.device))


def host_attention(q, host_kv, indices, block_table, token_to_req, gate, out=None,
                   config: AttentionConfig | None = None) -> torch.Tensor:
    """Sparse attention reading every selected row from ``host_kv`` (pinned host memory through a
    UVA view, or any tensor on the query's device): the path without the row cache."""
    _check(q, host_kv, indices, block_table, token_to_req)
    config = config or _config(q)
    out = torch.empty_like(q) if out is None else out
    if q.shape[0]:
        partial_out, partial_lse = _partials(config.splits, q)
        _attention_launch(q, host_kv, host_kv, indices, block_table, token_to_req, None, partial_out, partial_lse,
                          0, config)
        _merge(partial_out, partial_lse, gate, out)
    return out


def invalidate_slots(tags: torch.Tensor, slots: torch.Tensor) -> None:
    """Drop the cached rows of ``slots`` (the slots a store just wrote) from one layer's tags."""
    if slots.numel():
        slots = slots.reshape(-1)
        block = 256
        _invalidate_kernel[(triton.cdiv(slots.numel(), block),)](tags, slots, slots.numel(), tags.numel(),
                                                                   BLOCK=block, num_warps=4)


def plan_row_cache(indices, block_table, token_to_req, tags, hitmark, claim, epoch: torch.Tensor, num_blocks: int,
                   page_size: int) -> None:
    rows = indices.shape[0]
    topk = indices.shape[1] - 1
    _plan_kernel[(rows, triton.cdiv(topk, PLAN_BLOCK))](
        indices, indices.stride(0), block_table, block_table.stride(0), token_to_req, tags, hitmark, claim, epoch,
        tags.numel(), block_table.shape[0], num_blocks, block_table.shape[1], TOPK=topk, PAGE_SIZE=page_size,
        BLOCK=PLAN_BLOCK, num_warps=1)


def row_cache_attention(q, host_kv, arena_rows, indices, block_table, token_to_req, gate, tags, hitmark, claim,
                        epoch: torch.Tensor, out=None, config: AttentionConfig | None = None) -> torch.Tensor:
    """Plan and attention for one decode step of one layer; ``arena_rows`` is the layer's share of
    the arena, ``[sets, kv_heads, 2 * head_dim]``, and ``tags``/``hitmark``/``claim`` its state."""
    _check(q, host_kv, indices, block_table, token_to_req)
    if arena_rows.shape[0] != tags.numel() or arena_rows.shape[1:] != host_kv.shape[2:]:
        raise ValueError("the arena rows must be [sets, kv_heads, 2 * head_dim], one per tag")
    config = config or _config(q)
    out = torch.empty_like(q) if out is None else out
    if q.shape[0]:
        plan_row_cache(indices, block_table, token_to_req, tags, hitmark, claim, epoch, host_kv.shape[0],
                       host_kv.shape[1])
        partial_out, partial_lse = _partials(config.splits, q)
        _attention_launch(q, host_kv, arena_rows, indices, block_table, token_to_req,
                          (tags, hitmark, claim, epoch, tags.numel(), True), partial_out, partial_lse, 0, config)
        _merge(partial_out, partial_lse, gate, out)
    return out


# The staged prefill runs one program per query row and KV head over a window: a prefill chunk's
# rows already fill the GPU, and one split keeps a window's partials at one fp32 row per query row.
STAGED_SPLITS = 1
# Query rows a launch takes at least, where the scratch cannot hold partials for all of them.
STAGED_MIN_CHUNK_ROWS = 64
SCRATCH_ALIGN = 256  # bytes: each scratch tensor starts on a boundary any dtype's view accepts


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SCRATCH_ALIGN) * SCRATCH_ALIGN


@dataclass(frozen=True)
class StagedScratch:
    """Where a staged prefill of ``rows`` query rows keeps its scratch, and what that leaves for
    staging: the fp32 running state of every row (output and log-sum-exp), the int32 block tables
    of one window (the remap of every KV block, and the requests' tables through it), and the
    partials of one chunk of ``chunk_rows`` rows, in that order."""

    rows: int
    chunk_rows: int
    window_blocks: int  # arena blocks a window stages
    in_arena: bool  # in the arena's last ``arena_blocks - window_blocks`` blocks; else allocated per call
    state_bytes: int
    table_bytes: int
    partial_bytes: int
    nbytes: int  # the scratch's span: whole arena blocks in the arena, else what a call allocates

    @property
    def chunks(self) -> int:
        return -(-self.rows // self.chunk_rows)


def staged_scratch(rows: int, q_heads: int, head_dim: int, arena_blocks: int, block_bytes: int, num_blocks: int,
                   table_entries: int) -> StagedScratch:
    """The scratch of a staged prefill of ``rows`` query rows of ``q_heads`` x ``head_dim`` over an
    arena of ``arena_blocks`` blocks of ``block_bytes``, for a KV cache of ``num_blocks`` blocks and
    block tables of ``table_entries`` entries (requests x width). In the fewest of the arena's last
    blocks that hold the state, the tables and a chunk of at least :data:`STAGED_MIN_CHUNK_ROWS`
    rows (all the rows where fewer), as long as one block is left to stage a window; else (an arena
    of one block, or rows beyond what it holds) allocated by the call, all rows in one chunk.
    ``flashnext plan``'s ledger asks this of the served shape; :func:`staged_attention` of each call."""
    per_row = partials_bytes(STAGED_SPLITS, 1, q_heads, head_dim)
    state = _aligned(rows * per_row)
    tables = _aligned((num_blocks + 1) * 4) + 2 * _aligned(table_entries * 4)
    reserved = -(-(state + tables + min(rows, STAGED_MIN_CHUNK_ROWS) * per_row) // block_bytes)
    if reserved < arena_blocks:
        chunk = min(rows, (reserved * block_bytes - state - tables) // per_row)
        return StagedScratch(rows, chunk, arena_blocks - reserved, True, state, tables, chunk * per_row,
                             reserved * block_bytes)
    partial = rows * per_row
    return StagedScratch(rows, rows, arena_blocks, False, state, tables, partial, state + tables + partial)


def _scratch_views(memory: torch.Tensor, scratch: StagedScratch, q_heads: int, head_dim: int, num_blocks: int,
                   table_shape: tuple[int, ...]):
    """The scratch's tensors over ``memory`` (its bytes), in :class:`StagedScratch`'s order: the
    state's output and log-sum-exp, the remap, the two block-table buffers, one chunk's output and
    log-sum-exp."""
    offset = 0

    def take(dtype: torch.dtype, shape: tuple[int, ...], span: int | None = None) -> torch.Tensor:
        nonlocal offset
        count = 1
        for d in shape:
            count *= d
        nbytes = count * dtype.itemsize
        view = memory[offset:offset + nbytes].view(dtype).view(shape)
        offset += _aligned(nbytes) if span is None else span
        return view

    out_row = q_heads * head_dim * FP32_BYTES
    state_out = take(torch.float32, (scratch.rows, q_heads, head_dim), scratch.rows * out_row)
    state_lse = take(torch.float32, (scratch.rows, q_heads), scratch.state_bytes - scratch.rows * out_row)
    remap = take(torch.int32, (num_blocks + 1,))
    clamped = take(torch.int32, table_shape)
    window_table = take(torch.int32, table_shape)
    part_out = take(torch.float32, (scratch.chunk_rows, q_heads, head_dim), scratch.chunk_rows * out_row)
    part_lse = take(torch.float32, (scratch.chunk_rows, q_heads))
    return state_out, state_lse, remap, clamped, window_table, part_out, part_lse


def _staged_windows(block_table, seq_lens, block_size: int, capacity: int) -> list[list[int]]:
    """The blocks of the batch's contexts in windows of ``capacity``, worked out on the host (one
    wait for the device, as the step's ``.tolist()`` always had): host memory, not the device's."""
    table, lens = block_table.cpu(), seq_lens.cpu()
    used = torch.arange(table.shape[1])[None, :] * block_size < lens[:, None]
    blocks = torch.unique(table[used & (table >= 0)]).tolist()
    return [blocks[i:i + capacity] for i in range(0, len(blocks), capacity)] or [[]]


def _window_remap(window: list[int], num_blocks: int) -> torch.Tensor:
    """On the host: for each KV block ``b``, at ``b + 1``, its arena block in ``window``, else -1."""
    remap = torch.full((num_blocks + 1,), -1, dtype=torch.int32)
    remap[torch.tensor(window, dtype=torch.long) + 1] = torch.arange(len(window), dtype=torch.int32)
    return remap


def staged_attention(q, host_kv, arena, indices, block_table, token_to_req, seq_lens, gate, out=None,
                     config: AttentionConfig | None = None) -> torch.Tensor:
    """Prefill attention: the batch's context blocks are copied from ``host_kv`` into ``arena``
    (``[arena_blocks, block_size, kv_heads, 2 * head_dim]`` in VRAM) a window at a time, and each
    window's selected rows are read from VRAM. ``seq_lens`` bounds each request's blocks. The
    scratch is :func:`staged_scratch`'s: in the arena's last blocks, so that nothing is allocated
    on the device (with ``out`` given) where the arena holds it."""
    _check(q, host_kv, indices, block_table, token_to_req)
    if arena.ndim != 4 or arena.shape[1:] != host_kv.shape[1:]:
        raise ValueError("the arena must hold whole blocks: [arena_blocks, block_size, kv_heads, 2 * head_dim]")
    config = config or _config(q)
    out = torch.empty_like(q) if out is None else out
    rows, q_heads, head_dim = q.shape
    if not rows:
        return out
    num_blocks, block_size = host_kv.shape[0], host_kv.shape[1]
    block_bytes = arena[0].numel() * arena.element_size()
    scratch = staged_scratch(rows, q_heads, head_dim, arena.shape[0], block_bytes, num_blocks, block_table.numel())
    if scratch.in_arena:
        memory = arena.view(-1).view(torch.uint8)[arena.numel() * arena.element_size() - scratch.nbytes:]
    else:
        memory = torch.empty(scratch.nbytes, dtype=torch.uint8, device=q.device)
    state_out, state_lse, remap, clamped, window_table, part_out, part_lse = _scratch_views(
        memory, scratch, q_heads, head_dim, num_blocks, tuple(block_table.shape))
    capacity = scratch.window_blocks
    windows = _staged_windows(block_table, seq_lens, block_size, capacity)
    # The requests' tables through a remap indexed by block + 1: padding (-1) reads entry 0, which is -1.
    torch.clamp(block_table, min=-1, out=clamped)
    clamped.add_(1)
    window_config = dataclasses.replace(config, splits=STAGED_SPLITS)
    for w, window in enumerate(windows):
        for i, block in enumerate(window):
            arena[i].copy_(host_kv[block], non_blocking=True)
        remap.copy_(_window_remap(window, num_blocks))
        torch.index_select(remap, 0, clamped.view(-1), out=window_table.view(-1))
        for start in range(0, rows, scratch.chunk_rows):
            stop = min(rows, start + scratch.chunk_rows)
            # the first window writes the running state itself; each later one is folded into it
            target_out, target_lse = ((state_out[start:stop], state_lse[start:stop]) if w == 0
                                      else (part_out[:stop - start], part_lse[:stop - start]))
            _attention_launch(q[start:stop], arena, arena, indices[start:stop], window_table,
                              token_to_req[start:stop], None, target_out, target_lse, 0, window_config,
                              num_blocks=capacity)
            if w:
                _fold_kernel[(stop - start, q_heads)](state_out[start:stop], state_lse[start:stop], target_out,
                                                      target_lse, stop - start, HEAD_DIM=head_dim,
                                                      NUM_Q_HEADS=q_heads, num_warps=2, num_stages=1)
    flat_gate = gate.reshape(rows, q_heads * head_dim)
    flat = out.view(rows, q_heads * head_dim)
    # one part (the state): a fixed variant, whatever the window count
    _merge_kernel[(rows, q_heads)](state_out, state_lse, flat_gate, flat, rows, flat_gate.stride(0), flat.stride(0),
                                   HEAD_DIM=head_dim, NUM_Q_HEADS=q_heads, PARTS=1, BLOCK_PARTS=2, num_warps=2,
                                   num_stages=1)
    return out


def row_cache_tensors(num_layers: int, arena_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                      dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What :class:`RowCache` allocates, name -> (shape, dtype): the arena's rows and, per layer, a
    tag, a hitmark and a bid per set and one epoch. ``flashnext plan`` sizes the arena from this."""
    sets = arena_blocks * block_size // num_layers
    return {"arena": ((arena_blocks, block_size, kv_heads, 2 * head_dim), dtype),
            "tags": ((num_layers, sets), torch.int64), "hitmark": ((num_layers, sets), torch.int32),
            "claim": ((num_layers, sets), torch.int64), "epoch": ((num_layers, 1), torch.int32)}


def warm_tensors(q_heads: int, head_dim: int, topk: int, num_blocks: int) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """What :meth:`RowCache.warm` allocates, name -> (shape, dtype; None: the K/V's): one query row,
    its gate and output, a selection of nothing (its count column 0) and a block table of every
    host block. ``flashnext plan``'s ledger counts it, with :func:`host_attention`'s partials."""
    return {"q": ((1, q_heads, head_dim), None), "gate": ((1, q_heads * head_dim), None),
            "out": ((1, q_heads, head_dim), None), "indices": ((1, topk + 1), torch.int32),
            "table": ((1, num_blocks), torch.int32), "token_to_req": ((1,), torch.int32),
            "seq_lens": ((1,), torch.int32)}


def tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for d in shape:
        count *= d
    return count * dtype.itemsize


class RowCache:
    """The VRAM arena of one rank and the row-cache state of its QSA layers.

    ``arena`` is ``arena_blocks`` blocks of rows, allocated once at start; prefill stages blocks in
    it, decode splits its rows evenly among the layers as direct-mapped caches. ``arena_blocks``
    may exceed ``num_layers``: every rank holds the busiest rank's arena (seed 000 §7), and a rank
    with fewer QSA layers gives each a larger share.
    """

    def __init__(self, num_layers: int, arena_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, epoch_limit: int = EPOCH_LIMIT):
        if num_layers <= 0 or arena_blocks <= 0:
            raise ValueError("a row cache needs at least one layer and one arena block")
        self.num_layers = num_layers
        tensors = row_cache_tensors(num_layers, arena_blocks, block_size, kv_heads, head_dim, dtype)
        shape, arena_dtype = tensors["arena"]
        self.arena = torch.zeros(shape, dtype=arena_dtype, device=device)
        self.sets = tensors["tags"][0][1]
        rows = self.arena.view(-1, kv_heads, 2 * head_dim)
        self.layer_rows = [rows[i * self.sets:(i + 1) * self.sets] for i in range(num_layers)]
        self.tags = torch.full(tensors["tags"][0], EMPTY_TAG, dtype=tensors["tags"][1], device=device)
        self.hitmark = torch.zeros(tensors["hitmark"][0], dtype=tensors["hitmark"][1], device=device)
        self.claim = torch.zeros(tensors["claim"][0], dtype=tensors["claim"][1], device=device)
        self.epoch_limit = epoch_limit
        # On the device, so that a step can be replayed in a CUDA graph; counted on the host too,
        # for the wrap.
        self.epoch = torch.zeros(tensors["epoch"][0], dtype=tensors["epoch"][1], device=device)
        self.epochs = [0] * num_layers

    @property
    def nbytes(self) -> int:
        return self.arena.numel() * self.arena.element_size()

    @property
    def state_nbytes(self) -> int:
        """The row-cache bookkeeping beside the arena: tags, hitmarks, bids and epochs."""
        return sum(t.numel() * t.element_size() for t in (self.tags, self.hitmark, self.claim, self.epoch))

    def next_epoch(self, layer: int) -> torch.Tensor:
        epoch = self.epochs[layer] + 1
        if epoch >= self.epoch_limit:  # old hitmarks and bids would collide with new epochs
            self.hitmark[layer].zero_()
            self.claim[layer].zero_()
            self.epoch[layer].zero_()
            epoch = 1
        self.epochs[layer] = epoch
        self.epoch[layer] += 1
        return self.epoch[layer]

    def invalidate(self, layer: int, slots: torch.Tensor) -> None:
        invalidate_slots(self.tags[layer], slots)

    def invalidate_all(self) -> None:
        self.tags.fill_(EMPTY_TAG)

    def attend(self, layer: int, q, host_kv, indices, block_table, token_to_req, gate, out=None,
               config: AttentionConfig | None = None) -> torch.Tensor:
        return row_cache_attention(q, host_kv, self.layer_rows[layer], indices, block_table, token_to_req, gate,
                                   self.tags[layer], self.hitmark[layer], self.claim[layer], self.next_epoch(layer),
                                   out, config)

    def warm(self, host_kv: torch.Tensor, q_heads: int, topk: int) -> None:
        """Launch once every kernel variant a prefill or an eager decode step launches, so that none is
        compiled and loaded while serving (seed 000 §5: one such took memory the fullest 3090 did not
        have). One query row that selects nothing, over a context one block longer than a window of
        the arena: the staged path's attention, fold and merge, and the uncached path's attention and
        merge. The row cache's are the CUDA-graph capture's. ``host_kv`` is a layer's bound rows."""
        head_dim, num_blocks = host_kv.shape[3] // 2, host_kv.shape[0]
        t = {name: torch.zeros(shape, dtype=dtype or host_kv.dtype, device=self.arena.device)
             for name, (shape, dtype) in warm_tensors(q_heads, head_dim, topk, num_blocks).items()}
        t["table"].copy_(torch.arange(num_blocks, dtype=torch.int32)[None])
        window = staged_scratch(1, q_heads, head_dim, self.arena.shape[0],
                                self.arena[0].numel() * self.arena.element_size(), num_blocks, num_blocks).window_blocks
        t["seq_lens"].fill_(min(window + 1, num_blocks) * host_kv.shape[1])
        self.staged(t["q"], host_kv, t["indices"], t["table"], t["token_to_req"], t["seq_lens"], t["gate"], t["out"])
        host_attention(t["q"], host_kv, t["indices"], t["table"], t["token_to_req"], t["gate"], t["out"])

    def staged(self, q, host_kv, indices, block_table, token_to_req, seq_lens, gate, out=None,
               config: AttentionConfig | None = None) -> torch.Tensor:
        out = staged_attention(q, host_kv, self.arena, indices, block_table, token_to_req, seq_lens, gate, out,
                               config)
        self.invalidate_all()
        return out
