"""Build vLLM 0.33.0's own ``qwen4_exp`` model for the demo checkpoint on the CPU and load the
release's INT8 ``embed_tokens`` and ``lm_head`` with vLLM's own loader; print JSON.

Run by tests/serving/test_patch_series.py against stock and patched vLLM trees:
``python int8_modules_scenario.py SNAPSHOT PORT``. The checkpoint's INT6 and INT4 groups are dropped
from the quantization config (the CPU has no kernels for them, and these layers do not depend on
them), and so are the INT8 linear layers other than these two (no CPU kernel for those either).
"""
import importlib, json, os, sys
import torch
from safetensors import safe_open
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel

from flashnext.quant.formats.packing import unpack_int32

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


model_config = ModelConfig(model=snapshot, max_model_len=4096, skip_tokenizer_init=True, dtype="bfloat16",
                           hf_overrides=only_these_int8_layers)
config = VllmConfig(model_config=model_config)
config.engram_config.cpu_offload = False
out = {}
with set_current_vllm_config(config):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:" + port,
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)
    torch.set_default_dtype(torch.bfloat16)
    importlib.import_module("vllm.models.qwen4_exp.nvidia.model")  # before qsa, which imports it back
    import vllm.models.qwen4_exp.nvidia.qsa as qsa

    qsa.is_flash_attn_varlen_func_available = lambda: True  # QSA never runs flash-attn; only the probe
    from vllm.model_executor.models import ModelRegistry

    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    model = model_cls(vllm_config=config, prefix="")
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
