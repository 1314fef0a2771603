"""The decode kernels' computations in plain torch, rounding where vLLM's unfused paths round: what
the kernel tests and the benchmarks check the kernels against.

They live apart from the kernels so that production modules carry no test-only code, and in the
package (not under tests/) because the GPU benchmarks check their results with them too.
"""

from __future__ import annotations

import torch

from flashnext.quant.formats.packing import dequantize_groups, unpack_int32
from flashnext.quant.kernels.moe_route import alignment_sizes
from flashnext.quant.kernels.qsa_row_cache import EMPTY_TAG


# --- decode-07: QSA attention over host K/V rows and the row cache (:mod:`.qsa_row_cache`) ---------

def reference_slots(indices, block_table, token_to_req, num_blocks: int, page_size: int) -> torch.Tensor:
    """``[rows, selection]`` physical slots, ``-1`` where a column selects nothing valid."""
    topk = indices.shape[1] - 1
    tokens = indices[:, :topk].long()
    counts = indices[:, topk].long()
    requests = token_to_req.long()
    columns = torch.arange(topk, device=indices.device)
    pages = tokens.clamp_min(0) // page_size
    valid = (tokens >= 0) & (columns[None, :] < counts[:, None]) & (pages < block_table.shape[1])
    valid &= ((requests >= 0) & (requests < block_table.shape[0]))[:, None]
    safe_requests = requests.clamp(0, block_table.shape[0] - 1)
    blocks = block_table.long()[safe_requests[:, None], pages.clamp(max=block_table.shape[1] - 1)]
    valid &= (blocks >= 0) & (blocks < num_blocks)
    return torch.where(valid, blocks * page_size + tokens.clamp_min(0) % page_size, -1)


