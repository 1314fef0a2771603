"""vLLM 0.34.0's own ``qwen4_exp`` model for the demo checkpoint, built on the CPU by the scenario
scripts (run in their own processes against stock and patched vLLM trees).

What cannot exist on the CPU is stood in for, and only that, where each scenario does it (vLLM
0.34.0's QSA no longer asks FlashAttention's availability, which 0.33.0's did at build).
"""
import importlib
import json
import os
from contextlib import contextmanager

import torch
from vllm.config import (
    CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig, StructuredOutputsConfig, VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed import init_distributed_environment, initialize_model_parallel


@contextmanager
def demo_vllm(snapshot: str, port: str, hf_overrides=None, cache_config: CacheConfig | None = None,
              mtp: bool = False, text_only: bool = False, scheduler: dict | None = None, rank: int = 0,
              world: int = 1, max_model_len: int = 4096, structured_outputs: str | None = None,
              async_scheduling: bool = False):
    """A current ``VllmConfig`` for the demo checkpoint as rank ``rank`` of a pipeline of ``world``
    gloo ranks, vLLM's own pipeline groups initialised (``mtp``: with MTP
    speculative decoding, as ``--speculative-config '{"method": "mtp"}'`` sets it; ``text_only``: no
    image or video per prompt, as ``--limit-mm-per-prompt`` sets it, which vLLM's scheduler needs
    here: its multimodal budget needs a tokenizer, and the demo has none; ``scheduler``: the
    ``SchedulerConfig`` fields a profile sets, ``max_num_seqs`` and ``max_num_batched_tokens``;
    ``structured_outputs``: the structured-output backend, which needs the tokenizer ``snapshot``
    holds (see :func:`with_word_tokenizer`; without it the tokenizer is not loaded, the demo has none);
    ``async_scheduling``: on, as vLLM's CUDA platform leaves it by default and its CPU one does not); yields it and
    vLLM's ``qsa`` module (imported after the model module, which it imports back). vLLM's general
    plugins are loaded first, as its engine and workers load them before building a config:
    flashnext's among them unless ``VLLM_PLUGINS`` leaves it out."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    model_config = ModelConfig(model=snapshot, max_model_len=max_model_len,
                               skip_tokenizer_init=structured_outputs is None,
                               dtype="bfloat16", hf_overrides=hf_overrides if hf_overrides is not None else {},
                               limit_mm_per_prompt={"image": 0, "video": 0} if text_only else None)
    parallel = ParallelConfig(pipeline_parallel_size=world)
    speculative = None
    if mtp:
        speculative = SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=model_config,
                                        target_parallel_config=parallel)
    scheduled = {} if scheduler is None else {
        "scheduler_config": SchedulerConfig.default_factory(max_model_len=model_config.max_model_len, **scheduler)}
    if structured_outputs is not None:
        scheduled["structured_outputs_config"] = StructuredOutputsConfig(backend=structured_outputs)
    config = VllmConfig(model_config=model_config, cache_config=cache_config or CacheConfig(),
                        parallel_config=parallel, speculative_config=speculative, **scheduled)
    if async_scheduling:
        config.scheduler_config.async_scheduling = True
    config.engram_config.cpu_offload = False  # the PLE table in (CPU) device memory, not pinned
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=world, rank=rank, distributed_init_method="tcp://127.0.0.1:" + port,
                                     local_rank=rank, backend="gloo")
        initialize_model_parallel(1, world)
        torch.set_default_dtype(torch.bfloat16)
        importlib.import_module("vllm.models.qwen4_exp.nvidia.model")
        yield config, importlib.import_module("vllm.models.qwen4_exp.nvidia.qsa")


def with_word_tokenizer(snapshot: str, model_dir: str, vocab: dict[str, int]) -> None:
    """``model_dir``: the demo checkpoint's files linked, with a word-level tokenizer of ``vocab``
    beside them (structured output compiles its grammar over a tokenizer, and the demo has none)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(model_dir)
    for name in os.listdir(snapshot):
        os.symlink(os.path.join(snapshot, name), os.path.join(model_dir, name))
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", unk_token="<unk>").save_pretrained(model_dir)


def build_model(config):
    """The model class vLLM resolves for the config, built on the CPU; the quantization config gets
    the class's module mappings first, as vLLM's ``initialize_model`` does."""
    from vllm.model_executor.model_loader.utils import configure_quant_config
    from vllm.model_executor.models import ModelRegistry

    model_cls, _ = ModelRegistry.resolve_model_cls(config.model_config.architecture, model_config=config.model_config)
    if config.quant_config is not None:
        configure_quant_config(config.quant_config, model_cls)
    return model_cls(vllm_config=config, prefix="")


def read_tensors(snapshot: str, predicate) -> dict:
    """The snapshot's tensors whose names satisfy ``predicate``, read through its index."""
    from safetensors import safe_open

    index = json.load(open(os.path.join(snapshot, "model.safetensors.index.json")))["weight_map"]
    out = {}
    for name in filter(predicate, index):
        with safe_open(os.path.join(snapshot, index[name]), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def only_int6_shared_experts(config):
    """``hf_overrides``: the quantization config keeps only its INT6 group, narrowed to the shared
    experts (the CPU has no kernel for the other INT6 layers, nor for the INT4 routed experts)."""
    qc = getattr(config, "quantization_config", None)
    if qc is not None:
        groups = {k: g for k, g in qc["config_groups"].items() if g["weights"]["num_bits"] == 6}
        for g in groups.values():
            g["targets"] = [r"re:.*mlp\.shared_expert\.(gate|up|down)_proj$"]
        qc["config_groups"] = groups
    return config


def stand_in_experts_kernel(experts, received: list) -> None:
    """This vLLM build has no CPU MoE kernels (its CPU ops are not compiled in), so the routed
    experts' kernel, and only it, is stood in for by the arithmetic it implements, at the same
    boundary: the quant method's ``apply(layer, x, topk_weights, topk_ids)``. Each call appends what
    vLLM's router gave it, ``(topk_ids, topk_weights)``, to ``received``."""

    def apply(layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        received.append((topk_ids.long().clone(), topk_weights.float().clone()))
        out = torch.zeros(x.shape, dtype=torch.float32)
        for t in range(x.shape[0]):
            for e, w in zip(topk_ids[t].tolist(), topk_weights[t].tolist()):
                gate, up = (x[t].float() @ layer.w13_weight[e].float().T).chunk(2)
                out[t] += w * ((torch.nn.functional.silu(gate) * up) @ layer.w2_weight[e].float().T)
        return out.to(x.dtype)

    experts.quant_method.apply = apply


def finish_layers(root, skip=None) -> None:
    """Run each layer's ``process_weights_after_loading`` under ``root`` as vLLM's loader does
    (``skip``: a module left alone, e.g. experts a stand-in kernel serves).

    The CPU's packed bf16 GEMM needs vllm._C, which this CUDA build of vLLM cannot load without
    libcuda; vLLM's own flag for a layer that skips it gives torch's F.linear (what a CUDA run's
    default_unquantized_gemm calls)."""
    for module in root.modules():
        module._cpu_skip_gemm_dispatch = True
        method = getattr(module, "quant_method", None)
        if method is not None and module is not skip:
            method.process_weights_after_loading(module)


def plan_kv_caches(config, kv_bytes: int):
    """The engine core's KV cache planning, step by step (``EngineCore._initialize_kv_caches``): every
    rank's specs gathered over the pipeline group as the executor collects its workers', then
    grouped and laid out together. ``(this rank's specs, every rank's, the layout, every rank's KV
    cache config, the global groups)``; each rank computes the same."""
    from vllm.distributed import get_pp_group
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    specs = get_kv_cache_spec(config)
    layouts = [layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(config))]
    world = config.parallel_config.pipeline_parallel_size
    everyone, every_layout = [specs], [layouts]
    if world > 1:
        everyone, every_layout = [None] * world, [None] * world
        torch.distributed.all_gather_object(everyone, specs, group=get_pp_group().cpu_group)
        torch.distributed.all_gather_object(every_layout, layouts, group=get_pp_group().cpu_group)
    layout = resolve_kv_cache_layout(config, every_layout, [s for ss in everyone for s in ss.values()])
    groups = get_global_kv_cache_groups(config, everyone)
    return specs, everyone, layout, get_kv_cache_configs(config, everyone, [kv_bytes] * world, groups), groups


def plan_kv_cache(config, kv_bytes: int):
    """:func:`plan_kv_caches` for this rank: ``(its layers' specs, the layout, its KV cache config)``."""
    from vllm.distributed import get_pp_group

    specs, _, layout, configs, _ = plan_kv_caches(config, kv_bytes)
    return specs, layout, configs[get_pp_group().rank_in_group]


def initialize_runner_kv_cache(config, runner, kv_bytes: int):
    """``EngineCore._initialize_kv_caches`` for one Model Runner V2 ``runner``, this rank's of the
    pipeline: the plan (every rank's specs gathered over the pipeline group, as the executor
    collects its workers'), the block sizes and their prefix-cache alignment, the runner's KV cache
    and its zero metadata, as the engine core and the worker do. ``(the scheduler's KV cache
    config, block size, hash block size)``."""
    import importlib

    from vllm.distributed import get_pp_group
    from vllm.platforms.interface import Platform
    from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config, resolve_cache_hit_alignment_tokens,
                                             resolve_kv_cache_block_sizes)
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    qsa = importlib.import_module("vllm.models.qwen4_exp.nvidia.qsa")
    Platform._align_hybrid_block_size(config, qsa.Qwen4ExpQSABackend)
    register_all_kvcache_specs(config)
    _, _, layout, configs, _ = plan_kv_caches(config, kv_bytes)
    config.cache_config.kv_cache_layout = layout.name
    kv_config = configs[get_pp_group().rank_in_group]
    scheduler_kv_config = generate_scheduler_kv_cache_config(configs)
    config.cache_config.num_gpu_blocks = scheduler_kv_config.num_blocks
    config.cache_config.block_size = min(g.kv_cache_spec.block_size for g in scheduler_kv_config.kv_cache_groups
                                         if g.kv_cache_spec.prefix_cacheable)
    block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_kv_config, config)
    alignment = resolve_cache_hit_alignment_tokens(scheduler_kv_config, config, block_size, hash_block_size)
    for c in (kv_config, scheduler_kv_config):
        c.hash_block_size, c.cache_hit_alignment_tokens = hash_block_size, alignment
    runner.initialize_kv_cache(kv_config)
    runner._init_kv_zero_meta()  # as the worker does after initialize_kv_cache
    return scheduler_kv_config, block_size, hash_block_size


