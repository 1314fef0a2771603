"""Build vLLM 0.34.0's own ``qwen4_exp`` model for the demo checkpoint on the CPU and load the
release's INT8 ``embed_tokens``, ``lm_head`` and hyper-connection mixers with vLLM's own loader; run
a mixer's mix fused (decode-04) and unfused; print JSON.

Run by tests/serving/test_patch_series.py against stock and patched vLLM trees:
``python int8_modules_scenario.py SNAPSHOT PORT``. The checkpoint's INT6 and INT4 groups are dropped
from the quantization config (the CPU has no kernels for them, and these layers do not depend on
them), and so are the INT8 layers that vLLM itself quantizes (PLE and indexer projections: Marlin,
no CPU kernel).
"""
import json, os, sys
import torch
from safetensors import safe_open

from flashnext.quant.formats.packing import unpack_int32
from support.vllm_demo import build_model, demo_vllm

snapshot, port = sys.argv[1], sys.argv[2]


def only_these_int8_layers(config):
    qc = getattr(config, "quantization_config", None)
    if qc is not None:
        groups = qc["config_groups"]
        keep = {k: g for k, g in groups.items() if g["weights"]["num_bits"] == 8}
        for g in keep.values():
            if "lm_head" in g["targets"]:
                g["targets"] = ["lm_head", "re:.*embed_tokens$"]
        qc["config_groups"] = keep
    return config


out = {}
with demo_vllm(snapshot, port, only_these_int8_layers) as (config, _):
    model = build_model(config)
    embed = model.language_model.model.embed_tokens
    lm_head = model.language_model.lm_head
    out["methods"] = [type(embed.quant_method).__name__, type(lm_head.quant_method).__name__]

    index = json.load(open(os.path.join(snapshot, "model.safetensors.index.json")))["weight_map"]
    def read(names):
        tensors = {}
        for name in names:
            with safe_open(os.path.join(snapshot, index[name]), "pt") as f:
                tensors[name] = f.get_tensor(name)
        return tensors

    tensors = read([n for n in index if n.startswith(("model.language_model.embed_tokens.", "lm_head."))])
    try:
        model.load_weights(iter(tensors.items()))
        out["loaded"] = True
    except ValueError as error:
        out["loaded"] = str(error).split(".")[0][:120]
    hc_tensors = read([n for n in index if n.startswith("model.language_model.") and "hyper_connection" in n])
    try:
        model.load_weights(iter(hc_tensors.items()))
        out["hc_loaded"] = True
    except Exception as error:  # stock: an AttributeError inside the merged layer's loader
        out["hc_loaded"] = type(error).__name__
    if out["hc_loaded"] is True:
        from flashnext.quant.kernels.reference import reference_mix, round_toward_zero
        from vllm.models.qwen4_exp.nvidia.ops.hc import grouped_gemma_rmsnorm

        text = model.language_model.model
        ckpt = lambda name: hc_tensors["model.language_model." + name]
        mixers = {"layers.0.attn_hyper_connection": text.layers[0].attn_hyper_connection,
                  "layers.1.mlp_hyper_connection": text.layers[1].mlp_hyper_connection,
                  "hyper_connection_mixer": text.hyper_connection_mixer}
        out["hc_methods"] = sorted({type(m.quant_method).__name__ for gr in mixers.values()
                                    for m in gr.modules() if hasattr(m, "quant_method")})
        exact, fused_equal, reference_equal, fused_applies = True, True, True, True
        for name, gr in mixers.items():
            down = gr.input_mix_weight_down_block_inject if gr.use_combine else gr.input_mix_weight_down
            up = gr.input_mix_weight_up
            low, hc = gr.hc_lowrank, gr.hc_count
            exact &= torch.equal(down.weight_packed[:low], ckpt(name + ".input_mix_weight_down.weight_packed"))
            exact &= torch.equal(up.weight_packed, ckpt(name + ".input_mix_weight_up.weight_packed"))
            exact &= torch.equal(up.weight_scale, ckpt(name + ".input_mix_weight_up.weight_scale"))
            if gr.use_combine:
                exact &= torch.equal(down.weight_packed[low:low + hc], ckpt(name + ".block_inject_weight.weight_packed"))
                exact &= bool((down.weight_packed[low + hc:] == 0).all() and (down.weight_scale[low + hc:] == 0).all())
            hidden = torch.randn(3, gr.hyper_hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
            results = {}
            for switch in ("1", "0"):
                os.environ["VLLM_HC_FUSED_DECODE"] = switch
                results[switch] = gr.mix(hidden)[1:]
            xn = grouped_gemma_rmsnorm(hidden, gr.hc_norm.weight, gr.config.rms_norm_eps, hc)
            os.environ["VLLM_HC_FUSED_DECODE"] = "1"
            from flashnext.serving.hooks import hc_decode
            fused_applies &= hc_decode.mix(gr, xn) is not None
            block, injection, _ = reference_mix(xn, (down.weight_packed, down.weight_scale),
                                                (up.weight_packed, up.weight_scale), low, hc, round_toward_zero)
            same = lambda a, b: (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            fused_equal &= all(same(a, b) for a, b in zip(results["1"], results["0"]))
            reference_equal &= same(results["1"][0], block) and same(results["1"][1], injection)
        out["hc_weights_exact"] = bool(exact)
        out["hc_fused_equals_unfused"] = bool(fused_equal)
        out["hc_equals_reference"] = bool(reference_equal)
        out["hc_fused_applies"] = bool(fused_applies)
    if out["loaded"] is True:
        def reference(prefix):
            codes = unpack_int32(tensors[prefix + "weight_packed"], 8, int(tensors[prefix + "weight_shape"][1]))
            scale = tensors[prefix + "weight_scale"].float()
            groups = codes.float().view(codes.shape[0], scale.shape[1], -1) * scale.unsqueeze(-1)
            return groups.view(codes.shape).to(torch.bfloat16)

        ids = torch.tensor([0, 7, 4095, 12, 7])
        want = reference("model.language_model.embed_tokens.")
        out["embedding_exact"] = bool(torch.equal(embed(ids), want[ids]))
        hidden = torch.randn(3, want.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        logits = model.compute_logits(hidden)
        ref = hidden.float() @ reference("lm_head.").float().T
        out["logits_shape"] = list(logits.shape)
        out["logits_error"] = float(((logits.float() - ref).abs() / ref.abs().clamp_min(1.0)).max())
        out["weight_bytes_per_row"] = lm_head.weight_packed.shape[1] * 4
print(json.dumps(out))
