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
import json, sys
import torch
from support.vllm_demo import demo_vllm, read_tensors

view, port, ids = sys.argv[1], sys.argv[2], torch.tensor([int(i) for i in sys.argv[3].split(",")])
prefix = "model.language_model.layers.1.ple.ple_embedding."
with demo_vllm(view, port) as (config, _):
    from vllm.models.qwen4_exp.common.ngram_embedding import Qwen4ExpPLEDeviceEmbedding
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding
    owner = next(c for c in Qwen4ExpPLEDeviceEmbedding.__mro__ if "allocate_embedding_weight" in vars(c))
    allocate, asked = owner.allocate_embedding_weight, []

    def recording(self, rows, width, dtype):
        asked.append(rows * width * torch.empty((), dtype=dtype).element_size())
        return allocate(self, rows, width, dtype)

    owner.allocate_embedding_weight = recording
    text = config.model_config.hf_text_config
    ple = Qwen4ExpNGramEmbedding(text, text.ple_embed_dim, 0, 64, data_parallel_rank=0, prefix="ple")
    weights = read_tensors(view, lambda name: name.startswith(prefix))
    ple.load_weights((name[len(prefix):], t) for name, t in weights.items())
    table = ple.ngram_embedding
    table.embedding_method.process_weights_after_loading(table)
    rows = table.dequantize(table(ids), torch.bfloat16)
    print(json.dumps({"rows": rows.float().tolist(), "dtype": str(rows.dtype), "allocated": asked,
                      "method": type(table.embedding_method).__name__, "backend": type(table).__name__}))