def prefix_caching_scheduler(config, scheduler_kv_config, block_size: int, hash_block_size: int):
    """vLLM's own ``Scheduler`` over that KV cache, and the block hasher its requests are made with."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler = Scheduler(config, scheduler_kv_config, StructuredOutputManager(config), block_size=block_size,
                          hash_block_size=hash_block_size)
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return scheduler, get_request_block_hasher(hash_block_size, hash_fn, config.num_hash_lookahead_tokens)


def execute_model_up_to_the_forward(runner, so):
    """Model Runner V2's ``GPUModelRunner.execute_model`` for the scheduler's output ``so``, up to the
    forward: requests finished, freed, added and updated, block tables written, the batch described
    (eager) and prepared. Returns the prepared batch."""
    from vllm.v1.worker.gpu.dp_utils import dispatch_cg_and_sync_dp

    runner.finish_requests(so)
    runner.free_states(so)
    runner.add_requests(so)
    runner.update_requests(so)
    runner.block_tables.apply_staged_writes()
    batch_req_state, uniform = runner.gather_batch_req_state(so, False)
    batch_desc, _ = dispatch_cg_and_sync_dp(
        runner.cudagraph_manager, len(so.num_scheduled_tokens), batch_req_state.num_tokens, uniform,
        runner.dp_size, runner.dp_rank, max_query_len=max(so.num_scheduled_tokens.values()),
        need_eager=False, num_active_loras=0, parallel_config=runner.parallel_config,
        allow_ubatching=False, uniform_decode=uniform == runner.decode_query_len,
        allow_skip_drafts=so.skip_drafts)
    return runner.prepare_inputs(so, batch_req_state, batch_desc, 0)


def sample_stand_in(runner, scheduler, so, batch, token: int) -> None:
    """The sampler's stand-in (no logits are computed): ``token`` for every request whose prefill is
    done, through vLLM's own accounting of sampled tokens and the scheduler's update."""
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected

    num_reqs = batch.num_reqs
    sampled = torch.tensor([[token]] * num_reqs, dtype=torch.int64)
    num_sampled, num_rejected = get_num_sampled_and_rejected(  # as vLLM's Sampler calls it
        batch.seq_lens.new_ones(num_reqs), batch.seq_lens, batch.cu_num_logits, batch.idx_mapping,
        runner.req_states.prefill_len.gpu)
    runner.postprocess_sampled(batch.idx_mapping, sampled, num_sampled, num_rejected, batch.query_start_loc)
    tokens = [[token] if n else [] for n in num_sampled.tolist()]
    scheduler.update_from_output(so, ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=tokens))


def allocate_kv_cache(config, kv_config, layout):
    """Model Runner V2's ``GPUModelRunner.initialize_kv_cache`` on the CPU: the attention backends
    and metadata builders, the allocation and the binding to the layers, all vLLM's own. Returns
    the attention groups, one list a KV cache group."""
    from vllm.v1.worker.gpu.attn_utils import init_attn_backend, init_kv_cache

    config.cache_config.kv_cache_layout = layout.name
    device = torch.device("cpu")
    attn_groups, _, kernel_block_sizes = init_attn_backend(kv_config, config, device)
    init_kv_cache(config.compilation_config.static_forward_context, kv_config, device, kernel_block_sizes, config,
                  attn_groups=(g for groups in attn_groups for g in groups))
    return attn_groups


class QSASideMetadata:
    """One QSA layer's step metadata as vLLM's own builders make it (``build_attn_metadata``) for
    the layer's side groups, its indexer's compressed keys and raw-key ring: with patch qsa-offload
    the layer has no group of its own, and ``_run_qsa`` reads those. The scheduler is stood in for:
    each request's blocks are given, the same block ids in every group (the engine's block
    tables share them)."""

    def __init__(self, config, kv_config, attn_groups, layer):
        self.config, self.kv_config = config, kv_config
        indexer = layer.indexer.compressed_key_cache.prefix.rsplit(".", 1)[0]
        self.side_groups = [i for i, group in enumerate(kv_config.kv_cache_groups)
                            if any(n.startswith(indexer + ".") for n in group.layer_names)]
        self.attn_groups = [groups if i in self.side_groups else [] for i, groups in enumerate(attn_groups)]

    def __call__(self, req_blocks: list[list[int]], query_lens: list[int], computed: list[int]):
        """``(metadata, positions, token_to_req, block tables a group)`` for a step of
        ``query_lens[r]`` new tokens after ``computed[r]`` of each request ``r``, whose blocks
        are ``req_blocks[r]``."""
        from vllm.v1.worker.gpu.attn_utils import build_attn_metadata

        num_reqs = len(query_lens)
        positions = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, computed)])
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor([c + q for q, c in zip(query_lens, computed)], dtype=torch.int32)
        token_req = torch.arange(num_reqs).repeat_interleave(torch.tensor(query_lens))
        tables, slots = [], []
        for group in self.kv_config.kv_cache_groups:
            block_size = group.kv_cache_spec.block_size
            width = -(-self.config.model_config.max_model_len // block_size)
            table = torch.zeros((num_reqs, width), dtype=torch.int32)
            for r in range(num_reqs):
                table[r, :len(req_blocks[r])] = torch.tensor(req_blocks[r][:width])
            tables.append(table)
            slots.append((table[token_req, positions // block_size].long() * block_size + positions % block_size)
                         if block_size > 1 else table[token_req, 0].long())
        metadata = build_attn_metadata(self.attn_groups, num_reqs, len(positions), qsl, qsl, max(query_lens),
                                       seq_lens, int(seq_lens.max()), tables, slots, self.kv_config,
                                       positions=positions)
        return metadata, positions, token_req, tables


def stand_in_qsa_indexer(layer, generator: torch.Generator) -> None:
    """The QSA indexer's kernels refuse non-CUDA tensors (vllm/models/qwen4_exp/nvidia/ops/qsa.py
    checks ``raw_keys.is_cuda``), so the indexer, and only it, is stood in for: it writes the
    selection as the indexer does (each row's chosen logical positions, causal, at most the
    layer's top-k, and the count in the last column) and returns no fused outputs, as the unfused
    path's indexer does (the demo's 32-dim indexer is outside the fused ``qsa_prepare`` kernel's
    shapes, on CUDA too)."""
    topk = layer.indexer.packed_output_width - 1

    def select(projected_qk, positions, out, attn=None, qkv=None, slot_mapping=None):
        out.fill_(-1)
        for row, pos in enumerate(positions.tolist()):
            chosen = torch.randperm(pos + 1, generator=generator)[:topk]
            out[row, :len(chosen)] = chosen.int()
            out[row, -1] = len(chosen)
        return out, None

    layer.indexer.forward = select


def stand_in_cache_writer(qsa) -> None:
    """``Qwen4ExpQSAImpl.do_kv_cache_update``'s CUDA op (``vllm._custom_ops.reshape_and_cache_flash``,
    which needs vllm._C) stood in for by vLLM's own Triton twin of the same signature. The Triton
    writer asks for the device's compute capability: run it under ``a_3090()``."""
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

    qsa.ops.reshape_and_cache_flash = triton_reshape_and_cache_flash


def a_3090():
    """The compute capability an RTX 3090 reports, for the Triton writer's tile sizes."""
    from unittest import mock

    return mock.patch("torch.cuda.get_device_capability", return_value=(8, 6))
