"""Serve structured-output requests with MTP drafts through vLLM 0.34.0's own engine classes on the
CPU, with the patched tree (the 3x3090-mtp profile's switches), as one rank of a pipeline of WORLD
gloo ranks, recording what flashnext's code allocates and which Triton variants launch; prints
JSON. Run by tests/serving/test_engine_ledger_mtp.py: ``python engine_ledger_mtp_scenario.py RANK
PORT WORLD SNAPSHOT MODEL_DIR KV_BYTES MAX_NUM_BATCHED_TOKENS MAX_NUM_SEQS CAPTURE_SIZES``
(MODEL_DIR: where rank 0 links the demo checkpoint with a word-level tokenizer beside it;
CAPTURE_SIZES comma-separated, the profile's).

Start-up, vLLM's own code in the engine's order: the target built by ``initialize_model`` (its
INT8 ``embed_tokens`` loaded by its own ``load_weights``) and vLLM's post-load step;
``GPUModelRunner`` made and handed it (``load_model``: on the last rank the MTP speculator's
``load_eagle_model`` builds and loads the draft with vLLM's default loader, mtp-01 and mtp-02
choosing its embedding and LM head, decode-05 merging its router rows, qsa-offload taking its QSA
layer); vLLM's profile run (``profile_run``: a dummy step of the budget, the draft's dummy
proposal and the dummy sampler run); the KV cache planned as ``EngineCore._initialize_kv_caches``
plans it (every rank's specs gathered over the pipeline group) and
``GPUModelRunner.initialize_kv_cache`` (qsa-offload binds its host rows and warms its kernels);
vLLM's kernel warm-up (``warmup_kernels``' greedy round: its prefill with a grammar bitmask and its
decode steps with and without drafts, through the worker's ``execute_model`` and
``sample_tokens``), then the CUDA-graph capture, stood in for. Serving: vLLM's ``EngineCore``
step with its batch queue (``step_with_batch_queue``), ``AsyncScheduler`` (async scheduling, the
rig's CUDA default), ``StructuredOutputManager`` (xgrammar) and ``UniProcExecutor`` over the
worker: short structured requests arriving two a step until MAX_NUM_SEQS decode at once (each
with its draft: up to 2 x MAX_NUM_SEQS rows), then, once one has finished, a long structured prompt
over four arena windows, its first chunk beside the others' decodes. Each step's ``sample_tokens`` runs vLLM's
sampler with the grammar bitmask (``StructuredOutputsWorker.apply_grammar_bitmask``), its
rejection sampler over the drafts, and the MTP speculator's ``propose``: the draft's forward over
the step (flashnext's INT8 embedding, the draft's QSA layer through qsa-offload, its MoE block
through decode-05 at 1..4 tokens), its logits through the target's LM head.

Recorded (support/allocations.py, support/triton_launches.py): each step's allocations whose call
stack passes through flashnext's code (not through a stand-in in this folder), with site and
bytes, whether each outlived its step, each site's peak within the step; every Triton launch's
cache key for an RTX 3090, by phase.

Stood in for, because they cannot run here: CUDA streams and events (support/no_cuda.py) and UVA
buffers (vLLM's explicit-copy fallback); the target's forward (every target weight but the
embedding is INT4/INT6 with no CPU kernel here: it returns seeded hidden states, the multi-stream
ones the drafter reads included, and its LM head holds seeded bf16 weights); the QSA indexer and
the reshape_and_cache_flash op (CUDA-only: support/vllm_demo.py); the routed experts' kernel and
their post-load step (no CPU MoE kernel in this build: support/moe_experts_stand_in.py), and the
CPU GEMM's weight pre-packing (needs vLLM's compiled CPU ops); the kernels of the model's layers
(vLLM's hyper-connection and QSA ops, flashnext's row cache: recorded and not run, as in
engine_ledger_scenario.py: the interpreter takes seconds a row; their outputs are left as
allocated); the CUDA-graph capture, by vLLM's own dummy run of each uniform decode size the
target's and the draft's graphs hold (``_dummy_run(uniform_decode=True)``, eager); the worker
process around the runner (its ``execute_model``, ``sample_tokens`` and
``take_draft_token_ids``, called in the engine's process as ``UniProcExecutor`` calls them). At
PP=2 the first rank builds, profiles and plans its KV cache with the last, then leaves: the last
rank serves with the first rank's hidden states stood in (seeded) and without broadcasting its
sampled tokens and drafts back (``pp_handler``, whose peer has left). vLLM's warm-up runs its
greedy round only: its other round's top-k/top-p kernel does not run under Triton's interpreter
(the serve's requests are greedy).
"""
import gc
import json
import queue
import sys
import time
from collections import Counter, deque
from contextlib import ExitStack, contextmanager
from pathlib import Path

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
from support.moe_experts_stand_in import stand_in_experts_kernel  # noqa: E402
from support.triton_launches import Launches  # noqa: E402
from support.vllm_demo import (  # noqa: E402
    a_3090, demo_vllm, initialize_runner_kv_cache, read_tensors, stand_in_cache_writer, stand_in_qsa_indexer,
    with_word_tokenizer,
)

