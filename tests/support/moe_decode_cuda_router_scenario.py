"""vLLM 0.34.0's own ``qwen4_exp`` MoE block for the demo checkpoint, built on the CPU with the router
that vLLM builds for it on CUDA, and decode steps through it with patch decode-05 on and off; print
JSON. ``python moe_decode_cuda_router_scenario.py SNAPSHOT PORT``.

vLLM picks the router in ``router_factory.create_fused_moe_router``, whose only question to the
platform is ``current_platform.is_cpu()`` (CUDA: no; this machine: yes, which gives ``CPURouter``).
For the model's construction that module's platform reports CUDA (vLLM's own CPU platform class with
the CUDA enum; vLLM's CUDA platform module cannot be imported without libcuda), so the block is built
by vLLM's own ``FusedMoEFactory`` with whatever router the factory picks on CUDA for this config.

Stood in for, because they do not exist in this CPU build: the routed experts' kernel (as in
``moe_decode_scenario.py``) and ``vllm._custom_ops.topk_softmax`` (a CUDA op of ``_moe_C``), which
vLLM's ``FusedTopKRouter`` calls; the stand-in is its documented arithmetic: softmax over the
experts in fp32, the top k (ties to the smaller expert), renormalized.
"""
import json, os, sys
import torch

from support.vllm_demo import build_model, demo_vllm, stand_in_experts_kernel

snapshot, port = sys.argv[1], sys.argv[2]


def bf16_layers(config):
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def stand_in_topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize=False,
                          e_score_correction_bias=None, is_padding=None):
    assert e_score_correction_bias is None and is_padding is None
    probs = torch.softmax(gating_output.float(), dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :topk_ids.shape[1]]
    weights = probs.gather(1, order)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    topk_weights.copy_(weights)
    topk_ids.copy_(order)
    token_expert_indices.copy_(order)


