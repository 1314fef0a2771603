"""Build vLLM 0.33.0's own ``Qwen4ExpNGramEmbedding`` for the demo checkpoint on the CPU from a VIEW
(the snapshot with a ``flashnext ple build --format nvfp4|fp8`` overlay applied), load its PLE
weights through the module's own ``load_weights``, gather the rows of some ids through its PLE
embedding and dequantize them with its own method; print what it returned, as JSON, with the bytes
of every tensor the method asked the embedding to allocate (``allocate_embedding_weight``, which
patch host-pool makes exact-size pinned memory in the pinned-host backend).

``python ple_quantized_scenario.py VIEW PORT ID,ID,...``. The table is vLLM's device-resident
one: its pinned-host backend needs a CUDA driver (``pin_memory``, a UVA view), which this machine has
not, and reads the same parameters through a Triton gather of the same formula.
"""
import json, os, sys
import torch
from safetensors import safe_open
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel

view, port, ids = sys.argv[1], sys.argv[2], torch.tensor([int(i) for i in sys.argv[3].split(",")])
model_config = ModelConfig(model=view, max_model_len=4096, skip_tokenizer_init=True, dtype="bfloat16")
config = VllmConfig(model_config=model_config)
config.engram_config.cpu_offload = False
with set_current_vllm_config(config):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:" + port,
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)
    from vllm.models.qwen4_exp.common.ngram_embedding import Qwen4ExpPLEDeviceEmbedding
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding
    owner = next(c for c in Qwen4ExpPLEDeviceEmbedding.__mro__ if "allocate_embedding_weight" in vars(c))
    allocate, asked = owner.allocate_embedding_weight, []

    def recording(self, rows, width, dtype):
        asked.append(rows * width * torch.empty((), dtype=dtype).element_size())
        return allocate(self, rows, width, dtype)

    owner.allocate_embedding_weight = recording
    text = model_config.hf_text_config
    torch.set_default_dtype(torch.bfloat16)
    ple = Qwen4ExpNGramEmbedding(text, text.ple_embed_dim, 0, 64, data_parallel_rank=0, prefix="ple")
    prefix = "model.language_model.layers.1.ple.ple_embedding."
    index = json.load(open(os.path.join(view, "model.safetensors.index.json")))["weight_map"]

    def weights():
        for name, shard in index.items():
            if name.startswith(prefix):
                with safe_open(os.path.join(view, shard), "pt") as f:
                    yield name[len(prefix):], f.get_tensor(name)

    ple.load_weights(weights())
    table = ple.ngram_embedding
    table.embedding_method.process_weights_after_loading(table)
    rows = table.dequantize(table(ids), torch.bfloat16)
    print(json.dumps({"rows": rows.float().tolist(), "dtype": str(rows.dtype), "allocated": asked,
                      "method": type(table.embedding_method).__name__, "backend": type(table).__name__}))
