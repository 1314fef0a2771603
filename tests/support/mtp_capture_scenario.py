"""The capture recipe of docs/make-mtp-int4.md, run on vLLM 0.33.0's own draft model for the demo
checkpoint, on the CPU: ``python mtp_capture_scenario.py SNAPSHOT PORT OUT.safetensors``; prints JSON.

vLLM's ``Qwen4ExpMTP`` (what ``--speculative-config '{"method": "mtp"}'`` runs) is built and loaded
from the snapshot by vLLM's own loader; a forward pre-hook on ``model.layers[0].mlp`` records what the
block receives while the block runs; the recording is written as ``--calib`` takes it. Printed: the
block's class, whether vLLM loaded the router make-mtp-int4 reads from the snapshot, the recording's
shape, and whether make-mtp-int4's routing of the recording picks the experts vLLM's router chose.

The routed experts' kernel is the one thing stood in for (``stand_in_experts_kernel``: this vLLM
build has no CPU MoE kernels); it records what vLLM's router gave it.
"""
import json
import sys

import torch
from safetensors.torch import save_file

from support.vllm_demo import demo_vllm, finish_layers, read_tensors, stand_in_experts_kernel

snapshot, port, out_path = sys.argv[1], sys.argv[2], sys.argv[3]


def bf16_layers(config):
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


with demo_vllm(snapshot, port, bf16_layers, mtp=True) as (config, _):
    from vllm.forward_context import set_forward_context
    from vllm.models.qwen4_exp.nvidia.mtp import Qwen4ExpMTP

    draft = Qwen4ExpMTP(vllm_config=config)
    draft.load_weights(iter(read_tensors(snapshot, lambda n: n.startswith("mtp.")).items()))
    block = draft.model.layers[0].mlp  # the recipe's module
    experts = block.experts.routed_experts
    finish_layers(block, skip=experts)
    chosen = []
    stand_in_experts_kernel(experts, chosen)

    # -- the recipe, as documented --------------------------------------------------------------
    rows = []
    hook = block.register_forward_pre_hook(
        lambda mod, args: rows.append(args[0].detach().reshape(-1, args[0].shape[-1]).cpu()))
    g = torch.Generator().manual_seed(0)
    hidden = block.gate.weight.shape[1]
    with set_forward_context(None, config), torch.no_grad():
        for tokens in (5, 40, 83):  # three "prompts"
            block(torch.randn(tokens, hidden, generator=g).to(torch.bfloat16) * 2)
    hook.remove()
    save_file({"hidden_states": torch.cat(rows)}, out_path)
    # ---------------------------------------------------------------------------------------------

    from flashnext.quant.quantizers.calibration import route

    recorded = torch.cat(rows).float()
    router = read_tensors(snapshot, lambda n: n == "mtp.layers.0.mlp.gate.weight")["mtp.layers.0.mlp.gate.weight"]
    logits = recorded @ router.float().T
    k = block.experts.router.top_k
    ordered = logits.sort(-1, descending=True).values
    clear = (ordered[:, k - 1] - ordered[:, k]) > 2 ** -6 * ordered[:, 0].abs().clamp(min=1)  # no near-ties
    ids, _ = route(recorded, router, k, True)
    vllm_ids = torch.cat([ids for ids, _ in chosen])
    print(json.dumps({
        "block": type(block).__name__,
        "router_equal": torch.equal(block.gate.weight.float(), router.float()),
        "recorded_shape": list(recorded.shape),
        "kernel_calls": len(chosen),
        "clear_tokens": int(clear.sum()),
        "same_experts": torch.equal(ids.sort(-1).values[clear], vllm_ids.sort(-1).values[clear]),
    }))
