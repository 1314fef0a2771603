"""Start and serve vLLM 0.34.0's own Model Runner V2 for the demo checkpoint on the CPU with the
patched tree and its PLE table served from the file ``flashnext ple build`` writes (patches
ple-mmap, decode-06, ttft-01: ``VLLM_PLE_MMAP_PATH``), recording what flashnext's code allocates
at each step (support/allocations.py); prints JSON. Run by tests/serving/test_engine_ledger.py:
``python engine_ledger_ple_scenario.py SNAPSHOT PORT MAX_NUM_BATCHED_TOKENS MAX_NUM_SEQS``.

Start-up, vLLM's own code in the engine's order: the model vLLM's registry resolves built by
``initialize_model`` and its PLE tensors loaded by its ``load_weights``, then ``GPUModelRunner``
made and handed it (``load_model``: the model state, flashnext's); vLLM's profile run
(``GPUModelRunner.profile_run``: ``_dummy_run`` of MAX_NUM_BATCHED_TOKENS through
``execute_model``, whose model state's ``prepare_inputs`` stages the dummy batch's PLE rows, then
the dummy sampler run); the KV cache planned as the engine core plans it and
``GPUModelRunner.initialize_kv_cache``. Serving: vLLM's ``Scheduler`` (prefix caching, chunked
prefill, mamba "align" mode) over three requests, a long prompt in MAX_NUM_BATCHED_TOKENS chunks
and decodes beside it; each step runs ``execute_model``'s own bookkeeping and input preparation and
the model state's ``prepare_inputs`` (where ple-mmap hashes the step's row ids, advises their
pages and stages the rows), then the PLE layer's forward on what it prepared.

Stood in for, as in ple_model_state_scenario.py, because they cannot run here: CUDA streams,
events and ``torch.accelerator.synchronize`` (objects and calls that do nothing); UVA buffers (vLLM's explicit-copy fallback); the model's
forward, of which only the PLE layer runs (every other weight of the demo is INT4/INT6 with no CPU
kernel and its QSA indexer and MoE kernels are CUDA-only: the quantization config is dropped and
only the PLE tensors are loaded) and which returns zeros for the rest; the sampler (each request
samples token 7 + the step); the KV memory, 64 MiB. The requests are text only.
"""
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

import vllm.v1.worker.gpu.buffer_utils as buffer_utils

import support.no_cuda

buffer_utils.is_uva_available = lambda: False  # pinning needs the CUDA driver this machine lacks
support.no_cuda.install()

from vllm.config import CacheConfig  # noqa: E402

import flashnext.quant  # noqa: E402
import flashnext.serving  # noqa: E402
from support import SUPPORT_DIR  # noqa: E402
from support.allocations import Allocations  # noqa: E402
from support.vllm_demo import (demo_vllm, execute_model_up_to_the_forward, initialize_runner_kv_cache,  # noqa: E402
                               prefix_caching_scheduler, read_tensors, sample_stand_in)

snapshot, port = sys.argv[1], sys.argv[2]
batched_tokens, max_seqs = int(sys.argv[3]), int(sys.argv[4])
CPU = torch.device("cpu")
LONG_PROMPT = 1_300  # tokens: three chunks of the step budget


def drop_quantization(config):
    config.__dict__.pop("quantization_config", None)
    return config


code = [Path(package.__file__).resolve().parent for package in (flashnext.serving, flashnext.quant)]
recorder = Allocations(code, code[0].parent, stand_ins=(SUPPORT_DIR,))
steps = []
out = {"steps": steps}


@contextmanager
def recorded(name: str, phase: str):
    with recorder.step(name) as step:
        yield
    steps.append({**step.to_json(), "phase": phase})


with demo_vllm(snapshot, port, drop_quantization, CacheConfig(mamba_cache_mode="align", enable_prefix_caching=True),
               text_only=True, scheduler={"max_num_seqs": max_seqs, "max_num_batched_tokens": batched_tokens}) \
        as (config, _), recorder:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    with recorded("load", "start-up"):
        model = initialize_model(vllm_config=config)
        model.load_weights(iter(read_tensors(snapshot, lambda n: ".ple.ple_embedding." in n).items()))
        for module in model.modules():
            # The CPU's packed bf16 GEMM needs vllm._C, which this CUDA build of vLLM cannot load
            # without libcuda; vLLM's own flag for a layer that skips it gives torch's F.linear.
            module._cpu_skip_gemm_dispatch = True
            if isinstance(module, RoutedExperts):  # no CPU MoE kernel in this build: nothing to prepare
                module.quant_method.process_weights_after_loading = lambda layer: None
        process_weights_after_loading(model, config.model_config, CPU)  # as vLLM's loader ends the load
        runner = GPUModelRunner(config, CPU)
        runner.load_model(model=model)
    state = runner.model_state
    ple = next(m for m in model.modules() if isinstance(m, Qwen4ExpNGramEmbedding))
    out["backend"] = type(ple.ngram_embedding).__name__
    staged = ple.ngram_embedding.staged_rows
    out["staged_rows_bytes"] = staged.numel() * staged.element_size()
    hidden_size = config.model_config.hf_text_config.hidden_size

    def forward(input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **inputs):
        """The model's forward, stood in for: its PLE layer on what the model state prepared."""
        with torch.no_grad():
            ple(None, input_ids, inputs["query_start_loc"], inputs["ngram_context"])
        return torch.zeros(positions.shape[-1], hidden_size, dtype=torch.bfloat16)

    model.forward = forward
    model.__class__.__call__ = lambda self, *args, **kwargs: self.forward(*args, **kwargs)
    with recorded("profile run", "start-up"):
        runner.profile_run()
    staging = ple.ngram_embedding._staging
    out["host_staging_bytes"] = staging.numel() * staging.element_size() if staging is not None else 0

    # EngineCore._initialize_kv_caches: the plan, the block sizes, the runner's KV cache
    with recorded("KV cache", "start-up"):
        kv = initialize_runner_kv_cache(config, runner, 64 << 20)
    scheduler, block_hasher = prefix_caching_scheduler(config, *kv)

    vocab = config.model_config.hf_text_config.vocab_size
    rng = np.random.default_rng(0)

    def admit(req_id, length, max_tokens):
        scheduler.add_request(Request(req_id, rng.integers(0, vocab, length).tolist(),
                                      SamplingParams(max_tokens=max_tokens), None, block_hasher=block_hasher))

    admit("a", 40, 8)
    admit("b", 24, 8)
    for step in range(8):
        if step == 2:  # "a" and "b" decoding: a long prompt arrives, prefilled in chunks beside them
            admit("long", LONG_PROMPT, 2)
        so = scheduler.schedule()
        name = " ".join(f"{r}+{n}" for r, n in sorted(so.num_scheduled_tokens.items()))
        with recorded(f"step {step}: {name}", "serving"):
            batch = execute_model_up_to_the_forward(runner, so)  # GPUModelRunner.execute_model, to the forward
            inputs = state.prepare_inputs(batch, runner.req_states)
            forward(**{"input_ids": batch.input_ids, "positions": batch.positions, **inputs})  # as execute_model
        steps[-1]["tokens"] = int(batch.num_tokens)
        steps[-1]["decodes"] = int(sum(not p for p in batch.is_prefilling_np[:batch.num_reqs]))
        sample_stand_in(runner, scheduler, so, batch, 7 + step)  # the sampler (stand-in): token 7 + the step
    out["staging_kept"] = ple.ngram_embedding._staging is staging
print(json.dumps(out))
