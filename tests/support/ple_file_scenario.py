"""Build vLLM 0.34.0's own ``Qwen4ExpNGramEmbedding`` for the demo checkpoint on the CPU, load its
PLE weights from the snapshot, embed a two-request batch and print what happened, as JSON.

Run by tests/serving/test_patch_series.py against stock and patched vLLM trees: ``python
ple_file_scenario.py SNAPSHOT PORT``. With the patch series and ``VLLM_PLE_MMAP_PATH`` the layer
is the file-backed backend, driven the way the patched model state drives it.
"""
import hashlib, json, os, sys
import numpy as np, torch
from safetensors import safe_open
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel

snapshot = sys.argv[1]
model_config = ModelConfig(model=snapshot, max_model_len=4096, skip_tokenizer_init=True, dtype="bfloat16")
config = VllmConfig(model_config=model_config)
config.engram_config.cpu_offload = False  # stock vLLM's other backend: the table in device memory
out = {}
with set_current_vllm_config(config):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:" + sys.argv[2],
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding
    text = model_config.hf_text_config
    torch.set_default_dtype(torch.bfloat16)
    ple = Qwen4ExpNGramEmbedding(text, text.ple_embed_dim, 0, 64, data_parallel_rank=0, prefix="ple")
    out["backend"] = type(ple.ngram_embedding).__name__
    prefix = "model.language_model.layers.1.ple.ple_embedding."
    index = json.load(open(os.path.join(snapshot, "model.safetensors.index.json")))["weight_map"]
    def weights():
        for name, shard in index.items():
            if name.startswith(prefix):
                with safe_open(os.path.join(snapshot, shard), "pt") as f:
                    yield name[len(prefix):], f.get_tensor(name)
    ple.load_weights(weights())
    rng = np.random.default_rng(0)
    input_ids = torch.tensor(rng.integers(0, text.vocab_size, 24), dtype=torch.long)
    input_ids[7] = text.eos_token_id
    query_start_loc = torch.tensor([0, 10, 24], dtype=torch.int32)
    context = torch.tensor([[text.eos_token_id] * 2, [11, 12]], dtype=torch.int32)
    try:
        from flashnext.serving.hooks.ple_file import attach
        serving = attach(ple)
    except ImportError:
        serving = None
    if serving is not None:
        ids = serving.ngram_ids(input_ids, query_start_loc, context)
        out["advised_prefill"] = serving.advise(ids)
        serving.stage(ids)
    y = ple(None, input_ids, query_start_loc, context)
    out["sha256"] = hashlib.sha256(y.float().numpy().tobytes()).hexdigest()[:16]
    if serving is not None:
        one = torch.tensor([5], dtype=torch.long)
        ids = serving.ngram_ids(one, torch.tensor([0, 1], dtype=torch.int32), context[1:])
        out["advised_decode"] = serving.advise(ids)
        serving.admitted("req-1", rng.integers(0, text.vocab_size, 3000).tolist())
        pf = serving._prefetchers
        if pf:
            pf[0].drain()
        out["prompt_windows"] = pf[0].windows_advised if pf else 0
        out["weight_is_the_file"] = ple.ngram_embedding.weight.data_ptr() == ple.ngram_embedding.table.mapping.address
print(json.dumps(out))
