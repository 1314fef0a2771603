"""One pipeline rank of a two-rank gloo group on the CPU (vLLM's own process groups), building
the modules patches mem-01 and mtp-02 place and loading a checkpoint's tensors into them with
vLLM's AutoWeightsLoader, and asking mtp-01 which branch the draft takes.
``python pp_ranks_scenario.py RANK PORT`` prints the rank's result as JSON."""

import json
import sys

import torch
from torch import nn
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.utils import AutoWeightsLoader

from flashnext.serving.hooks.mtp import draft_lm_head, draft_takes_embedding_branch
from flashnext.serving.hooks.pipeline import on_first_rank, on_last_rank

rank, port = int(sys.argv[1]), sys.argv[2]
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(world_size=2, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=rank, backend="gloo")
    initialize_model_parallel(1, 2)

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = on_first_rank(lambda: VocabParallelEmbedding(64, 16))

    class CausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()
            self.lm_head = on_last_rank(lambda: ParallelLMHead(64, 16))

    class Draft(nn.Module):  # the MTP head's own lm_head, as Qwen4ExpMTP builds it on the last rank
        def __init__(self):
            super().__init__()
            self.lm_head = draft_lm_head(lambda: ParallelLMHead(64, 16))

    lm, draft = CausalLM(), Draft()
    checkpoint = {"model.embed_tokens.weight": torch.randn(64, 16), "lm_head.weight": torch.randn(64, 16)}
    loaded = AutoWeightsLoader(lm).load_weights(checkpoint.items())
    draft_loaded = AutoWeightsLoader(draft).load_weights([("lm_head.weight", checkpoint["lm_head.weight"])])
    print(json.dumps({"rank": rank, "embed_tokens": type(lm.model.embed_tokens).__name__,
                      "lm_head": type(lm.lm_head).__name__, "loaded": sorted(loaded),
                      "parameters": sum(p.numel() for p in lm.parameters()),
                      "draft_lm_head": type(draft.lm_head).__name__, "draft_loaded": sorted(draft_loaded),
                      "draft_embeds": draft_takes_embedding_branch()}))
