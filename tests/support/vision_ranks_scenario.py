"""One rank of a two-rank pipeline (gloo, vLLM's own process groups) building vLLM 0.34.0's own
``qwen4_exp`` model for the demo checkpoint on the CPU and loading the vision tower's tensors with
the model's own loader; prints what the rank holds, as JSON.

``python vision_ranks_scenario.py RANK PORT SNAPSHOT``. The quantization groups are dropped (no CPU
kernels for them; the vision tower is bf16 in the release).
"""
import json, os, sys
import torch
from safetensors import safe_open
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel

rank, port, snapshot = int(sys.argv[1]), sys.argv[2], sys.argv[3]


def bf16_only(config):
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    return config


model_config = ModelConfig(model=snapshot, max_model_len=4096, skip_tokenizer_init=True, dtype="bfloat16",
                           hf_overrides=bf16_only)
config = VllmConfig(model_config=model_config, cache_config=CacheConfig(),
                    parallel_config=ParallelConfig(pipeline_parallel_size=2))
config.engram_config.cpu_offload = False
out = {"rank": rank}
with set_current_vllm_config(config):
    init_distributed_environment(world_size=2, rank=rank, distributed_init_method="tcp://127.0.0.1:" + port,
                                 local_rank=rank, backend="gloo")
    initialize_model_parallel(1, 2)
    torch.set_default_dtype(torch.bfloat16)
    from vllm.model_executor.model_loader.utils import initialize_model

    model = initialize_model(vllm_config=config)
    visual = model.visual
    out["visual"] = type(visual).__name__
    out["visual_parameters"] = sum(p.numel() for n, p in model.named_parameters() if n.startswith("visual."))
    index = json.load(open(os.path.join(snapshot, "model.safetensors.index.json")))["weight_map"]
    names = [n for n in index if n.startswith("model.visual.")]
    tensors = {}
    for name in names:
        with safe_open(os.path.join(snapshot, index[name]), "pt") as f:
            tensors[name] = f.get_tensor(name)
    try:
        loaded = model.load_weights(iter(tensors.items()))
        out["loaded_visual"] = len([n for n in loaded if "visual" in n])
    except Exception as error:
        out["loaded_visual"] = f"{type(error).__name__}: {str(error)[:200]}"
    out["checkpoint_visual_tensors"] = len(names)
print(json.dumps(out))
