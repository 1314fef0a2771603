"""Build vLLM 0.34.0's own ``qwen4_exp`` model for the demo checkpoint on the CPU, lay out and
allocate its KV cache as the engine does, and (with patch qsa-offload) run one offloaded QSA layer's
patched forward over metadata that vLLM's own builders made. Prints JSON.

Run by tests/serving/patches/test_qsa_offload.py against stock and patched vLLM trees:
``python qsa_offload_scenario.py SNAPSHOT PORT KV_BYTES``.

The order is the engine's: the model is built (``GPUModelRunner.load_model``), the block size set
(``update_block_size_for_backend``), the KV cache planned (``EngineCore._initialize_kv_caches``)
and allocated and bound (Model Runner V2's ``init_attn_backend`` and ``init_kv_cache``), then steps
run. What the scenario records at each point is what exists then, so the test can say when the
offload's memory appears.

Stood in for, because it cannot exist here: the quantization config is dropped (the CPU has no
kernels for the release's INT6 weights; KV cache specs do not depend on it) and the layer's weights
are seeded random numbers rather than loaded (so their projection GEMM is torch's); the scheduler's
block allocation is a hand-written block table (the KV cache manager is not part of what is tested);
the QSA indexer, the reshape_and_cache_flash op and the device capability query (CUDA-only:
support/vllm_demo.py's ``stand_in_qsa_indexer``, ``stand_in_cache_writer`` and ``a_3090``).
"""
import json, sys
import torch
from vllm.config import CacheConfig

from support.vllm_demo import (
    QSASideMetadata, a_3090, allocate_kv_cache, build_model, demo_vllm, plan_kv_cache, stand_in_cache_writer,
    stand_in_qsa_indexer,
)

snapshot, port, kv_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])


def drop_quantization(config):
    config.__dict__.pop("quantization_config", None)
    return config


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def host_pool_bytes() -> int:
    from flashnext.serving.runtime import host_pool

    return sum(pool.nbytes for pool in host_pool._POOLS)


def arena_bytes(runtime) -> int:
    arena = runtime.ARENA.cache
    return 0 if arena is None else arena.nbytes + arena.state_nbytes


