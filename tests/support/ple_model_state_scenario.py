"""vLLM 0.34.0's own Model Runner V2 serving the demo checkpoint's PLE layer on the CPU, request by
request, with vLLM's own scheduler; prints what happened at each step as JSON.

``python ple_model_state_scenario.py SNAPSHOT PORT``, run by tests/serving/test_patch_series.py
against the stock tree with flashnext's plugin left out (``VLLM_PLUGINS=""``) and against the
patched tree with ``VLLM_PLE_MMAP_PATH`` (patches ple-mmap, decode-06 and ttft-01).

vLLM's own code, in the engine's order: its general plugins are loaded (flashnext's registers its
``qwen4_exp`` classes), ``initialize_model`` builds the class vLLM's model registry resolves for the
checkpoint, the PLE layer's tensors load through the model's own ``load_weights``, and
``GPUModelRunner`` is made, handed the model (``load_model``, which makes the model state by
``init_model_state``) and its KV cache (``initialize_kv_cache``, planned as the engine core plans
it). vLLM's ``Scheduler`` (prefix caching, mamba "align" mode, chunked prefill) schedules two
requests, the second sharing the first's prompt; each step runs ``GPUModelRunner.execute_model``'s
own request bookkeeping and input preparation (``finish_requests``, ``add_requests``,
``update_requests``, ``gather_batch_req_state``, ``dispatch_cg_and_sync_dp``, ``prepare_inputs``)
and then the model state's ``prepare_inputs``, as ``execute_model`` calls them.

Stood in for, because they cannot run here: CUDA streams and events (no CUDA runtime: objects that
do nothing); UVA buffers (vLLM's own explicit-copy fallback, as on a platform without UVA); the
model's forward, of which only the PLE layer runs (its ``forward``, with the inputs the model state
prepared; every other weight of the demo is INT4/INT6 with no CPU kernel, so the quantization config
is dropped and only the PLE tensors are loaded); the sampler: each request samples token 7 + its
step count, which vLLM's own ``postprocess_sampled`` writes into the request states and the
scheduler takes in a ``ModelRunnerOutput``; the KV memory, 64 MiB rather than what the engine's
memory profiling would find. The requests are text only (vLLM's scheduler sizes its multimodal
budget with the processor, which needs a tokenizer, and the demo has none).
"""
import hashlib
import json
import sys

import numpy as np
import torch

import vllm.v1.worker.gpu.buffer_utils as buffer_utils

import support.no_cuda

buffer_utils.is_uva_available = lambda: False  # pinning needs the CUDA driver this machine lacks
support.no_cuda.install()

from vllm.config import CacheConfig  # noqa: E402

from flashnext.errors import FlashnextError  # noqa: E402
from support.vllm_demo import (demo_vllm, execute_model_up_to_the_forward, initialize_runner_kv_cache,  # noqa: E402
                               prefix_caching_scheduler, read_tensors, sample_stand_in)

snapshot, port = sys.argv[1], sys.argv[2]
CPU = torch.device("cpu")


def drop_quantization(config):
    config.__dict__.pop("quantization_config", None)
    return config


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.float().contiguous().numpy().tobytes()).hexdigest()[:16]


