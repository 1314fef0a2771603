"""Patch decode-05: a decode step's MoE block routed by one kernel.

vLLM 0.34.0 routes each MoE block of a decode step with the router GEMV, ``topk_softmax``, the
shared expert's gate and, inside Marlin, ``moe_align_block_size`` (seed 000 §3.3, one token on a
3090: 12, 7, 7 and 7 us). For a step of 1..4 tokens (:data:`MAX_FUSED_TOKENS`, the CUDA-graph
sizes), :func:`forward` instead:

1. runs :func:`flashnext.quant.kernels.moe_route.route` over the router's rows and the shared
   gate's row, one matrix since load (:func:`merge_router_rows`; one GEMV, top-k and renormalized
   weights by its last program, and Marlin's block alignment from the same launch);
2. hands the experts and weights to vLLM's own routed experts (``RoutedExperts.forward_modular``:
   Marlin on GPUs); ``fused_marlin_moe`` takes the step's alignment from :func:`alignment_for`
   instead of aligning again;
3. runs the shared expert and adds it, gated by the logit from step 1: through the bit-plane
   kernels when the shared expert is an INT6 bit-plane overlay (patch int6-bitplane), else through
   its own layers.

Where any of vLLM's MoE features that this path does not reproduce is in use (tensor, expert,
data or sequence parallelism, EPLB, expert substitution, routing capture, a router other than
plain softmax top-k, input/output transforms, a monolithic kernel), it returns None and vLLM's
path runs. ``VLLM_MOE_FUSED_DECODE=0`` turns it off.
"""

from __future__ import annotations

import torch

from flashnext import envs
from flashnext.quant.kernels._common import can_launch
from flashnext.quant.kernels.moe_route import ALIGN_MAX_TOKENS, route

# The largest step this path takes: the profiles' largest CUDA-graph size. The router kernel's
# variant depends on the step's size (its top-k's token rows, the alignment), and a step of 5..16
# tokens runs eagerly: through this path it would compile and load a new variant mid-service,
# outside vLLM's memory budget (seed 000 §5). vLLM's path takes those steps (docs/serving.md).
MAX_FUSED_TOKENS = 4

# Marlin's block_size_m choices, smallest first (vllm/.../experts/marlin_moe.py, fused_marlin_moe).
MARLIN_BLOCK_SIZES = (8, 16, 32, 48, 64)

# The alignment of the step being routed: (topk_ids, block size, experts, (sorted ids, expert ids, total)).
_pending_alignment: tuple | None = None


def enabled() -> bool:
    return envs.VLLM_MOE_FUSED_DECODE.enabled()


def marlin_block_size(tokens: int, top_k: int, experts: int) -> int:
    """The ``block_size_m`` that vLLM 0.34.0's ``fused_marlin_moe`` picks for a step without expert
    parallelism. (0.33.0 raised it to 16 for quantized activations, ``VLLM_MARLIN_INPUT_DTYPE``, and
    :func:`alignment_for` then declined the alignment; 0.34.0 no longer quantizes Marlin MoE inputs.)"""
    for size in MARLIN_BLOCK_SIZES:
        if tokens * top_k / experts / size < 0.9:
            return size
    return MARLIN_BLOCK_SIZES[-1]


