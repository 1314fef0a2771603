"""Build vLLM 0.33.0's own ``qwen4_exp`` model on the CPU for the demo checkpoint with the INT6
bit-plane overlay applied (a view from ``flashnext overlay apply``), load the shared experts with
vLLM's own loader, and run them; print JSON.

Run by tests/serving/test_patch_series.py: ``python int6_bitplane_scenario.py VIEW ORIGINAL PORT``.
The quantization config keeps only the INT6 group, narrowed to the shared experts (the other INT6
layers are not in the overlay, and the CPU has no kernel for dense INT6 outside vLLM's
batch-invariant mode, which the scenario's dense runs set).
"""
import json, os, sys
import torch

from flashnext.quant.formats.packing import dequantize_groups, unpack_int32
from support.vllm_demo import build_model, demo_vllm, only_int6_shared_experts, read_tensors as read

view, original, port = sys.argv[1], sys.argv[2], sys.argv[3]

out = {}
with demo_vllm(view, port, only_int6_shared_experts) as (config, _):
    model = build_model(config)
    text = model.language_model.model
    experts = [layer.mlp.shared_expert for layer in text.layers]
    out["methods"] = sorted({type(p.quant_method).__name__ for e in experts for p in (e.gate_up_proj, e.down_proj)})
    tensors = read(view, lambda n: n.startswith("model.language_model.") and ".mlp.shared_expert." in n)
    try:
        model.load_weights(iter(tensors.items()))
        out["loaded"] = True
    except Exception as error:
        out["loaded"] = f"{type(error).__name__}: {str(error)[:160]}"
    if out["loaded"] is True:
        for e in experts:
            for p in (e.gate_up_proj, e.down_proj):
                p.quant_method.process_weights_after_loading(p)
        dense = read(original, lambda n: n.startswith("model.language_model.layers.0.mlp.shared_expert."))

        def weight(name):
            prefix = f"model.language_model.layers.0.mlp.shared_expert.{name}."
            cols = int(dense[prefix + "weight_shape"][1])
            return dequantize_groups(unpack_int32(dense[prefix + "weight_packed"], 6, cols), dense[prefix + "weight_scale"])

        expert = experts[0]
        x = torch.randn(3, expert.gate_up_proj.input_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        got = expert.gate_up_proj(x)
        got = got[0] if isinstance(got, tuple) else got
        want = x.float() @ torch.cat([weight("gate_proj"), weight("up_proj")]).T
        out["gate_up_error"] = float(((got.float() - want).abs() / want.abs().clamp_min(1.0)).max())
        out["weight_dtype"] = str(expert.gate_up_proj.weight_packed.dtype)

        # The switch off: vLLM's own INT6 layer, built from the same quantization config and loaded
        # through its own weight loader. The CPU has no INT6 kernel (vLLM's kernel choice fails)
        # outside batch-invariant mode, which the whole model's MoE layers refuse: so one layer.
        os.environ.update(VLLM_INT6_BITPLANE="0", VLLM_BATCH_INVARIANT="1")
        from vllm.model_executor.layers.linear import MergedColumnParallelLinear

        size = expert.gate_up_proj.output_partition_sizes[0]
        fallback = MergedColumnParallelLinear(x.shape[1], [size, size], bias=False, quant_config=config.quant_config,
                                              prefix="language_model.model.layers.0.mlp.shared_expert.gate_up_proj")
        out["fallback_method"] = [type(fallback.quant_method).__name__, type(fallback.scheme).__name__,
                                  fallback.quant_method.planes_kept]
        for shard, part in enumerate(("gate_proj", "up_proj")):
            for kind in ("weight_packed", "weight_scale", "weight_shape"):
                param = getattr(fallback, kind)
                param.weight_loader(param, tensors[f"model.language_model.layers.0.mlp.shared_expert.{part}.{kind}"],
                                    shard)
        fallback.quant_method.process_weights_after_loading(fallback)
        out["fallback_words_equal_original"] = torch.equal(
            fallback.weight_packed.data,
            torch.cat([dense["model.language_model.layers.0.mlp.shared_expert.gate_proj.weight_packed"],
                       dense["model.language_model.layers.0.mlp.shared_expert.up_proj.weight_packed"]]))
        # Not run: vLLM 0.33.0's batch-invariant INT6 matmul unpacks 6-bit words as the padded layout
        # (5 values a word), so it cannot read the release's dense words; on a GPU, Marlin serves them.
print(json.dumps(out))