out = {"steps": []}
with demo_vllm(snapshot, port, drop_quantization,
               CacheConfig(mamba_cache_mode="align", enable_prefix_caching=True), text_only=True) as (config, _):
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    config.scheduler_config.max_num_seqs = 4
    config.scheduler_config.max_num_batched_tokens = 1024

    # GPUModelRunner.load_model: the model vLLM's registry resolves, then its model state
    try:
        model = initialize_model(vllm_config=config)
    except FlashnextError as refused:  # ple-mmap's layer without flashnext's model state
        print(json.dumps({"refused": str(refused)}))
        sys.exit(0)
    out["model"] = f"{type(model).__module__}.{type(model).__qualname__}"
    model.load_weights(iter(read_tensors(snapshot, lambda n: ".ple.ple_embedding." in n).items()))
    runner = GPUModelRunner(config, CPU)
    runner.load_model(model=model)
    state = runner.model_state
    out["model_state"] = f"{type(state).__module__}.{type(state).__qualname__}"
    ple = next(m for m in model.modules() if isinstance(m, Qwen4ExpNGramEmbedding))
    out["backend"] = type(ple.ngram_embedding).__name__

    # EngineCore._initialize_kv_caches: the plan, the block sizes, the runner's KV cache
    kv = initialize_runner_kv_cache(config, runner, 64 << 20)
    scheduler, block_hasher = prefix_caching_scheduler(config, *kv)

    serving = getattr(state, "ple_file", None)
    copies = []  # the step's copies of the row ids from the device (PleFileServing.ngram_ids)
    advised = []  # the layers the step advised (decode-06)
    staged = []  # the row ids the step staged, one array a PLE layer
    prefetched = []  # the page runs the prompt prefetcher advised (ttft-01), in order
    submitted = {}  # request -> the rows the prompt prefetcher was asked to read ahead
    if serving is not None:
        device_ids, advise, stage = serving.ngram_ids, serving.advise, serving.stage
        serving.ngram_ids = lambda *args: copies.append(1) or device_ids(*args)
        serving.advise = lambda ids: advised.append(advise(ids)) or advised[-1]
        serving.stage = lambda ids: staged.append(ids) or stage(ids)
        (prefetcher,) = serving._prompt_prefetchers()  # the demo has one PLE layer
        advise_ranges, submit = prefetcher.mapping.advise_ranges, prefetcher.submit
        prefetcher.mapping.advise_ranges = lambda ranges: prefetched.append(ranges) or advise_ranges(ranges)

        def submit_recorded(request_id, tokens, context=None):
            submitted[request_id] = prefetcher.hasher.ids(tokens, None, context.reshape(1, -1))
            submit(request_id, tokens, context)

        prefetcher.submit = submit_recorded

    vocab = config.model_config.hf_text_config.vocab_size
    eos = config.model_config.hf_text_config.eos_token_id
    rng = np.random.default_rng(0)
    prompt_a = rng.integers(0, vocab, 1500).tolist()
    prompt_a[700] = eos
    # "b" shares a's first 1,472 tokens: a's prefill chunks are 1,024, 448 and 28 tokens (mamba
    # "align" mode), and a prefix-cache hit lands where a's recurrent state was kept, a chunk's end
    prompt_b = prompt_a[:1472] + rng.integers(0, vocab, 300).tolist()
    prefill_rows = {}  # request -> the rows its prefill steps staged, in order

    def admit(req_id, prompt, max_tokens):
        scheduler.add_request(Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), None,
                                      block_hasher=block_hasher))

    admit("a", prompt_a, 3)
    for step in range(6):
        if step == 3:  # "a" is decoding: "b" arrives, most of its prompt in the prefix cache
            admit("b", prompt_b, 2)
        so = scheduler.schedule()
        record = {"scheduled": dict(so.num_scheduled_tokens),
                  "new": {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs},
                  "finished": sorted(so.finished_req_ids)}
        del copies[:], advised[:], staged[:], prefetched[:]
        batch = execute_model_up_to_the_forward(runner, so)  # GPUModelRunner.execute_model, to the forward
        inputs = state.prepare_inputs(batch, runner.req_states)
        # the forward, of which the PLE layer runs: the embeddings the model would add
        with torch.no_grad():
            embedded = ple(None, batch.input_ids, inputs["query_start_loc"], inputs["ngram_context"])
        record["ple_sha256"] = digest(embedded[:batch.num_tokens])
        if serving is not None:
            record["device_copies"], record["advised_layers"] = len(copies), sum(advised)
            # vLLM's own kernel over vLLM's own batch: what the staged ids must be
            kernel = ple.compute_ngram_ids(batch.input_ids, inputs["query_start_loc"], inputs["ngram_context"])
            (ids,) = staged[0]
            record["ids_are_the_kernels"] = bool(np.array_equal(ids[:batch.num_tokens],
                                                                kernel[:batch.num_tokens].numpy()))
            record["prefill_tokens_kept"] = sorted(serving._prefill_tokens)
            for i, req_id in enumerate(batch.req_ids):
                if batch.is_prefilling_np[i]:
                    rows = ids[batch.query_start_loc_np[i]:batch.query_start_loc_np[i + 1]]
                    prefill_rows.setdefault(req_id, []).append(rows)
            prefetcher.drain()
            record["prefetched_windows"] = len(prefetched)
        sample_stand_in(runner, scheduler, so, batch, 7 + step)  # the sampler (stand-in): token 7 + the step
        out["steps"].append(record)

    if serving is not None:
        out["prefetch_is_what_prefill_read"] = {r: np.array_equal(rows, np.concatenate(prefill_rows[r]))
                                                for r, rows in submitted.items()}
        out["cancelled"] = sorted(prefetcher._cancelled)
        out["weight_is_the_file"] = ple.ngram_embedding.weight.data_ptr() == ple.ngram_embedding.table.mapping.address
print(json.dumps(out))
