"""Start and serve vLLM 0.34.0's own Model Runner V2 for the demo checkpoint on the CPU with the
patched tree and its PLE table served as vLLM serves it without a table file: engram ``cpu_offload``
(a profile's default without ``--ple-table``), the whole table in pinned host memory allocated by
``Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight``, which patch host-pool sends to
flashnext's exact-size pool (``pinned_empty``); each step's rows read from it by vLLM's own lookup
kernel on a side stream (``start_prefetch``, ``finalize_prefetch``). Records what flashnext's code
allocates at each step (support/allocations.py) and the pinned pools it holds
(``runtime/host_pool._POOLS``); prints JSON. Run by tests/serving/test_engine_ledger_ple_pinned.py:
``python engine_ledger_ple_pinned_scenario.py SNAPSHOT PORT MAX_NUM_BATCHED_TOKENS MAX_NUM_SEQS``.

Start-up and serving as in engine_ledger_ple_scenario.py (the file's): the model built by vLLM's
``initialize_model`` and its PLE tensors loaded by its ``load_weights``, vLLM's post-load step,
``GPUModelRunner.load_model``; vLLM's profile run (``GPUModelRunner.profile_run``); the KV cache
planned as the engine core plans it and ``initialize_kv_cache``; steps vLLM's ``Scheduler`` makes
(two prompts, their decodes, a long prompt in chunks beside them), each through ``execute_model``'s
bookkeeping and the model state's ``prepare_inputs``, then the model's forward, of which the PLE
layer runs: its lookup started as the model's forward starts it (``start_prefetch``, the preceding
decoder layer's turn), then its own forward (``finalize_prefetch``).

Stood in for, because this machine has no CUDA driver: the page-locking of the pool
(``cudaHostRegister``: the pool's mapping and its bytes are real, not locked); vLLM's UVA check and
view of the pinned table (``is_uva_available``, ``get_accelerator_view_from_cpu_tensor``: the table
itself, which vLLM's lookup kernel reads in place under Triton's interpreter, handed its table and
output as the bytes its signature declares, which the interpreter does not apply); CUDA streams,
events, ``torch.accelerator.synchronize`` and whether a stream is capturing; the runner's own UVA
buffers (vLLM's explicit-copy fallback); the model's forward but for its PLE layer (every other
weight of the demo is INT4/INT6 with no CPU kernel); the sampler (each request samples token 7 + the
step); the KV memory, 64 MiB. The requests are text only.
"""
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

import vllm.v1.worker.gpu.buffer_utils as buffer_utils

import support.no_cuda

buffer_utils.is_uva_available = lambda: False  # the runner's buffers: pinning needs the CUDA driver
support.no_cuda.install()

import vllm.models.qwen4_exp.common.ngram_embedding as ngram_embedding  # noqa: E402
from vllm.config import CacheConfig  # noqa: E402

import flashnext.quant  # noqa: E402
import flashnext.serving  # noqa: E402
from flashnext.serving.runtime import host_pool  # noqa: E402
from support import SUPPORT_DIR  # noqa: E402
from support.allocations import Allocations  # noqa: E402
from support.vllm_demo import (demo_vllm, execute_model_up_to_the_forward, initialize_runner_kv_cache,  # noqa: E402
                               prefix_caching_scheduler, read_tensors, sample_stand_in)


class CudaRuntime:
    """cudaHostRegister and cudaHostUnregister, stood in for: they succeed and lock nothing."""

    @staticmethod
    def cudaHostRegister(pointer, nbytes, flags):
        return 0

    @staticmethod
    def cudaHostUnregister(pointer):
        return 0


host_pool._cuda_runtime = lambda: CudaRuntime
torch.cuda.is_current_stream_capturing = lambda: False  # no stream captures here: there is no CUDA
ngram_embedding.is_uva_available = lambda: True
ngram_embedding.get_accelerator_view_from_cpu_tensor = lambda tensor: tensor


class BytePointers:
    """vLLM's pinned lookup kernel, launched with its tables and output as the bytes its signature
    declares (``tl.pointer_type(tl.uint8)``): compiled, the annotation makes them bytes; Triton's
    interpreter ignores it and would step through bf16 elements, writing past the output."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda weight, ids, output, *args, **kwargs: launch(weight.view(torch.uint8), ids,
                                                                   output.view(torch.uint8), *args, **kwargs)


ngram_embedding._lookup_ple_embedding_from_pinned_kernel = BytePointers(
    ngram_embedding._lookup_ple_embedding_from_pinned_kernel)

snapshot, port = sys.argv[1], sys.argv[2]
batched_tokens, max_seqs = int(sys.argv[3]), int(sys.argv[4])
CPU = torch.device("cpu")
LONG_PROMPT = 1_300  # tokens: three chunks of the step budget


def drop_quantization(config):
    config.__dict__.pop("quantization_config", None)
    return config


def pooled() -> int:
    """The bytes of flashnext's exact-size pinned pools this process holds."""
    return sum(pool.nbytes for pool in host_pool._POOLS)


code = [Path(package.__file__).resolve().parent for package in (flashnext.serving, flashnext.quant)]
recorder = Allocations(code, code[0].parent, stand_ins=(SUPPORT_DIR,))
steps = []
out = {"steps": steps}


@contextmanager
def recorded(name: str, phase: str):
    with recorder.step(name) as step:
        yield
    steps.append({**step.to_json(), "phase": phase, "pooled": pooled()})


with demo_vllm(snapshot, port, drop_quantization, CacheConfig(mamba_cache_mode="align", enable_prefix_caching=True),
               text_only=True, scheduler={"max_num_seqs": max_seqs, "max_num_batched_tokens": batched_tokens}) \
        as (config, _), recorder:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    config.engram_config.cpu_offload = True  # vLLM's default, which demo_vllm turns off for the other scenarios
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
    table = ple.ngram_embedding
    out["backend"] = type(table).__name__
    out["table_bytes"] = table.weight.numel() * table.weight.element_size()
    out["table_in_a_pool"] = any(pool.tensor is not None and pool.tensor.data_ptr() == table.weight.data_ptr()
                                 for pool in host_pool._POOLS)
    out["pools"] = [pool.nbytes for pool in host_pool._POOLS]
    reference = table.weight.clone()  # what the load wrote, to hold the serve to
    hidden_size = config.model_config.hf_text_config.hidden_size

    def forward(input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **inputs):
        """The model's forward, stood in for: its PLE layer's lookup started as the model starts it
        (at the preceding decoder layer), then the layer on what the model state prepared."""
        with torch.no_grad():
            ple.start_prefetch(input_ids, inputs["query_start_loc"], inputs["ngram_context"])
            ple(None, input_ids, inputs["query_start_loc"], inputs["ngram_context"])
        return torch.zeros(positions.shape[-1], hidden_size, dtype=torch.bfloat16)

    model.forward = forward
    model.__class__.__call__ = lambda self, *args, **kwargs: self.forward(*args, **kwargs)
    with recorded("profile run", "start-up"):
        runner.profile_run()
    buffer = table._prefetch_buffer
    out["prefetch_buffer_bytes"] = buffer.numel() * buffer.element_size() if buffer is not None else 0

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
    out["prefetch_buffer_kept"] = table._prefetch_buffer is buffer
    out["table_unchanged"] = bool(torch.equal(table.weight, reference))
    host_pool.release(table.weight)  # while the runtime's stand-in is there to unregister it
print(json.dumps(out))
