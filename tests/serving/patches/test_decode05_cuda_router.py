"""decode-05 on the router vLLM 0.34.0 builds for this MoE on CUDA (issue 25, item 1).

vLLM's own MoE block for the demo checkpoint, built on the CPU by vLLM's own ``FusedMoEFactory``
while ``router_factory``'s platform reports CUDA, so the block holds what a GPU run holds
(``FusedTopKRouter``, not the ``CPURouter`` the CPU picks). Stand-ins, named in the scenario: the
routed experts' kernel and the CUDA op ``topk_softmax`` that vLLM's router calls.
"""

from support import SUPPORT_DIR, free_port, run_scenario

ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}


def test_decode05_serves_vllms_cuda_router_and_declines_every_other(patched_tree, demo_snapshot):
    script = (SUPPORT_DIR / "moe_decode_cuda_router_scenario.py").read_text()
    out = run_scenario(script, (str(demo_snapshot), free_port()), str(patched_tree), ENV)
    assert out["patched"] is True
    assert out["router"] == "FusedTopKRouter" and out["cpu_router"] == "CPURouter"
    for step in out["steps"]:
        assert "error" not in step, step  # before: AttributeError ('use_grouped_topk') at every fused step
        assert step["fused_path"] is (step["tokens"] <= 4)  # the CUDA-graph sizes; eager steps: vLLM's path
        # against vLLM's own path (the switch off) through the same router: the same experts
        assert step["same_experts"]
        if step["fused_path"]:
            # vLLM's router takes its softmax of the bf16 GEMM's logits; the kernel's logits are
            # rounded toward zero by the interpreter: one bf16 step apart at most
            assert step["max_weight_diff"] <= 2 ** -7
            assert step["max_abs_diff"] <= 2 ** -7 * max(step["max_abs"], 1.0)
        else:
            assert step["max_abs_diff"] == 0.0
    flavours = out["flavours"]
    reproduced = {"cuda_plain", "cuda_degenerate_grouped", "cpu_plain"}
    for name, (cls, result) in flavours.items():
        assert result == ("reproduced" if name in reproduced else "declined"), (name, cls, result)
    # the factory's own picks on CUDA, one per flavour
    assert {name: cls for name, (cls, _) in flavours.items() if name.startswith("cuda_")} == {
        "cuda_plain": "FusedTopKRouter", "cuda_degenerate_grouped": "FusedTopKRouter",
        "cuda_grouped": "GroupedTopKRouter", "cuda_custom": "CustomRoutingRouter",
        "cuda_biased": "FusedTopKBiasRouter", "cuda_hashed": "FusedTopKBiasRouter",
        "cuda_sigmoid": "FusedTopKRouter", "cuda_not_renormalized": "FusedTopKRouter", "cuda_eplb": "FusedTopKRouter",
        "cuda_capturing": "FusedTopKRouter", "cuda_zero_expert": "ZeroExpertRouter"}
    assert flavours["simulated"][0] == "RoutingSimulatorRouter"