rank, port, world, snapshot, model_dir = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
kv_bytes, batched_tokens, max_seqs = map(int, sys.argv[6:9])
capture_sizes = [int(n) for n in sys.argv[9].split(",")]
CPU = torch.device("cpu")
LONG_PROMPT = 1_700  # tokens: four blocks of the demo's 560 with MTP, a window each in its one-block arena
SHORT_PROMPT = 24
MAX_TOKENS = 8  # a short request's; the long prompt's request asks for LONG_TOKENS
LONG_TOKENS = 4
VOCAB = {"<eos>": 0, "<unk>": 1, "a": 2, "b": 3, "x": 4}  # the word-level tokenizer beside the demo


def grammar(pair: str, tokens: int) -> str:
    """A regex over the tokenizer's "a" and "b" (``pair`` repeated) that ends where ``max_tokens``
    does: the demo's EOS id is not the tokenizer's, so a grammar that may end early would let the
    request run on past its end unconstrained."""
    return f"({pair}){{{tokens // 2}}}"


def embedding_int8_only(config):
    """``hf_overrides``: of the quantization config, only the INT8 group-128 scheme, narrowed to the
    embedding (the CPU has no kernel for the INT4 experts and INT6 layers; the LM head is left to
    vLLM's own bf16 layer, as a 3090 serves it through vLLM's own INT8 kernel, which the CPU lacks).
    The draft head is kept BF16 by the checkpoint's ``ignore``, as in the release."""
    qc = getattr(config, "quantization_config", None)
    if qc is not None:
        groups = {k: g for k, g in qc["config_groups"].items() if "lm_head" in g["targets"]}
        for g in groups.values():
            g["targets"] = [r"re:.*embed_tokens$"]
        qc["config_groups"] = groups
    return config


# Kernels recorded and not run besides the model's layers': the stand-in KV writer (vLLM's Triton twin
# of a CUDA op) and vLLM's copies of the GDN layers' recurrent states between blocks (prefix caching's
# "align" mode), whose layers are the target's, stood in for
NOT_RUN = frozenset({"reshape_and_cache_kernel_flash", "precopy_mamba_align_fused_kernel",
                     "postprocess_mamba_fused_kernel"})

code = [Path(package.__file__).resolve().parent for package in (flashnext.serving, flashnext.quant)]
recorder = Allocations(code, code[0].parent, stand_ins=(SUPPORT_DIR,))


class NotRun(frozenset):
    """The kernels Launches runs: every one but these (a set's complement)."""

    def __contains__(self, name) -> bool:
        return not super().__contains__(name)


def kernel_names(*modules) -> set[str]:
    from triton.runtime.interpreter import InterpretedFunction

    return {obj.fn.__qualname__ for m in modules for obj in vars(m).values() if isinstance(obj, InterpretedFunction)}


steps = []
out = {"rank": rank, "steps": steps}
if rank == 0:
    with_word_tokenizer(snapshot, model_dir, VOCAB)
else:
    while not (Path(model_dir) / "tokenizer.json").exists():
        time.sleep(0.1)