def reference_attention(q, host_kv, indices, block_table, token_to_req, gate) -> torch.Tensor:
    """fp32 sparse attention over the selected rows, rounded to bf16 before the sigmoid gate."""
    rows, num_q_heads, head_dim = q.shape
    kv_heads = host_kv.shape[2]
    slots = reference_slots(indices, block_table, token_to_req, host_kv.shape[0], host_kv.shape[1])
    flat = host_kv.reshape(-1, kv_heads, 2 * head_dim).float()
    out = torch.zeros((rows, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
    for r in range(rows):
        chosen = slots[r][slots[r] >= 0]
        if not chosen.numel():
            continue
        kv = flat[chosen]  # [n, kv_heads, 2D]
        for h in range(num_q_heads):
            k = kv[:, h * kv_heads // num_q_heads, :head_dim]
            v = kv[:, h * kv_heads // num_q_heads, head_dim:]
            weights = torch.softmax(q[r, h].float() @ k.T * head_dim ** -0.5, dim=0)
            out[r, h] = weights @ v
    return (out.to(q.dtype).float() * torch.sigmoid(gate.float().view_as(out))).to(q.dtype)


def reference_invalidate(tags: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """:func:`invalidate_slots` in torch: a stored slot's cached row is dropped."""
    slots = slots[slots >= 0].to(tags.device)
    where = slots % tags.numel()
    tags[where[tags[where] == slots]] = EMPTY_TAG  # two stored slots may share a set: only its own slot clears it
    return tags


def reference_row_cache_step(slots: torch.Tensor, tags: torch.Tensor, host_kv: torch.Tensor,
                             arena_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What one plan + attention step leaves in a layer's cache, and which columns hit.

    A column hits when its set's tag is its slot. A set that nothing hit is taken by the largest
    missing slot that maps to it (the winning bid of a single epoch). Updates ``tags`` and
    ``arena_rows`` in place.
    """
    sets = tags.numel()
    valid = slots >= 0
    where = torch.where(valid, slots % sets, 0)
    hits = valid & (tags[where] == slots)
    hit_sets = set(where[hits].tolist())
    winners: dict[int, int] = {}
    for s, slot in zip(where[valid & ~hits].tolist(), slots[valid & ~hits].tolist()):
        if s not in hit_sets:
            winners[s] = max(winners.get(s, -1), slot)
    flat = host_kv.reshape(-1, *host_kv.shape[2:])
    for s, slot in winners.items():
        tags[s] = slot
        arena_rows[s] = flat[slot]
    return tags, hits


# --- decode-05: the router and its block alignment (:mod:`.moe_route`) ------------------------

def reference_route(x: torch.Tensor, router_and_gate: torch.Tensor, top_k: int, to_bf16=None):
    """vLLM's unfused routing in torch: bf16 logits (``to_bf16``, default: to nearest even), softmax
    over all experts in fp32, the top ``k`` (ties to the smaller expert), renormalized."""
    to_bf16 = to_bf16 or (lambda t: t.to(torch.bfloat16))
    logits = to_bf16(x.float() @ router_and_gate.float().T)
    E = logits.shape[1] - 1
    probs = torch.softmax(logits[:, :E].float(), dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, order)
    return logits[:, :E], logits[:, E:], order.to(torch.int32), weights / weights.sum(-1, keepdim=True)


def reference_align(topk_ids: torch.Tensor, block: int,
                    experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``moe_align_block_size`` for ``topk_ids [M, k]`` over ``experts``, as its CUDA kernel
    fills the buffers its Python sizes (:func:`~.moe_route.alignment_sizes`): each used expert's flat
    assignment indices, ascending, padded with ``M * k`` to a multiple of ``block``, experts
    ascending, ``M * k`` to the end; one expert per block, -1 past the used blocks; the padded
    total. (The kernel for more than 64 experts orders an expert's indices by atomics: a block's
    indices are then a set.)"""
    flat = topk_ids.reshape(-1).long()
    sentinel = flat.numel()
    sorted_len, blocks_len = alignment_sizes(sentinel, experts, block)
    sorted_ids = torch.full((sorted_len,), sentinel, dtype=torch.int32)
    expert_ids = torch.full((blocks_len,), -1, dtype=torch.int32)
    position = 0
    for expert in sorted(set(flat.tolist())):
        members = torch.nonzero(flat == expert).reshape(-1)
        sorted_ids[position:position + members.numel()] = members.to(torch.int32)
        blocks = -(-members.numel() // block)
        expert_ids[position // block:position // block + blocks] = expert
        position += blocks * block
    return sorted_ids, expert_ids, torch.tensor([position], dtype=torch.int32)


# --- decode-04: the hyper-connection mix (:mod:`.hc_mix`) -----------------------------------------

def _weights(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return dequantize_groups(unpack_int32(packed, 8, packed.shape[1] * 4), scales)


def _exact_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def round_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """fp32 to bf16 as Triton 3.8's CPU interpreter converts (it truncates; GPUs round to nearest
    even), for references that must match interpreted kernels bit for bit."""
    return (x.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def reference_mix(xn: torch.Tensor, down: tuple[torch.Tensor, torch.Tensor], up: tuple[torch.Tensor, torch.Tensor],
                  lowrank: int, hc_count: int, to_bf16=None, sigmoid=None, fused_multiply_add: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(block_input, injection, lowrank_activations)`` by the unfused steps, in fp32 with a bf16
    rounding (``to_bf16``, default: to nearest even) after each step.

    Two things differ on a GPU, where Triton compiles vLLM's ``hc_silu`` / ``hc_gate_mix`` and these
    kernels alike: ``tl.sigmoid`` is an approximation (pass it as ``sigmoid``; the default is
    ``1 / (1 + exp(-x))`` in fp32), and ``acc += sigmoid(g) * x`` becomes one fused multiply-add
    (``fused_multiply_add=True``; the interpreter rounds the product first)."""
    to_bf16 = to_bf16 or (lambda t: t.to(torch.bfloat16))
    _sigmoid = sigmoid or _exact_sigmoid
    y = to_bf16(xn.float() @ _weights(*down).T)
    low = y[:, :lowrank].float() / hc_count
    low = to_bf16(low * _sigmoid(low))
    injection = y[:, lowrank:lowrank + hc_count] if y.shape[1] > lowrank else None
    gate = to_bf16(low.float() @ _weights(*up).T).float()
    H = gate.shape[1] // hc_count
    mixed = torch.zeros(xn.shape[0], H, dtype=torch.float32, device=xn.device)
    for s in range(hc_count):
        product = _sigmoid(gate[:, s * H:(s + 1) * H]).double() * xn[:, s * H:(s + 1) * H].double()  # exact
        mixed = (mixed.double() + product).float() if fused_multiply_add else mixed + product.float()
    return to_bf16(mixed / hc_count), injection, low
