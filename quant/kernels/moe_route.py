"""decode-05's router: the router and the shared expert's gate in one GEMV, top-k and renormalized
weights by the last program, in one launch.

vLLM 0.33.0 routes a decode step's MoE block with a router GEMV, ``topk_softmax`` (one CTA), and the
shared expert's gate as its own small GEMV (seed 000 §3.3: 12 + 7 + 7 us on a 3090). Here:

* one GEMV over ``[E + 1, H]`` bf16 rows (the router's ``E`` rows, then the shared expert gate's
  row), for 1..16 tokens, written as bf16 logits (the router's output dtype on sm8x);
* the GEMV is split over K like :mod:`.decode_mma`'s; the last program of each row block sums its
  partials in split order, and the row block that finishes last (a second acq_rel counter) picks
  each token's top ``k`` experts and their weights. ``norm_topk_prob`` cancels the softmax
  denominator over all experts, so the weights are a softmax over the ``k`` selected logits. Each round takes one max
  over 32-bit keys ``order(bf16 logit) << 16 | (65535 - expert)``: the value and the expert at once,
  the smaller expert winning a tie, as vLLM's ``topk_softmax`` does; the logit is rebuilt from the
  key, so the rounds load nothing.

:func:`~.reference.reference_route` is vLLM's unfused arithmetic in torch (softmax over all
experts, top-k, renormalize), for the tests.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl

from flashnext.quant.kernels import _common, configs
from flashnext.quant.kernels._common import INTERPRETED, dot, splitk_counters

ROUTE_MAX_TOKENS = 16  # the tokens padded to one 16-row tl.dot operand
# The alignment compares every assignment with every other in one program: +1 us at 1-2 tokens,
# +5 at 4, +25 at 8 and +115 at 16 on the H200 (docs/benchmarks.md); beyond 4 tokens vLLM's own
# moe_align_block_size is the faster choice.
ALIGN_MAX_TOKENS = 4


@triton.jit
def _order_keys(logits, experts):
    """int32 keys that sort like the bf16 ``logits``, ties to the smaller expert: the logit's
    order-preserving 16 bits (less 2^15, so the key keeps its sign) above ``65535 - expert``."""
    bits = logits.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    ordered = tl.where(bits >= 0x8000, 0xFFFF - bits, bits | 0x8000)  # negatives reversed below positives
    return (ordered - 0x8000) * 65536 + (65535 - experts)


@triton.jit
def _key_logit(key):
    """The fp32 value of the bf16 logit a key was made from."""
    ordered = (key >> 16) + 0x8000
    bits = tl.where(ordered >= 0x8000, ordered & 0x7FFF, 0xFFFF - ordered)
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _align_blocks(expert, flat, valid, sentinel, sorted_ptr, blocks_ptr, total_ptr, E: tl.constexpr,
                  ALIGN: tl.constexpr, A: tl.constexpr):
    """Marlin's block alignment of the step's assignments, in vLLM's ``moe_align_block_size``
    layout: each expert's assignments (``flat = token * k + slot``, ascending) padded with
    ``sentinel`` (``M * k``) to a multiple of ``ALIGN``, experts ascending, and ``sentinel`` to the
    end of the buffer (:func:`alignment_sizes`); one expert per block, -1 past the used blocks; the
    padded total. Pairwise over the ``A`` (padded) assignments, in registers."""
    same = (expert[:, None] == expert[None, :]) & valid[:, None] & valid[None, :]
    rank = tl.sum((same & (flat[None, :] < flat[:, None])).to(tl.int32), axis=1)
    padded = (tl.sum(same.to(tl.int32), axis=1) + ALIGN - 1) // ALIGN * ALIGN
    first = valid & (rank == 0)  # one lane per expert in use
    below = first[None, :] & (expert[None, :] < expert[:, None])
    offset = tl.sum(tl.where(below, padded[None, :], 0), axis=1)
    lane = tl.arange(0, A)
    size = tl.minimum(sentinel * ALIGN, sentinel + E * (ALIGN - 1))  # alignment_sizes' (its cap binds below E)
    for start in range(0, size, A):  # every slot a padding slot first
        tl.store(sorted_ptr + start + lane, sentinel, mask=start + lane < size)
    tl.debug_barrier()  # the scatter below must land after the fill, across the program's threads
    tl.store(sorted_ptr + offset + rank, flat, mask=valid)
    starts = lane * ALIGN
    owner = first[None, :] & (offset[None, :] <= starts[:, None]) & (starts[:, None] < (offset + padded)[None, :])
    owned = tl.sum(owner.to(tl.int32), axis=1) > 0
    block_expert = tl.sum(tl.where(owner, expert[None, :], 0), axis=1)
    tl.store(blocks_ptr + lane, tl.where(owned, block_expert, -1), mask=lane < (size + ALIGN - 1) // ALIGN)
    tl.store(total_ptr, tl.sum(tl.where(first, padded, 0), axis=0))


@triton.jit(do_not_specialize=["M"])
def _route_kernel(x_ptr, w_ptr, logits_ptr, partial_ptr, ids_ptr, weights_ptr, count_ptr, sorted_ptr, blocks_ptr,
                  total_ptr, M, H, stride_xm, stride_wn, E: tl.constexpr, ALIGN: tl.constexpr, TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr, E_PAD: tl.constexpr,
                  BLOCK_M: tl.constexpr, TOPK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < E + 1
    tokens = tl.arange(0, BLOCK_M)
    m_mask = tokens < M
    k_offsets = tl.arange(0, BLOCK_K)
    out_mask = m_mask[:, None] & n_mask[None, :]
    chunks = H // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for c in range(pid_k * chunks // SPLIT_K, (pid_k + 1) * chunks // SPLIT_K):
        k = c * BLOCK_K
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + k + k_offsets[None, :], mask=n_mask[:, None],
                    other=0.0)
        x = tl.load(x_ptr + tokens[:, None] * stride_xm + k + k_offsets[None, :], mask=m_mask[:, None], other=0.0)
        acc += dot(x, w, DOT_FP32)
    logits_out = logits_ptr + tokens[:, None] * (E + 1) + rows[None, :]
    block_done = True
    if SPLIT_K == 1:
        tl.store(logits_out, acc, mask=out_mask)
    else:  # the row block's last program sums the partials, in split order
        tl.store(partial_ptr + (pid_k * BLOCK_M + tokens[:, None]) * (E + 1) + rows[None, :], acc, mask=out_mask)
        block_done = tl.atomic_add(count_ptr + 1 + pid_n, 1, sem="acq_rel") == SPLIT_K - 1
        if block_done:
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(partial_ptr + (s * BLOCK_M + tokens[:, None]) * (E + 1) + rows[None, :],
                                 mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(logits_out, total, mask=out_mask)
            tl.store(count_ptr + 1 + pid_n, 0)
    if block_done:
        if tl.atomic_add(count_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:  # every row block stored
            tl.store(count_ptr, 0)
            picks = tl.arange(0, TOPK_M)
            p_mask = picks < M
            experts = tl.arange(0, E_PAD)
            e_mask = experts < E
            logits = tl.load(logits_ptr + picks[:, None] * (E + 1) + experts[None, :],
                             mask=p_mask[:, None] & e_mask[None, :], other=0.0, cache_modifier=".cg")
            keys = tl.where(e_mask[None, :], _order_keys(logits, experts[None, :]), -2147483648)
            best = tl.max(keys, axis=1)
            top = _key_logit(best)
            slots = tl.arange(0, TOPK_PAD)
            chosen = tl.zeros((TOPK_M, TOPK_PAD), tl.int32)
            weights = tl.zeros((TOPK_M, TOPK_PAD), tl.float32)
            for slot in tl.static_range(TOP_K):
                chosen = tl.where(slots[None, :] == slot, (65535 - (best & 0xFFFF))[:, None], chosen)
                weights = tl.where(slots[None, :] == slot, tl.exp(_key_logit(best) - top)[:, None], weights)
                keys = tl.where(keys == best[:, None], -2147483648, keys)
                best = tl.max(keys, axis=1)
            pick_mask = p_mask[:, None] & (slots < TOP_K)[None, :]
            tl.store(ids_ptr + picks[:, None] * TOP_K + slots[None, :], chosen, mask=pick_mask)
            tl.store(weights_ptr + picks[:, None] * TOP_K + slots[None, :],
                     weights / tl.sum(weights, axis=1)[:, None], mask=pick_mask)
            if ALIGN > 0:
                A: tl.constexpr = TOPK_M * TOPK_PAD
                _align_blocks(tl.reshape(chosen, [A]), tl.reshape(picks[:, None] * TOP_K + slots[None, :], [A]),
                              tl.reshape(pick_mask, [A]), M * TOP_K, sorted_ptr, blocks_ptr, total_ptr, E, ALIGN, A)


def alignment_sizes(assignments: int, experts: int, block: int) -> tuple[int, int]:
    """``(sorted_token_ids, expert_ids)`` lengths for ``assignments`` (``topk_ids.numel()``) over
    ``experts`` at ``block``, as vLLM 0.34.0's ``moe_align_block_size`` allocates them for
    ``fused_marlin_moe`` (``pad_sorted_ids`` off): ``numel + E * (block - 1)``, capped at
    ``numel * block`` where fewer assignments than experts cannot fill more blocks; the blocks
    rounded up. Marlin's op reads the first length (``sorted_token_ids.size(0)``) to size its fp32
    reduction buffer and its workspace check."""
    padded = assignments + experts * (block - 1)
    if assignments < experts:
        padded = min(assignments * block, padded)
    return padded, triton.cdiv(padded, block)


def partials_shape(split: int, experts: int) -> tuple[int, int, int]:
    """The fp32 split-K partials :func:`route` allocates for a step split ``split`` ways (none when
    1): every program of a row block writes its 16 token rows of ``experts + 1`` logits."""
    return split, 16, experts + 1


def route_scratch_bytes(experts: int, hidden: int) -> tuple[int, int]:
    """What :func:`route` allocates beyond its outputs (the logits, top-k and alignment, which stand
    where vLLM's router, ``topk_softmax`` and ``moe_align_block_size`` put theirs): ``(a step's
    split-K partials, at most one split a K step as the split follows the device's SMs; the split-K
    counters its first launch makes and keeps, _common.splitk_counters)``. ``flashnext plan``'s
    ledger counts them from here."""
    config = configs.config_for("moe_route", experts + 1, hidden, family=configs.DEFAULT)
    split = max(hidden // config.block_k, 1)
    partials = 4 * math.prod(partials_shape(split, experts)) if split > 1 else 0
    return partials, 4 * max(triton.cdiv(experts + 1, config.block_n) + 1, _common.SPLITK_COUNTERS)


def route(x: torch.Tensor, router_and_gate: torch.Tensor, top_k: int, align_block: int = 0,
          block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
          num_warps: int | None = None, config: configs.RouteConfig | None = None) -> tuple[torch.Tensor, ...]:
    """``(router_logits [M, E], shared_gate_logit [M, 1], topk_ids int32 [M, k], topk_weights fp32
    [M, k])`` for ``x [M, H]`` (1..16 tokens) and the merged rows ``[E + 1, H]`` (router, then the
    shared expert's gate). The launch is ``configs``' row (split-K: about two programs per SM)
    unless given, as ``config`` or keyword overrides.

    With ``align_block`` > 0 (Marlin's ``block_size_m``; 8 for a decode step) the same launch also
    returns Marlin's block alignment, sized and filled as vLLM's ``moe_align_block_size``
    (:func:`alignment_sizes`): ``sorted_token_ids int32``, ``expert_ids int32`` and
    ``num_tokens_post_padded int32 [1]``."""
    M, H = x.shape
    E = router_and_gate.shape[0] - 1
    config = config or configs.config_for("moe_route", E + 1, H, x.device)
    given = {name: value for name, value in (("block_n", block_n), ("block_k", block_k), ("split_k", split_k),
                                             ("num_warps", num_warps)) if value is not None}
    config = replace(config, **given) if given else config
    block_k = config.block_k
    if not 1 <= M <= ROUTE_MAX_TOKENS:
        raise ValueError(f"the fused router takes 1..{ROUTE_MAX_TOKENS} tokens, got {M}")
    if x.dtype != torch.bfloat16 or router_and_gate.dtype != torch.bfloat16:
        raise ValueError(f"the fused router takes bf16 (its top-k orders bf16 logits), got {x.dtype} and "
                         f"{router_and_gate.dtype}")
    if router_and_gate.shape[1] != H or H % block_k or not router_and_gate.is_contiguous():
        raise ValueError(f"router rows {list(router_and_gate.shape)} do not fit x {list(x.shape)} "
                         f"(K must be a multiple of {block_k})")
    if not 1 <= top_k <= min(E, 64):
        raise ValueError(f"top_k {top_k} does not fit {E} experts")
    if align_block and M > ALIGN_MAX_TOKENS:
        raise ValueError(f"the fused block alignment takes 1..{ALIGN_MAX_TOKENS} tokens, got {M}")
    if x.stride(1) != 1:
        x = x.contiguous()
    blocks = triton.cdiv(E + 1, config.block_n)
    split = config.splits(blocks, H // block_k, _common.sm_count(x.device))
    logits = torch.empty(M, E + 1, dtype=x.dtype, device=x.device)
    partial = torch.empty(partials_shape(split, E), dtype=torch.float32, device=x.device) if split > 1 else logits
    ids = torch.empty(M, top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(M, top_k, dtype=torch.float32, device=x.device)
    if align_block:
        sorted_len, blocks_len = alignment_sizes(M * top_k, E, align_block)
        sorted_ids = torch.empty(sorted_len, dtype=torch.int32, device=x.device)
        expert_ids = torch.empty(blocks_len, dtype=torch.int32, device=x.device)
        total = torch.empty(1, dtype=torch.int32, device=x.device)
    else:
        sorted_ids = expert_ids = total = ids
    counters = splitk_counters(x.device, blocks + 1, "moe_route")  # one for the grid, then one per row block
    _route_kernel[(blocks, split)](
        x, router_and_gate, logits, partial, ids, weights, counters, sorted_ids, expert_ids, total, M, H, x.stride(0),
        router_and_gate.stride(0), E=E, ALIGN=align_block, TOP_K=top_k, TOPK_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(E), BLOCK_M=16,
        TOPK_M=triton.next_power_of_2(M), BLOCK_N=config.block_n, BLOCK_K=block_k, SPLIT_K=split,
        DOT_FP32=INTERPRETED, num_warps=config.num_warps)
    routed = (logits[:, :E], logits[:, E:], ids, weights)
    return routed + (sorted_ids, expert_ids, total) if align_block else routed