out = {}
with demo_vllm(snapshot, port, bf16_layers) as (config, _):
    import vllm._custom_ops as ops
    import vllm.model_executor.layers.fused_moe.router.router_factory as factory
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader.weight_utils import finalize_model_weights
    from vllm.platforms.interface import PlatformEnum

    cpu_platform = factory.current_platform

    class CudaReportingPlatform(type(cpu_platform)):
        _enum = PlatformEnum.CUDA

    def cuda_router(**kwargs):
        """``create_fused_moe_router`` as it runs on CUDA."""
        factory.current_platform = CudaReportingPlatform()
        try:
            return factory.create_fused_moe_router(**kwargs)
        finally:
            factory.current_platform = cpu_platform

    factory.current_platform = CudaReportingPlatform()
    try:
        model = build_model(config)
    finally:
        factory.current_platform = cpu_platform
    block = model.language_model.model.layers[0].mlp
    router = block.experts.router
    out["router"] = type(router).__name__
    top_k, experts = router.top_k, router.global_num_experts
    # the same arguments on the CPU give the router the CPU tests met before
    out["cpu_router"] = type(factory.create_fused_moe_router(top_k=top_k, global_num_experts=experts)).__name__

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if p.dtype.is_floating_point:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    routed_experts = block.experts.routed_experts
    for module in block.modules():  # as vLLM's loader finishes a layer
        method = getattr(module, "quant_method", None)
        # The CPU's packed bf16 GEMM needs vllm._C, which this CUDA build of vLLM cannot load without
        # libcuda; vLLM's own flag for a layer that skips it gives torch's F.linear (what a CUDA run's
        # default_unquantized_gemm calls).
        module._cpu_skip_gemm_dispatch = True
        if method is not None and module is not routed_experts:
            method.process_weights_after_loading(module)
    finalize_model_weights(block)  # then the modules' own hooks, as vLLM's loader ends (decode-05's rows)
    received = []
    stand_in_experts_kernel(routed_experts, received)
    ops.topk_softmax = stand_in_topk_softmax

    try:
        import vllm.models.qwen4_exp.nvidia.model as m

        out["patched"] = "moe_decode.forward(self, hidden_states)" in open(m.__file__).read()
    except ImportError:
        out["patched"] = False
    from flashnext.serving.hooks import moe_decode

    out["hook"] = moe_decode.__file__
    hidden = block.gate.weight.shape[1]
    with set_forward_context(None, config), torch.no_grad():
        for tokens in (1, 2, 3, 4, 8, 16, 17):
            x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
            os.environ["VLLM_MOE_FUSED_DECODE"] = "0"
            received.clear()
            stock = block(x)
            row = {"tokens": tokens, "max_abs": float(stock.float().abs().max())}
            os.environ["VLLM_MOE_FUSED_DECODE"] = "1"
            try:
                row["fused_path"] = moe_decode.forward(block, x) is not None
                fused = block(x)
            except Exception as e:  # what capture met on CUDA before the fix
                row["error"] = f"{type(e).__name__}: {e}"
                out.setdefault("steps", []).append(row)
                continue
            row["max_abs_diff"] = float((fused.float() - stock.float()).abs().max())
            (want_ids, want_weights), (got_ids, got_weights) = received[0], received[-1]
            row["same_experts"] = torch.equal(got_ids.sort(-1).values, want_ids.sort(-1).values)
            by_expert = lambda i, w: torch.zeros(tokens, experts, dtype=torch.float32).scatter(1, i.long(), w.float())
            row["max_weight_diff"] = float((by_expert(got_ids, got_weights) - by_expert(want_ids, want_weights))
                                           .abs().max())
            out.setdefault("steps", []).append(row)

        # Every other router vLLM 0.34.0 can build: reproduced where it is plain softmax top-k,
        # declined (None, vLLM's path) otherwise, never an exception.
        from vllm.distributed.eplb.eplb_state import EplbLayerState
        from vllm.model_executor.layers.fused_moe.router.aiter_shared_routed_fused_moe_router import (
            AiterSharedRoutedFusedMoERouter)
        from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
        from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter

        common = dict(top_k=top_k, global_num_experts=experts)
        bias = torch.zeros(experts)
        custom = lambda hidden_states, gating_output, topk, renormalize: torch.topk(gating_output, topk)

        class SubclassedRouter(FusedTopKRouter):
            pass

        def flavour(name, build):
            os.environ.pop("VLLM_MOE_ROUTING_SIMULATION_STRATEGY", None)
            if name == "simulated":
                os.environ["VLLM_MOE_ROUTING_SIMULATION_STRATEGY"] = "uniform_random"
            try:
                return build()
            finally:
                os.environ.pop("VLLM_MOE_ROUTING_SIMULATION_STRATEGY", None)

        captured = cuda_router(**common)
        captured.set_capture_fn(lambda ids: None)
        flavours = {
            "cuda_plain": lambda: cuda_router(**common),
            "cuda_degenerate_grouped": lambda: cuda_router(**common, use_grouped_topk=True, num_expert_group=1,
                                                           topk_group=1),
            "cuda_grouped": lambda: cuda_router(**common, use_grouped_topk=True, num_expert_group=2, topk_group=1),
            "cuda_custom": lambda: cuda_router(**common, custom_routing_function=custom),
            "cuda_biased": lambda: cuda_router(**common, e_score_correction_bias=bias),
            "cuda_hashed": lambda: cuda_router(**common, hash_indices_table=torch.zeros(8, top_k, dtype=torch.int32)),
            "cuda_sigmoid": lambda: cuda_router(**common, scoring_func="sigmoid"),
            "cuda_not_renormalized": lambda: cuda_router(**common, renormalize=False),
            "cuda_eplb": lambda: cuda_router(**common, eplb_state=EplbLayerState()),
            "cuda_capturing": lambda: captured,
            "cuda_zero_expert": lambda: cuda_router(**common, zero_expert_type="identity", num_logical_experts=experts,
                                                    e_score_correction_bias=bias),
            "simulated": lambda: cuda_router(**common),
            "aiter_shared": lambda: AiterSharedRoutedFusedMoERouter(**common, num_fused_shared_experts=1),
            "subclass": lambda: SubclassedRouter(**common),
            "cpu_plain": lambda: CPURouter(**common),
            "cpu_grouped": lambda: CPURouter(**common, use_grouped_topk=True, num_expert_group=2, topk_group=1),
            "cpu_biased": lambda: CPURouter(**common, e_score_correction_bias=bias),
            "cpu_custom": lambda: CPURouter(**common, custom_routing_function=custom),
        }
        x = torch.randn(2, hidden, generator=g).to(torch.bfloat16)
        for name, build in flavours.items():
            built = flavour(name, build)
            block.experts.router = built
            try:
                result = "reproduced" if moe_decode.forward(block, x) is not None else "declined"
            except Exception as e:
                result = f"{type(e).__name__}: {e}"
            out.setdefault("flavours", {})[name] = [type(built).__name__, result]
        block.experts.router = router
print(json.dumps(out))
