"""Build vLLM 0.33.0's own ``qwen4_exp`` model for the demo checkpoint on the CPU and lay out its KV
cache the way the engine core does; with patch qsa-offload, also drive one offloaded QSA layer's
bind / store / attention hooks through the Triton interpreter. Prints JSON.

Run by tests/serving/test_patch_series.py against stock and patched vLLM trees:
``python qsa_offload_scenario.py SNAPSHOT PORT KV_BYTES``.

The release's quantization config is dropped: the CPU has no kernels for its INT6 weights, and KV
cache specs do not depend on it (the rest of what is stood in for: ``support/vllm_demo.py``).
"""
import json, sys
import torch
from vllm.config import CacheConfig

from support.vllm_demo import build_model, demo_vllm

snapshot, port, kv_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])


def drop_quantization(config):
    config.__dict__.pop("quantization_config", None)
    return config


out = {}
with demo_vllm(snapshot, port, drop_quantization,
               CacheConfig(mamba_cache_mode="align", enable_prefix_caching=True)) as (config, qsa):
    from vllm.platforms.interface import Platform

    Platform._align_hybrid_block_size(config, qsa.Qwen4ExpQSAFlashAttentionBackend)
    out["block_size"] = config.cache_config.block_size
    out["mamba_page_size_padded"] = config.cache_config.mamba_page_size_padded

    model = build_model(config)

    # The engine core's KV cache planning, step by step (EngineCore._initialize_kv_caches).
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    specs = get_kv_cache_spec(config)
    out["specs"] = {name.split("layers.")[-1]: type(spec).__name__ for name, spec in specs.items()}
    layouts = [layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(config))]
    layout = resolve_kv_cache_layout(config, [layouts], list(specs.values()))
    out["layout"] = layout.name
    groups = get_global_kv_cache_groups(config, [specs])
    (kv_config,) = get_kv_cache_configs(config, [specs], [kv_bytes], groups)
    out["num_blocks"] = kv_config.num_blocks
    out["groups"] = sorted(type(g.kv_cache_spec).__name__ for g in kv_config.kv_cache_groups)
    out["concurrency"] = get_max_concurrency_for_kv_cache_config(config, kv_config)

    offloaded = [m for m in model.modules() if isinstance(m, qsa.Qwen4ExpQSAAttention)]
    hook = getattr(offloaded[0], "qsa_offload", None) if offloaded else None
    out["offloaded_layers"] = sum(getattr(m, "qsa_offload", None) is not None for m in offloaded)
    if hook is not None:
        # Bind the engine's caches as the runner does, then the host rows on the first step.
        from vllm.v1.worker.utils import allocate_kv_cache, bind_kv_cache

        views = allocate_kv_cache(kv_config, torch.device("cpu"), layout)
        runner_caches = []
        bind_kv_cache(views, config.compilation_config.static_forward_context, runner_caches,
                      kv_cache_groups=kv_config.kv_cache_groups)
        layer = hook.layer
        hook.bind()
        host = hook.host_kv
        out["host_rows"] = list(host.shape)
        out["host_pool_is_exact"] = hook.pinned.numel() * 2 == host.numel() * host.element_size()

        # One decode step of two requests: rows stored through vLLM's own cache view, attention
        # through the hook, against the torch reference over the same host rows.
        from flashnext.quant.kernels import qsa_row_cache as kernels
        from flashnext.serving.hooks.qsa_offload import OffloadedMetadata

        g = torch.Generator().manual_seed(0)
        host.copy_(torch.randn(host.shape, generator=g).to(torch.bfloat16))
        bs = hook.block_size
        table = torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)[:, :max(1, 4096 // bs)]
        seq_lens = torch.tensor([30, 21])
        token_to_req = torch.tensor([0, 1], dtype=torch.int32)
        slots = torch.tensor([int(table[0, 29 // bs]) * bs + 29 % bs, int(table[1, 20 // bs]) * bs + 20 % bs])
        meta = OffloadedMetadata(2, 1, 0, slots, table, token_to_req, seq_lens)
        key_cache, value_cache = layer.kv_cache.transpose(1, 2).split(layer.head_dim, dim=-1)
        new_k = torch.randn(2, layer.num_kv_heads, layer.head_dim, generator=g).to(torch.bfloat16)
        flat_k = key_cache.reshape(-1, layer.num_kv_heads, layer.head_dim)
        flat_k[slots] = new_k  # what reshape_and_cache_flash writes, through the layer's own view
        hook.stored(meta)
        selection = torch.full((2, layer.indexer.packed_output_width), -1, dtype=torch.int32)
        topk = selection.shape[1] - 1
        for r, n in enumerate((30, 21)):
            chosen = torch.randperm(n, generator=g)[:topk]
            selection[r, :len(chosen)] = chosen.int()
            selection[r, -1] = len(chosen)
        query = torch.randn(2, layer.num_heads, layer.head_dim, generator=g).to(torch.bfloat16)
        gate = torch.randn(2, layer.num_heads * layer.head_dim, generator=g).to(torch.bfloat16)
        output = torch.empty(2, layer.num_heads, layer.head_dim, dtype=torch.bfloat16)
        results = []
        for _ in range(2):  # a cold step, then the same selection from the row cache
            hook.attend(query, meta, output, gate, selection)
            results.append(output.clone())
        ref = kernels.reference_attention(query, host, selection, table, token_to_req, gate.view_as(query))
        out["attention_error"] = float((results[0].float() - ref.float()).abs().max())
        out["cached_step_identical"] = bool(torch.equal(results[0], results[1]))
        out["row_cache_filled"] = int((hook.arena.tags[hook.index] >= 0).sum())
        out["stored_key_in_host_row"] = bool(torch.equal(host.reshape(-1, *host.shape[2:])[slots][:, :, :layer.head_dim],
                                                         new_k))
print(json.dumps(out))
