"""Build vLLM 0.34.0's own ``qwen4_exp`` model for the demo checkpoint on the CPU, run vLLM's own
post-load step over it, then decode steps of 1..4 tokens through its first MoE block; print JSON.
``python moe_decode_rows_at_load_scenario.py SNAPSHOT PORT``, against the stock and patched trees.

The post-load step is ``model_loader.utils.process_weights_after_loading``, what every vLLM loader
runs once the weights are in (each quantization method's hook, then ``finalize_model_weights``:
every module's own hook). What is reported: whether each MoE block's router and shared-gate weights
are views into one ``[E + 1, H]`` matrix right after it, and every tensor that an aten op returns
during the decode steps (recorded by a ``TorchDispatchMode``) with that matrix's shape in storage of
its own: a new router-rows matrix. (Triton's interpreter hands each kernel argument to the kernel as
a ``set_`` view of the argument's own storage, which is no allocation.)

Stood in for, as in ``moe_decode_scenario.py``: the routed experts' kernel (this vLLM build has no
CPU MoE kernels), so the experts' own post-load hook is not run; every layer is bf16 and the weights
are drawn from a seed (the demo's INT4 experts have no CPU kernel either).
"""
import json, os, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support.vllm_demo import build_model, demo_vllm, stand_in_experts_kernel

snapshot, port = sys.argv[1], sys.argv[2]


def bf16_layers(config):
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


class TensorsReturned(TorchDispatchMode):
    """``(op, shape, storage address)`` of every tensor an aten op returns while active."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func), list(t.shape), t.untyped_storage().data_ptr()))
        return out


def views_of_one_matrix(block) -> dict:
    gate, shared_gate = block.gate.weight, block.shared_expert_gate.weight
    experts, hidden = gate.shape
    storage = gate.untyped_storage()
    return {"one_storage": storage.data_ptr() == shared_gate.untyped_storage().data_ptr(),
            "storage_bytes": storage.nbytes(), "matrix_bytes": (experts + 1) * hidden * gate.element_size(),
            "gate_offset": gate.storage_offset(), "shared_gate_offset": shared_gate.storage_offset(),
            "experts": experts, "hidden": hidden}


out = {}
with demo_vllm(snapshot, port, bf16_layers) as (config, _):
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    try:
        import vllm.models.qwen4_exp.nvidia.model as m

        out["patched"] = "moe_decode.merge_router_rows(self)" in open(m.__file__).read()
    except ImportError:
        out["patched"] = False
    model = build_model(config)
    blocks = [layer.mlp for layer in model.language_model.model.layers]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.language_model.parameters():
            if p.dtype.is_floating_point:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    for module in model.modules():
        # The CPU's packed bf16 GEMM needs vllm._C, which this CUDA build of vLLM cannot load without
        # libcuda; vLLM's own flag for a layer that skips it gives torch's F.linear.
        module._cpu_skip_gemm_dispatch = True
    for block in blocks:  # the experts' kernel is stood in for: their post-load hook has nothing to prepare
        block.experts.routed_experts.quant_method.process_weights_after_loading = lambda layer: None
    before = [block.gate.weight.data_ptr() for block in blocks]
    process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    out["blocks"] = [views_of_one_matrix(block) for block in blocks]
    out["gate_moved"] = [block.gate.weight.data_ptr() != ptr for block, ptr in zip(blocks, before)]

    block = blocks[0]
    received = []
    stand_in_experts_kernel(block.experts.routed_experts, received)
    from flashnext.serving.hooks import moe_decode

    rows_shape = [block.gate.weight.shape[0] + 1, block.gate.weight.shape[1]]
    gate_ptr = block.gate.weight.data_ptr()  # the merged matrix's storage: the router's rows come first
    os.environ["VLLM_MOE_FUSED_DECODE"] = "1"
    steps = []
    with set_forward_context(None, config), torch.no_grad():
        for tokens in (1, 2, 3, 4):
            x = torch.randn(tokens, rows_shape[1], generator=g).to(torch.bfloat16)
            with TensorsReturned() as returned:
                fused = moe_decode.forward(block, x) is not None
                block(x)
            steps.append({"tokens": tokens, "fused_path": fused, "ops": len(returned.seen),
                          "rows_shaped_views": [op for op, shape, at in returned.seen
                                                if shape == rows_shape and at == gate_ptr],
                          "new_router_rows": [op for op, shape, at in returned.seen
                                              if shape == rows_shape and at != gate_ptr]})
    out["steps"] = steps
    out["gate_unmoved_by_decode"] = block.gate.weight.data_ptr() == gate_ptr
print(json.dumps(out))
