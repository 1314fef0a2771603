"""Build vLLM 0.34.0's own ``qwen4_exp`` MoE block for the demo checkpoint on the CPU and run decode
steps through it with patch decode-05 on and off; print JSON.

Run by tests/serving/test_patch_series.py under Triton's interpreter, against the stock and the
patched vLLM trees: ``python moe_decode_scenario.py SNAPSHOT PORT [bitplane]``.

* Plain: every layer in bf16 (the CPU has no INT4 MoE kernel), weights drawn from a seed.
* ``bitplane``: SNAPSHOT is a view with the INT6 bit-plane overlay applied; the shared experts are
  built as bit-plane layers (patch int6-bitplane) and loaded from it by vLLM's own loader.
"""
import json, os, sys
import torch

from support.vllm_demo import build_model, demo_vllm, only_int6_shared_experts, read_tensors, stand_in_experts_kernel

snapshot, port = sys.argv[1], sys.argv[2]
bitplane = sys.argv[3:] == ["bitplane"]


def bf16_layers(config):
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


out = {"bitplane": bitplane}
with demo_vllm(snapshot, port, only_int6_shared_experts if bitplane else bf16_layers) as (config, _):
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader.weight_utils import finalize_model_weights

    model = build_model(config)
    block = model.language_model.model.layers[0].mlp
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if p.dtype.is_floating_point and not (bitplane and name.startswith("shared_expert.")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    if bitplane:
        model.load_weights(iter(read_tensors(
            snapshot, lambda n: n.startswith("model.language_model.layers.0.mlp.shared_expert.")).items()))
    experts = block.experts.routed_experts
    for module in block.modules():  # as vLLM's loader finishes a layer (the CPU linear layers' kernels)
        method = getattr(module, "quant_method", None)
        # The CPU's packed bf16 GEMM needs vllm._C, which this CUDA build of vLLM cannot load without
        # libcuda; vLLM's own flag for a layer that skips it gives torch's F.linear (what a CUDA run's
        # default_unquantized_gemm calls).
        module._cpu_skip_gemm_dispatch = True
        if method is not None and module is not experts:
            method.process_weights_after_loading(module)
    finalize_model_weights(block)  # then the modules' own hooks, as vLLM's loader ends (decode-05's rows)
    out["shared_expert_method"] = type(block.shared_expert.gate_up_proj.quant_method).__name__

    received = []
    stand_in_experts_kernel(experts, received)

    patched = False
    try:
        import vllm.models.qwen4_exp.nvidia.model as m
        from flashnext.serving.hooks import moe_decode

        patched = "moe_decode.forward(self, hidden_states)" in open(m.__file__).read()
    except ImportError:
        pass
    out["patched"] = patched
    hidden = block.gate.weight.shape[1]
    with set_forward_context(None, config), torch.no_grad():
        for tokens in (1, 3, 16, 17):
            x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
            os.environ["VLLM_MOE_FUSED_DECODE"] = "0"
            received.clear()
            stock = block(x)
            row = {"tokens": tokens, "max_abs": float(stock.float().abs().max()),
                   "stock_output": [round(v, 6) for v in stock.float().sum(-1).tolist()]}
            if patched:
                os.environ["VLLM_MOE_FUSED_DECODE"] = "1"
                row["fused_path"] = moe_decode.forward(block, x) is not None
                fused = block(x)
                row["max_abs_diff"] = float((fused.float() - stock.float()).abs().max())
                # what the experts' kernel was given by vLLM's router (first call) and the fused one (last)
                (want_ids, want_weights), (got_ids, got_weights) = received[0], received[-1]
                row["same_experts"] = torch.equal(got_ids.sort(-1).values, want_ids.sort(-1).values)
                if tokens <= 16:
                    from flashnext.quant.kernels.moe_route import route

                    rows = torch.cat([block.gate.weight, block.shared_expert_gate.weight])
                    logits, gate_logit, ids, weights = route(x, rows, block.experts.router.top_k)
                    # the logits against vLLM's GEMMs (the interpreter rounds them toward zero)
                    want_logit, _ = block.shared_expert_gate(x)
                    row["gate_logit_max_diff"] = float((gate_logit.float() - want_logit.float()).abs().max())
                    row["router_logit_max_diff"] = float((logits.float() - block.gate(x)[0].float()).abs().max())
                    # given the kernel's own logits, vLLM's router picks the same experts and weights
                    vllm_weights, vllm_ids = block.experts.router.select_experts(hidden_states=x, router_logits=logits)
                    # Tokens whose k-th and next logits tie are left out: vLLM's GPU top-k (and the
                    # kernel) takes the smaller expert, torch.topk on the CPU may not.
                    k = block.experts.router.top_k
                    ordered = logits.float().sort(-1, descending=True).values
                    clear = ordered[:, k - 1] != ordered[:, k]
                    row["tied_tokens"] = int((~clear).sum())
                    row["same_logits_same_experts"] = torch.equal(vllm_ids.long().sort(-1).values[clear],
                                                                  ids.long().sort(-1).values[clear])
                    by_expert = lambda i, w: torch.zeros(tokens, rows.shape[0], dtype=torch.float32).scatter(
                        1, i.long(), w.float())[clear]
                    row["same_logits_max_weight_diff"] = float(
                        (by_expert(vllm_ids, vllm_weights) - by_expert(ids, weights)).abs().max())
            out.setdefault("steps", []).append(row)
print(json.dumps(out))