out = {}
with demo_vllm(snapshot, port, drop_quantization,
               CacheConfig(mamba_cache_mode="align", enable_prefix_caching=True)) as (config, qsa):
    from flashnext.serving.runtime import qsa_offload as runtime

    model = build_model(config)  # GPUModelRunner.load_model builds the model here
    patched = any(hasattr(m, "qsa_offload") for m in model.modules())
    if patched:
        out["after_load"] = {"arena_bytes": arena_bytes(runtime), "host_bytes": host_pool_bytes()}

    from vllm.platforms.interface import Platform

    Platform._align_hybrid_block_size(config, qsa.Qwen4ExpQSABackend)
    out["block_size"] = config.cache_config.block_size
    out["mamba_page_size_padded"] = config.cache_config.mamba_page_size_padded

    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    specs, layout, kv_config = plan_kv_cache(config, kv_bytes)
    out["specs"] = {name.split("layers.")[-1]: type(spec).__name__ for name, spec in specs.items()}
    out["layout"] = layout.name
    out["num_blocks"] = kv_config.num_blocks
    out["groups"] = sorted(type(g.kv_cache_spec).__name__ for g in kv_config.kv_cache_groups)
    out["concurrency"] = get_max_concurrency_for_kv_cache_config(config, kv_config)

    layers = [m for m in model.modules() if isinstance(m, qsa.Qwen4ExpQSAAttention)]
    offloads = [getattr(m, "qsa_offload", None) for m in layers]
    out["offloaded_layers"] = sum(o is not None for o in offloads)
    if patched and out["offloaded_layers"]:
        out["before_kv_allocation"] = {"arena_bytes": arena_bytes(runtime), "host_bytes": host_pool_bytes()}
        layer, hook = layers[0], offloads[0]
        attn_groups = allocate_kv_cache(config, kv_config, layout)
        host = hook.host_kv
        out["after_kv_allocation"] = {"arena_bytes": arena_bytes(runtime), "host_bytes": host_pool_bytes()}
        out["host_rows"] = list(host.shape)
        out["row_cache_rows"] = hook.arena.sets
        out["arena_blocks"] = hook.arena.arena.shape[0]
        out["builders"] = sorted({type(g.get_metadata_builder(0)).__name__ for gs in attn_groups for g in gs
                                  if any(".layers.3." in n for n in g.layer_names)})

        # One prefill step of two requests and then one decode step, each through the patched
        # _run_qsa with the metadata vLLM's own builders make for the QSA side groups.
        from vllm.forward_context import set_forward_context

        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
        bs = config.cache_config.block_size
        prompt = [37, 21]
        # The scheduler's blocks for each request (stand-in): request 0 has blocks 5 and 2, request 1 block 7.
        req_blocks = [[5, 2], [7, 0]]
        side_metadata = QSASideMetadata(config, kv_config, attn_groups, layer)

        def run_step(query_lens, computed):
            metadata, positions, token_req, _ = side_metadata(req_blocks, query_lens, computed)
            hidden = (torch.randn(len(positions), config.model_config.hf_text_config.hidden_size, generator=g)
                      ).to(torch.bfloat16)
            with set_forward_context(metadata, config, num_tokens=len(positions)):
                # the projection GEMM in torch: vLLM's CPU GEMM is set up by weight post-processing,
                # which the seeded weights skip (stand-in for the GEMM only)
                qkv = torch.nn.functional.linear(hidden, layer.qkv_proj.weight)
                qkv, projected_qk = qkv.split([2 * layer.q_size + 2 * layer.kv_size, layer.index_qk_size], dim=-1)
                n = len(positions)
                # vLLM's own unfused projection: the K/V the writer must store and the query it attends with
                q, k, v, gate = layer._project_qkv_gate(qkv, positions)
                query = q.view(n, layer.num_heads, layer.head_dim)
                key = k.view(n, layer.num_kv_heads, layer.head_dim)
                value = v.view(n, layer.num_kv_heads, layer.head_dim)
                output = qkv.new_empty(n, layer.num_heads, layer.head_dim)
                fused = layer.use_fused_qsa_prepare
                with a_3090():
                    layer._run_qsa(projected_qk, positions, None if fused else query, None if fused else key,
                                   None if fused else value, output, None if fused else gate, qkv)
            # Independently: where each token's row lives, from the request's blocks and its position.
            expected_slots = [req_blocks[r][p // bs] * bs + p % bs for r, p in zip(token_req.tolist(),
                                                                                  positions.tolist())]
            return dict(positions=positions, token_req=token_req, key=key, value=value, query=query, gate=gate,
                        output=output, slots=expected_slots,
                        selection=layer.topk_indices_buffer[:n].clone(), metadata=metadata)

        # The rest of _run_qsa is vLLM's: the K/V stored by Qwen4ExpQSAImpl.do_kv_cache_update.
        stand_in_qsa_indexer(layer, g)
        stand_in_cache_writer(qsa)
        out["fused_writer"] = bool(layer.use_fused_qsa_prepare)
        # What the patched _run_qsa hands the indexer and the attention in place of the
        # metadata[layer_name] vLLM builds no more (recorded, not replaced).
        from vllm.models.qwen4_exp.common.qsa import Qwen4ExpQSAMetadata

        main_metadata, handed = hook.main_metadata, []
        hook.main_metadata = lambda metadata: handed.append(main_metadata(metadata)) or handed[-1]
        torch.set_grad_enabled(False)
        before = host.clone()
        hook.arena.tags.fill_(5)  # as if an earlier decode had cached rows: the staged prefill must drop them
        first = run_step(prompt, [0, 0])
        out["cached_rows_after_prefill"] = int((hook.arena.tags[hook.index] >= 0).sum())
        second = run_step([1, 1], prompt)
        out["cached_rows_after_decode"] = int((hook.arena.tags[hook.index] >= 0).sum())
        out["metadata_types"] = sorted({type(m).__name__ for m in first["metadata"].values()})
        out["main_metadata"] = [dict(vllms=isinstance(m, Qwen4ExpQSAMetadata), tokens=m.num_actual_tokens,
                                     slots=m.slot_mapping.tolist() == step["slots"])
                                for m, step in zip(handed, (first, second))]

        flat_host = host.reshape(-1, layer.num_kv_heads, 2 * layer.head_dim).float()
        written = torch.zeros(flat_host.shape[0], dtype=torch.bool)
        key_error = value_error = 0.0
        for step in (first, second):
            rows = flat_host[step["slots"]]
            key_error = max(key_error, float((rows[..., :layer.head_dim] - step["key"].float()).abs().max()))
            value_error = max(value_error, float((rows[..., layer.head_dim:] - step["value"].float()).abs().max()))
            written[step["slots"]] = True
        out["stored_key_error"], out["stored_value_error"] = key_error, value_error
        out["rows_written"] = int(written.sum())
        out["other_rows_untouched"] = bool(torch.equal(host.reshape(flat_host.shape)[~written],
                                                       before.reshape(flat_host.shape)[~written]))

        # The attention output against a torch reference over rows gathered by the expected slots
        # (not through the layer's view), with the selection vLLM's indexer made.
        from flashnext.quant.kernels import qsa_row_cache as kernels

        errors = []
        for step in (first, second):
            ref = torch.zeros_like(step["output"], dtype=torch.float32)
            by_position = {}
            for r in range(len(prompt)):
                for pos in range(int(step["metadata"][layer.indexer.compressed_key_cache.prefix].seq_lens[r])):
                    by_position[(r, pos)] = req_blocks[r][pos // bs] * bs + pos % bs
            for t, (r, sel) in enumerate(zip(step["token_req"].tolist(), step["selection"])):
                count = int(sel[-1])
                chosen = [by_position[(r, int(p))] for p in sel[:count].tolist()]
                if not chosen:
                    continue
                kv = flat_host[chosen]
                for h in range(layer.num_heads):
                    kh = h * layer.num_kv_heads // layer.num_heads
                    w = torch.softmax(step["query"][t, h].float() @ kv[:, kh, :layer.head_dim].T
                                      * layer.head_dim ** -0.5, dim=0)
                    ref[t, h] = w @ kv[:, kh, layer.head_dim:]
            ref = ref.to(torch.bfloat16).float() * torch.sigmoid(step["gate"].float().view_as(ref))
            errors.append(float((step["output"].float() - ref).abs().max()))
        out["attention_errors"] = errors
        out["selected_counts"] = [int(first["selection"][:, -1].max()), int(second["selection"][:, -1].max())]
        out["after_steps"] = {"arena_bytes": arena_bytes(runtime), "host_bytes": host_pool_bytes()}
print(json.dumps(out))