with demo_vllm(model_dir, port, embedding_int8_only, CacheConfig(mamba_cache_mode="align", enable_prefix_caching=True),
               mtp=True, text_only=True, structured_outputs="xgrammar", async_scheduling=True,
               scheduler={"max_num_seqs": max_seqs, "max_num_batched_tokens": batched_tokens},
               rank=rank, world=world) as (config, qsa):
    import vllm.models.qwen4_exp.nvidia.ops.hc as hc_ops
    import vllm.models.qwen4_exp.nvidia.ops.qsa as qsa_ops
    import vllm.model_executor.layers.utils as layer_utils
    from vllm.distributed import get_pp_group
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.sequence import IntermediateTensors
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.warmup import _fixed_draft_counts, _warmup_kernels

    import flashnext.quant.kernels.qsa_row_cache as row_cache

    last = get_pp_group().is_last_rank
    first = get_pp_group().is_first_rank
    launches = Launches(run=NotRun(kernel_names(hc_ops, qsa_ops, row_cache) | NOT_RUN))

    @contextmanager
    def recorded(name: str, phase: str, **facts):
        """A step's flashnext allocations and its Triton launches (their keys, and how many of each kernel)."""
        begin, started = len(launches.keys), time.monotonic()
        with recorder.step(name) as step:
            yield
        keys = launches.keys[begin:]
        steps.append({**step.to_json(), "phase": phase, **facts, "seconds": round(time.monotonic() - started, 2),
                      "keys": sorted({json.dumps([k, repr(spec), options]) for k, spec, options in keys}),
                      "launches": dict(Counter(k for k, _, _ in keys))})

    # the CPU GEMM's and MoE's weight pre-packing need vLLM's compiled CPU ops (a CUDA run has neither step)
    layer_utils.dispatch_cpu_unquantized_gemm = lambda layer, remove_weight: setattr(
        layer, "cpu_linear", torch.nn.functional.linear)
    CPUUnquantizedExperts.process_weights_after_loading = lambda self, layer: None

    with recorder, launches.recording(), a_3090():
        with recorded("load", "start-up"):
            model = initialize_model(vllm_config=config)
            if first:
                model.load_weights(iter(read_tensors(snapshot, lambda n: ".embed_tokens." in n).items()))
            for module in model.modules():
                # vLLM's own flag for a layer that skips the CPU's packed GEMM, which needs vllm._C
                module._cpu_skip_gemm_dispatch = True
                if isinstance(module, RoutedExperts):
                    module.quant_method.process_weights_after_loading = lambda layer: None
            process_weights_after_loading(model, config.model_config, CPU)  # as vLLM's loader ends the load
            runner = GPUModelRunner(config, CPU)
            runner.load_model(model=model)
        # The objects start-up made so far, out of the collector's way: the collection that ends each
        # recorded step then walks only what came after (EngineCore.__init__ freezes them at its end)
        gc.freeze()
        draft = runner.get_draft_model()
        text = model.language_model
        hidden_size = config.model_config.hf_text_config.hidden_size
        hc_hidden = config.model_config.hf_text_config.hc_count * hidden_size
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            if last:  # the target's LM head, which the draft shares: seeded (its INT8 words have no CPU kernel)
                text.lm_head.weight.copy_(torch.randn(text.lm_head.weight.shape, generator=g) * 0.05)
        layers = [m for m in model.modules() if isinstance(m, qsa.Qwen4ExpQSAAttention)]
        draft_layers = [m for m in draft.modules() if isinstance(m, qsa.Qwen4ExpQSAAttention)] if draft else []
        for layer in layers + draft_layers:
            stand_in_qsa_indexer(layer, g)
        stand_in_cache_writer(qsa)
        if draft is not None:
            for module in draft.modules():
                if isinstance(module, RoutedExperts):
                    stand_in_experts_kernel(module)
            embed = draft.model.embed_tokens
            out["draft_embedding"] = {"shared": embed is getattr(text.model, "embed_tokens", None),
                                      "method": type(getattr(embed, "quant_method", None)).__name__,
                                      "lm_head_shared": draft.lm_head is text.lm_head}
        out["qsa_layers"], out["draft_qsa_layers"] = len(layers), len(draft_layers)
        out["moe_blocks"] = sum(type(m).__name__ == "Qwen4ExpSparseMoeBlock" for m in model.modules()) + (
            sum(type(m).__name__ == "Qwen4ExpSparseMoeBlock" for m in draft.modules()) if draft else 0)

        def forward(input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **inputs):
            """The target's forward, stood in for: seeded hidden states, the multi-stream ones the
            drafter reads (``get_mtp_target_hidden_states``) written where the model writes them."""
            tokens = positions.shape[-1]
            if not last:
                hidden = torch.randn(tokens, hc_hidden, generator=g).to(torch.bfloat16)
                return IntermediateTensors({"hidden_states": hidden})
            text.model._mtp_hidden_buffer[:tokens].copy_(torch.randn(tokens, hc_hidden, generator=g))
            return torch.randn(tokens, hidden_size, generator=g).to(torch.bfloat16)

        model.forward = forward
        model.__class__.__call__ = lambda self, *args, **kwargs: self.forward(*args, **kwargs)

        with recorded("profile run", "start-up"):
            runner.profile_run()
        with recorded("KV cache", "start-up"):
            kv = initialize_runner_kv_cache(config, runner, kv_bytes)
        out["num_blocks"], out["block_size"] = kv[0].num_blocks, kv[1]
        host_rows = [l.qsa_offload.host_kv for l in layers + draft_layers if getattr(l, "qsa_offload", None)]
        out["host_rows_bytes"] = sum(h.numel() * h.element_size() for h in host_rows)
        arena = flashnext.serving.runtime.qsa_offload.ARENA.cache
        out["arena_bytes"] = arena.nbytes if arena is not None else 0
        if not last:  # the first rank has no part of the MTP path: start-up only, then it leaves
            print(json.dumps(out))
            sys.exit(0)
        runner.pp_handler = None  # its peer, the first rank, has left (see the docstring)

        class Worker:
            """The GPU worker's calls as vLLM's ``Worker`` makes them for this rank
            (``execute_model``, ``sample_tokens``, ``take_draft_token_ids``); each pair of
            ``execute_model`` and ``sample_tokens`` recorded as one step of ``phase``."""

            def __init__(self):
                self.phase, self.count, self._open = "start-up", 0, None

            def execute_model(self, so):
                tokens = so.total_num_scheduled_tokens
                drafts = sum(len(d) > 0 for d in so.scheduled_spec_decode_tokens.values())
                name = f"{self.phase} step {self.count}: {len(so.num_scheduled_tokens)} requests, {tokens} tokens" + (
                    f", {drafts} with a draft" if drafts else "")
                self.count += 1
                self._open = ExitStack()
                self._open.enter_context(torch.inference_mode())
                self._open.enter_context(recorded(name, self.phase, tokens=tokens, drafts=drafts,
                                                  requests=len(so.num_scheduled_tokens)))
                intermediate = None
                if not first and tokens:  # the first rank's hidden states, stood in for
                    intermediate = IntermediateTensors(
                        {"hidden_states": torch.randn(tokens, hc_hidden, generator=g).to(torch.bfloat16)})
                output = runner.execute_model(so, intermediate)
                if output is not None or not tokens:
                    self._close({})
                return output

            def sample_tokens(self, grammar_output):
                rows = 0 if grammar_output is None else int(grammar_output.grammar_bitmask.shape[0])
                facts = {"structured_rows": rows}  # the grammar bitmask's: a structured request's positions
                try:
                    return runner.sample_tokens(grammar_output)
                finally:
                    self._close(facts)

            def _close(self, facts):
                stack, self._open = self._open, None
                stack.close()
                steps[-1].update(facts)

            def take_draft_token_ids(self):
                return runner.take_draft_token_ids()

        worker = Worker()
        with torch.inference_mode(), _fixed_draft_counts(runner):
            # vLLM's kernel warm-up (warmup_kernels), its greedy round: the serve's requests are greedy,
            # and the other round's top-k/top-p kernel does not run under Triton's interpreter
            _warmup_kernels(runner, worker.execute_model, worker.sample_tokens, greedy=True)
        # The CUDA-graph capture, stood in for: vLLM's dummy run of each uniform decode size its
        # graphs hold (the target's decode graphs and the draft's prefill on them), eager
        sizes = [s for s in capture_sizes if s % runner.decode_query_len == 0]
        out["capture_sizes"] = sizes
        for size in sizes:
            with recorded(f"capture {size}", "start-up"), torch.inference_mode():
                runner._dummy_run(size, uniform_decode=True)

        out["startup_keys"] = sorted({json.dumps([k, repr(spec), options]) for k, spec, options in launches.keys})
        # Serving through vLLM's own engine core
        from vllm.sampling_params import SamplingParams, StructuredOutputsParams
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.executor.uniproc_executor import UniProcExecutor
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager

        scheduler_kv_config, block_size, hash_block_size = kv
        # vLLM's CPU platform turns async scheduling off again in every config derived from this one
        # (the draft's shares its scheduler config); the rig's CUDA platform leaves it on
        config.scheduler_config.async_scheduling = True
        manager = StructuredOutputManager(config)
        core = EngineCore.__new__(EngineCore)  # its __init__ starts workers and profiles the model
        core.vllm_config, core.log_stats, core._weight_version = config, False, "default"
        core.structured_output_manager = manager
        core.scheduler = config.scheduler_config.get_scheduler_cls()(
            vllm_config=config, kv_cache_config=scheduler_kv_config, structured_output_manager=manager,
            block_size=block_size, hash_block_size=hash_block_size, log_stats=False)
        core.model_executor = UniProcExecutor.__new__(UniProcExecutor)  # its __init__ starts a worker
        core.model_executor.driver_worker = worker
        core.batch_queue_size = config.max_concurrent_batches
        core.batch_queue = deque(maxlen=core.batch_queue_size)
        core.is_mm_encoder_only = core.is_pooling_model = False
        core.check_for_draft_tokens = core.async_scheduling = True
        core.aborts_queue = queue.Queue()
        out["scheduler"] = type(core.scheduler).__name__
        out["batch_queue_size"] = core.batch_queue_size
        worker.phase, worker.count = "serving", 0

        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        block_hasher = get_request_block_hasher(hash_block_size, hash_fn, config.num_hash_lookahead_tokens)
        vocab = config.model_config.hf_text_config.vocab_size
        prompts = torch.Generator().manual_seed(1)

        def admit(req_id: str, length: int, pair: str, tokens: int) -> None:
            params = SamplingParams(max_tokens=tokens, temperature=0.0,
                                    structured_outputs=StructuredOutputsParams(regex=grammar(pair, tokens)))
            # what the frontend's InputProcessor and EngineCore.preprocess_add_request do
            params.verify(config.model_config, config.speculative_config, config.structured_outputs_config,
                          manager.tokenizer)
            request = Request.from_engine_core_request(EngineCoreRequest(
                request_id=req_id, prompt_token_ids=torch.randint(5, vocab, (length,), generator=prompts).tolist(),
                mm_features=None, sampling_params=params, pooling_params=None, arrival_time=time.time(),
                lora_request=None, cache_salt=None, data_parallel_rank=None), block_hasher)
            manager.grammar_init(request)
            while not request.structured_output_request.is_grammar_ready:  # compiled before it reaches the engine
                time.sleep(0.01)
            core.add_request(request)

        texts, finished = {}, {}
        arrivals = [(str(i), SHORT_PROMPT, ("ab", "ba")[i % 2], MAX_TOKENS) for i in range(max_seqs)]
        long_admitted = False
        for _ in range(400):
            if arrivals:  # two arrivals a step, until all are in
                for _ in range(min(2, len(arrivals))):
                    admit(*arrivals.pop(0))
            elif not long_admitted and finished:  # a slot is free: the long prompt, beside the others' decodes
                admit("long", LONG_PROMPT, "ab", LONG_TOKENS)
                long_admitted = True
            outputs, _ = core.step_with_batch_queue()
            for engine_outputs in (outputs or {}).values():
                for o in engine_outputs.outputs:
                    texts.setdefault(o.request_id, []).extend(o.new_token_ids)
                    if o.finish_reason is not None:
                        finished[o.request_id] = str(o.finish_reason)
            if long_admitted and not core.scheduler.has_requests() and not core.batch_queue:
                break
        manager.clear_backend()
        out["finished"] = finished
        out["texts"] = texts
print(json.dumps(out))
