"""Build vLLM 0.33.0's own ``qwen4_exp`` model for the demo checkpoint on the CPU and load the
release's INT8 ``embed_tokens`` and ``lm_head`` with vLLM's own loader; print JSON.

Run by tests/serving/test_patch_series.py against stock and patched vLLM trees:
``python int8_modules_scenario.py SNAPSHOT PORT``. The checkpoint's INT6 and INT4 groups are dropped
from the quantization config (the CPU has no kernels for them, and these layers do not depend on
them), and so are the INT8 linear layers other than these two (no CPU kernel for those either).
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
        keep = {k: g for k, g in groups.items() if "lm_head" in g["targets"]}
        for g in keep.values():
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
    names = [n for n in index if n.startswith(("model.language_model.embed_tokens.", "lm_head."))]
    tensors = {}
    for name in names:
        with safe_open(os.path.join(snapshot, index[name]), "pt") as f:
            tensors[name] = f.get_tensor(name)
    try:
        model.load_weights(iter(tensors.items()))
        out["loaded"] = True
    except ValueError as error:
        out["loaded"] = str(error).split(".")[0][:120]
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
