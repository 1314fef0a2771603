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
the QSA indexer, the reshape_and_cache_flash op and the device capability query (CUDA-only, named
where they are stood in for below).
"""
import json, sys
from unittest import mock
import torch
from vllm.config import CacheConfig

from support.vllm_demo import build_model, demo_vllm

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

    layers = [m for m in model.modules() if isinstance(m, qsa.Qwen4ExpQSAAttention)]
    offloads = [getattr(m, "qsa_offload", None) for m in layers]
    out["offloaded_layers"] = sum(o is not None for o in offloads)
    if patched and out["offloaded_layers"]:
        out["before_kv_allocation"] = {"arena_bytes": arena_bytes(runtime), "host_bytes": host_pool_bytes()}
        layer, hook = layers[0], offloads[0]
        # Model Runner V2's GPUModelRunner.initialize_kv_cache: backends, metadata builders, allocation
        # and binding, all vLLM's own.
        from vllm.v1.worker.gpu.attn_utils import init_attn_backend, init_kv_cache

        config.cache_config.kv_cache_layout = layout.name
        device = torch.device("cpu")
        attn_groups, _, kernel_block_sizes = init_attn_backend(kv_config, config, device)
        kv_caches = init_kv_cache(config.compilation_config.static_forward_context, kv_config, device,
                                  kernel_block_sizes, config,
                                  attn_groups=(g for groups_ in attn_groups for g in groups_))
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
        from vllm.v1.worker.gpu.attn_utils import build_attn_metadata

        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
        bs = config.cache_config.block_size
        prompt = [37, 21]
        # The scheduler's blocks for each request (stand-in): request 0 has blocks 5 and 2, request 1 block 7.
        req_blocks = [[5, 2], [7, 0]]
        side_groups = [i for i, grp in enumerate(kv_config.kv_cache_groups)
                       if any(".layers.3.self_attn.indexer" in n for n in grp.layer_names)]
        only_side = [gs if i in side_groups else [] for i, gs in enumerate(attn_groups)]

        def run_step(query_lens, computed):
            num_reqs = len(query_lens)
            positions = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, computed)])
            qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
            seq_lens = torch.tensor([c + q for q, c in zip(query_lens, computed)], dtype=torch.int32)
            token_req = torch.arange(num_reqs).repeat_interleave(torch.tensor(query_lens))
            tables, slots = [], []
            for i, grp in enumerate(kv_config.kv_cache_groups):
                gbs = grp.kv_cache_spec.block_size
                width = -(-4096 // gbs)
                table = torch.zeros((num_reqs, width), dtype=torch.int32)
                for r in range(num_reqs):
                    table[r, :len(req_blocks[r])] = torch.tensor(req_blocks[r][:width])
                tables.append(table)
                slots.append((table[token_req, positions // gbs].long() * gbs + positions % gbs)
                             if gbs > 1 else table[token_req, 0].long())
            metadata = build_attn_metadata(only_side, num_reqs, len(positions), qsl, qsl, max(query_lens), seq_lens,
                                           int(seq_lens.max()), tables, slots, kv_config, positions=positions)
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
                # the Triton writer asks for the device's compute capability to size its tiles: a 3090's
                with mock.patch("torch.cuda.get_device_capability", return_value=(8, 6)):
                    layer._run_qsa(projected_qk, positions, None if fused else query, None if fused else key,
                                   None if fused else value, output, None if fused else gate, qkv)
            # Independently: where each token's row lives, from the request's blocks and its position.
            expected_slots = [req_blocks[r][p // bs] * bs + p % bs for r, p in zip(token_req.tolist(),
                                                                                  positions.tolist())]
            return dict(positions=positions, token_req=token_req, key=key, value=value, query=query, gate=gate,
                        output=output, slots=expected_slots, table=tables[side_groups[0]],
                        selection=layer.topk_indices_buffer[:n].clone(), metadata=metadata)

        # Stood in for, on the CPU: the QSA indexer, whose kernels refuse non-CUDA tensors
        # (vllm/models/qwen4_exp/nvidia/ops/qsa.py checks `raw_keys.is_cuda`). Its output is the
        # selection, which the stand-in writes as the indexer does (each row's chosen logical
        # positions, causal, and the count in the last column); the rest of _run_qsa is vLLM's.
        # The demo's 32-dim indexer is outside the fused qsa_prepare kernel's shapes, so on CUDA
        # too the main K/V is stored by Qwen4ExpQSAImpl.do_kv_cache_update, whose CUDA op
        # (vllm._custom_ops.reshape_and_cache_flash, which needs vllm._C) is stood in for by vLLM's
        # own Triton twin of the same signature.
        from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

        qsa.ops.reshape_and_cache_flash = triton_reshape_and_cache_flash
        topk = layer.indexer.packed_output_width - 1

        def indexer_stand_in(projected_qk, positions, out, attn=None, qkv=None, slot_mapping=None):
            out.fill_(-1)
            for row, pos in enumerate(positions.tolist()):
                chosen = torch.randperm(pos + 1, generator=g)[:topk]
                out[row, :len(chosen)] = chosen.int()
                out[row, -1] = len(chosen)
            return out, None

        layer.indexer.forward = indexer_stand_in
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