def alignment_for(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                  expert_map: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The block alignment :func:`forward` computed for exactly these ``topk_ids`` at this block
    size, or None (vLLM then aligns as usual). Used once."""
    global _pending_alignment
    pending, _pending_alignment = _pending_alignment, None
    if pending is None or expert_map is not None:
        return None
    ids, size, experts, aligned = pending
    same = (ids.data_ptr() == topk_ids.data_ptr() and ids.shape == topk_ids.shape and ids.dtype == topk_ids.dtype)
    return aligned if same and size == block_size and experts == num_experts else None


def _plain_router(router) -> bool:
    """Whether ``router`` is a softmax over all experts, top-k and renormalization, and nothing else:
    what :func:`route` computes. Decided by exact class, from what each of vLLM 0.34.0's router
    classes holds (``router_factory.create_fused_moe_router``): on CUDA this MoE gets
    ``FusedTopKRouter``, which has no grouping, bias, scaling or custom function to check; on the
    CPU ``CPURouter``, which covers every scheme in one class. Every other class (grouped, biased or
    hash-routed, custom, AITER's shared-expert router, the routing simulator, zero experts, or a
    subclass of either) routes otherwise and is declined.

    Rows that vLLM's CUDA ``topk_softmax`` is told are CUDA-graph padding (``VLLM_MOE_SKIP_PADDING``)
    are routed here like any other row; their outputs are discarded, and the real rows' experts
    and weights are the same."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter

    kind = type(router)
    if kind is not FusedTopKRouter and kind is not CPURouter:
        return False
    # FusedMoERouter's and BaseRouter's own state: EPLB, routing capture and replay, DeepSeek's image bias
    if (router.eplb_state is not None or router.capture_fn is not None or router._routing_replay_out is not None
            or router.bias_vl is not None):
        return False
    if router.scoring_func != "softmax" or not router.renormalize:
        return False
    if kind is CPURouter:
        return (not router.use_grouped_topk and router.e_score_correction_bias is None
                and router.custom_routing_function is None and router._hash_indices_table is None
                and router.routed_scaling_factor == 1.0)
    return True


def _applies(block: torch.nn.Module, x: torch.Tensor) -> bool:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    runner = block.experts
    parallel = runner.moe_config.moe_parallel_config
    return (can_launch(x, MAX_FUSED_TOKENS) and x.dtype == torch.bfloat16
            and block.shared_expert is not None and not block.replicate_shared_expert
            and not block.is_fused_shared_expert_enabled and not block.is_sequence_parallel
            and parallel.tp_size == 1 and parallel.ep_size == 1 and parallel.dp_size == 1 and parallel.pcp_size == 1
            and runner.routed_input_transform is None and runner.routed_output_transform is None
            and runner.routed_scaling_factor == 1.0 and runner.moe_config.hidden_dim == x.shape[1]
            and type(runner.routed_experts) is RoutedExperts  # not expert substitution's subclass
            and not runner.routed_experts.quant_method.is_monolithic and _plain_router(runner.router)
            and block.shared_expert.expert_gate is block.shared_expert_gate)


def router_rows_shape(num_experts: int, hidden_size: int) -> tuple[int, int]:
    """The matrix :func:`merge_router_rows` allocates once per MoE block at load: the router's
    ``num_experts`` rows and the shared gate's one (``flashnext plan``'s ledger counts it from here)."""
    return num_experts + 1, hidden_size


def merge_router_rows(block: torch.nn.Module) -> None:
    """Lay the router's rows and the shared gate's row out as one ``[E + 1, H]`` matrix, the two
    weights then views into it: what :func:`route` reads, without a copy. The block's
    ``process_weights_after_loading`` calls this; vLLM's ``finalize_model_weights`` runs that hook
    after every load and weight update, inside the memory vLLM measures as the model's weights, so
    the matrix is never allocated while serving (issue 40 item 3). It replaces the two weights'
    storage, which PyTorch's allocator takes back before vLLM measures. A reload that copies into
    the parameters writes the matrix; one that replaces them is merged again by the same hook.
    With the switch off at load the weights are left as vLLM laid them out, and :func:`forward`
    stands aside."""
    if not enabled() or _router_rows(block) is not None:
        return
    gate, shared_gate = block.gate.weight, block.shared_expert_gate.weight
    # route reads bf16 rows; a CPU build's packed GEMM leaves the router an empty weight
    if (gate.dim() != 2 or shared_gate.shape != (1, gate.shape[1])
            or {gate.dtype, shared_gate.dtype} != {torch.bfloat16}):
        return
    experts = gate.shape[0]
    rows = torch.empty(router_rows_shape(experts, gate.shape[1]), dtype=gate.dtype, device=gate.device)
    rows[:experts].copy_(gate.data)
    rows[experts:].copy_(shared_gate.data)
    gate.data, shared_gate.data = rows[:experts], rows[experts:]
    block._flashnext_router_rows = rows


def _router_rows(block: torch.nn.Module) -> torch.Tensor | None:
    """The matrix :func:`merge_router_rows` made for ``block``, while the router's and the shared
    gate's weights are still its views; else None."""
    rows = getattr(block, "_flashnext_router_rows", None)
    if rows is None:
        return None
    gate, shared_gate = block.gate.weight, block.shared_expert_gate.weight
    experts = gate.shape[0]
    merged = gate.data_ptr() == rows.data_ptr() and shared_gate.data_ptr() == rows[experts:].data_ptr()
    return rows if merged else None


def _uses_marlin(method) -> bool:
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExperts

    experts = getattr(method, "experts_cls", None)
    return isinstance(experts, type) and issubclass(experts, MarlinExperts)


def route_step(x: torch.Tensor, rows: torch.Tensor, top_k: int, experts: int, marlin: bool) -> tuple[int, tuple]:
    """``(the block size aligned for, or 0; route's outputs)`` for a step of 1..MAX_FUSED_TOKENS
    tokens; with Marlin's experts the launch also writes their alignment."""
    align = marlin_block_size(x.shape[0], top_k, experts) if marlin and x.shape[0] <= ALIGN_MAX_TOKENS else 0
    return align, route(x, rows, top_k, align_block=align)


def fused_shared_expert(x: torch.Tensor, up: torch.nn.Module, down: torch.nn.Module) -> bool:
    """Whether the shared expert's step runs as the two fused bit-plane GEMVs: both layers hold
    planes, and for this many tokens on this device the launch table says the GEMVs win
    (:func:`~flashnext.quant.kernels.decode_mma.fused_gemvs_win`)."""
    from flashnext.quant.kernels.decode_mma import fused_gemvs_win
    from flashnext.serving.quantization.bitplane import BitplaneLinearMethod

    if not all(isinstance(p.quant_method, BitplaneLinearMethod) and p.quant_method.planes_kept for p in (up, down)):
        return False
    return fused_gemvs_win(x.shape[0], (up.weight_packed.shape[0], up.bitplane_cols),
                           (down.weight_packed.shape[0], down.bitplane_cols), x.device)


def _shared_expert(mlp: torch.nn.Module, x: torch.Tensor, routed: torch.Tensor, gate_logit: torch.Tensor):
    """``routed + sigmoid(gate_logit) * shared_expert(x)``, as vLLM's ``Qwen2MoeMLP`` and runner
    compute it, or through the bit-plane kernels for a bit-plane shared expert."""
    up, down = mlp.gate_up_proj, mlp.down_proj
    if fused_shared_expert(x, up, down):
        from flashnext.quant.kernels.bitplane_gemv import bitplane_down_combine, bitplane_gate_up_silu

        hidden = bitplane_gate_up_silu(x, up.weight_packed, up.weight_scale)
        return bitplane_down_combine(hidden, down.weight_packed, down.weight_scale, routed, gate_logit)
    hidden, _ = up(x)
    shared, _ = down(mlp.act_fn(hidden))
    return torch.sigmoid(gate_logit) * shared + routed


def forward(block: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor | None:
    """The output of vLLM's ``Qwen3NextSparseMoeBlock`` ``block`` for ``hidden_states``, or None
    where this path does not apply."""
    global _pending_alignment
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    if not enabled() or not _applies(block, x):
        return None
    import vllm.envs

    if vllm.envs.VLLM_BATCH_INVARIANT:
        return None
    runner = block.experts
    router, method = runner.router, runner.routed_experts.quant_method
    top_k, experts = router.top_k, router.global_num_experts
    rows = _router_rows(block)
    if rows is None:  # not merged at load (the switch off then, or weights route cannot read)
        return None
    marlin = x.is_cuda and _uses_marlin(method)
    align, (_, gate_logit, topk_ids, topk_weights, *aligned) = route_step(x, rows, top_k, experts, marlin)
    indices_dtype = method.topk_indices_dtype
    if indices_dtype is not None and topk_ids.dtype != indices_dtype:
        topk_ids = topk_ids.to(indices_dtype)
    runner.routed_experts._ensure_moe_quant_config_init()
    _pending_alignment = (topk_ids, align, experts, tuple(aligned)) if align else None
    try:
        routed = runner.routed_experts.forward_modular(x=x, topk_weights=topk_weights, topk_ids=topk_ids)
    finally:
        _pending_alignment = None
    if not isinstance(routed, torch.Tensor):  # a deferred-finalize output, which only a fused consumer asks for
        raise TypeError(f"decode-05: the routed experts returned {type(routed).__name__}, not a tensor; "
                        "set VLLM_MOE_FUSED_DECODE=0")
    return _shared_expert(block.shared_expert, x, routed, gate_logit).view(hidden_states.shape)
