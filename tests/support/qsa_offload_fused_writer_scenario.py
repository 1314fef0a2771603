"""vLLM 0.34.0's fused QSA writer (``qsa_prepare``) storing K/V into the offloaded layer's host rows
(patch qsa-offload), run through the Triton interpreter on the CPU. Prints JSON.

Run by tests/serving/patches/test_qsa_offload_fused_writer.py against the patched tree:
``python qsa_offload_fused_writer_scenario.py SNAPSHOT PORT KV_BYTES``.

What selects the fused writer is vLLM's own test at layer build (``Qwen4ExpQSAAttention.__init__``
and ``_supports_fused_pre_indexer`` in vllm/models/qwen4_exp/nvidia/): ``use_fused_qsa_prepare =
use_fused_qk_norm_rope_gate and indexer.use_fused_pre_indexer and (bf16 K/V or sm_89+)``, where the
first needs the output gate, NeoX RoPE in bf16, a text-only model or interleaved MRoPE sections
summing to ``rotary_dim / 2``, and ``current_platform.is_cuda()``, and the second an indexer of
head dim 128 with one KV head, a power-of-two compress ratio > 1, ``rotary_dim == 64`` and the same
MRoPE rule. The demo misses on its 32-dim indexer and its 16-dim RoPE (head dim 64 x 0.25); the
smallest change that takes the fused writer keeps the demo's main heads (2 KV heads of 64: host
rows of 512 B) and sets the indexer's head dim to 128, ``partial_rotary_factor`` to 1.0
(``rotary_dim`` 64) and the MRoPE sections to the release's [11, 11, 10] (:func:`fused_writer_dims`).

vLLM's own code here: the model built by vLLM on the CPU, the block size, the KV cache planned and
allocated and bound by Model Runner V2 (so the layer's host rows are the offload's pool), the
metadata from ``QSAIndexerMetadataBuilder``, ``_run_qsa`` (patched), ``QSAIndexer.forward`` with
its fused ``qsa_prepare`` launch and its Triton logits and index-expansion kernels, all through the
Triton interpreter. The reference writer is vLLM's unfused path on the same inputs: the eager
``_project_qkv_gate`` (QK RMSNorm, MRoPE, gate split) and ``Qwen4ExpQSAImpl.do_kv_cache_update``.
The attention after the write is flashnext's (``OffloadedQSA.forward`` in ``impl.forward``'s place).

Stood in for, because it cannot exist here: ``current_platform.is_cuda()`` reads True in the QSA
layer's module while the model is built (:func:`a_cuda_platform_for_qsa`), else vLLM picks the
unfused path on the CPU; the top-k of the indexer's logits (``torch.ops._C.persistent_topk``, a
CUDA op of vllm._C) by ``torch.topk`` over each row's visible blocks (:func:`stand_in_topk`);
the UVA view over the pinned pool (on the CPU the kernel writes the pool itself); the unfused
writer's ``reshape_and_cache_flash`` by vLLM's Triton twin (``stand_in_cache_writer``), which
asks for the device's compute capability (``a_3090``); the quantization config is dropped and the layer's weights are seeded random numbers, so the
projection GEMM is torch's; the scheduler's block allocation is a hand-written block table.
"""
import importlib, json, sys
from unittest import mock

import torch
from vllm.config import CacheConfig

from support.vllm_demo import (
    QSASideMetadata, a_3090, allocate_kv_cache, build_model, demo_vllm, plan_kv_cache, stand_in_cache_writer,
)

snapshot, port, kv_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])


def fused_writer_dims(config):
    """``hf_overrides``: the demo at the smallest dims that take the fused writer (the module
    docstring says why these), without its quantization config (the CPU has no INT6 kernels)."""
    config.__dict__.pop("quantization_config", None)
    text = getattr(config, "text_config", None)
    if text is not None:  # vLLM also calls this on a bare config, to read its model type
        text.indexer_head_dim = 128
        text.rope_parameters = {**text.rope_parameters, "partial_rotary_factor": 1.0, "mrope_section": [11, 11, 10]}
    return config


class CudaReportingPlatform:
    """vLLM's current platform, answering ``is_cuda()`` with True."""

    def __init__(self, platform):
        self._platform = platform

    def is_cuda(self) -> bool:
        return True

    def __getattr__(self, name):
        return getattr(self._platform, name)


def a_cuda_platform_for_qsa(qsa):
    """The QSA layer decides fused or not at build time, on the platform it sees."""
    return mock.patch.object(qsa, "current_platform", CudaReportingPlatform(qsa.current_platform))


def stand_in_topk(indexer_ops) -> None:
    """The indexer's top-k, ``_topk(logits, visible_blocks, token_topk, compress_ratio,
    block_indices, workspace)``: each row's best ``token_topk / compress_ratio`` of its visible
    blocks, which the expansion kernel reads (the first ``min(visible, block_topk)`` of a row)."""

    def topk(logits, visible_blocks, token_topk, compress_ratio, block_indices, workspace):
        block_topk = token_topk // compress_ratio
        block_indices.fill_(-1)
        for row in range(logits.shape[0]):
            visible = min(int(visible_blocks[row]), logits.shape[1])
            chosen = logits[row, :visible].topk(min(visible, block_topk)).indices
            block_indices[row, :len(chosen)] = chosen.to(block_indices.dtype)

    indexer_ops._topk = topk


out = {}
with demo_vllm(snapshot, port, fused_writer_dims,
               CacheConfig(mamba_cache_mode="align", enable_prefix_caching=True)) as (config, qsa):
    with a_cuda_platform_for_qsa(qsa):
        model = build_model(config)  # GPUModelRunner.load_model builds the model here
    layer = next(m for m in model.modules() if isinstance(m, qsa.Qwen4ExpQSAAttention))
    hook = layer.qsa_offload
    out["fused_writer"] = bool(layer.use_fused_qsa_prepare)
    out["dims"] = dict(indexer_head_dim=layer.indexer.index_head_dim, rotary_dim=layer.rotary_emb.rotary_dim,
                       head_dim=layer.head_dim, kv_heads=layer.num_kv_heads)

    from vllm.platforms.interface import Platform

    Platform._align_hybrid_block_size(config, qsa.Qwen4ExpQSABackend)
    _, layout, kv_config = plan_kv_cache(config, kv_bytes)
    attn_groups = allocate_kv_cache(config, kv_config, layout)
    host = hook.host_kv  # (blocks, block_size, kv_heads, 2 x head_dim): the pinned pool, as the kernel sees it
    from flashnext.serving.runtime import host_pool

    out["host_rows"] = list(host.shape)
    out["host_is_the_pool"] = any(pool.tensor is not None and pool.tensor.data_ptr() == host.data_ptr()
                                  for pool in host_pool._POOLS)

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
    layer.process_weights_after_loading()  # vLLM's loader does this; the fused writer reads the K/V scales
    # whatever the pool held before: a row the writer should not touch keeps it bit for bit
    host.copy_(torch.randn(host.shape, generator=g).to(host.dtype))

    indexer_ops = importlib.import_module("vllm.models.qwen4_exp.nvidia.ops.qsa_indexer")
    stand_in_topk(indexer_ops)
    stand_in_cache_writer(qsa)
    # Each fused launch is recorded (not replaced): it ran, and on which cache.
    indexer_module = importlib.import_module("vllm.models.qwen4_exp.nvidia.qsa_indexer")
    qsa_prepare, launches = indexer_module.qsa_prepare, []

    def recorded_qsa_prepare(*args, **kwargs):
        main_outputs = qsa_prepare(*args, **kwargs)
        launches.append((kwargs["main_kv_cache"].data_ptr() == host.data_ptr(), main_outputs))
        return main_outputs

    indexer_module.qsa_prepare = recorded_qsa_prepare

    bs = config.cache_config.block_size
    req_blocks = [[5, 2], [7, 0]]  # the scheduler's blocks for each request (stand-in)
    side_metadata = QSASideMetadata(config, kv_config, attn_groups, layer)
    hidden_size = config.model_config.hf_text_config.hidden_size
    from vllm.forward_context import set_forward_context

    torch.set_grad_enabled(False)
    steps = []
    # Two prompts; then request 0 goes on with a chunk from just before its first block's end into
    # its second (the pool's earlier contents standing for the rows between) beside a decode of
    # request 1; then a decode of each.
    for query_lens, computed in (([37, 21], [0, 0]), ([8, 1], [bs - 4, 21]), ([1, 1], [bs + 4, 22])):
        metadata, positions, token_req, _ = side_metadata(req_blocks, query_lens, computed)
        n = len(positions)
        mrope_positions = positions.expand(3, n).contiguous()  # a text prompt's, as the runner hands a MRoPE model
        hidden = torch.randn(n, hidden_size, generator=g).to(torch.bfloat16)
        qkv = torch.nn.functional.linear(hidden, layer.qkv_proj.weight)
        qkv, projected_qk = qkv.split([2 * layer.q_size + 2 * layer.kv_size, layer.index_qk_size], dim=-1)
        # the unfused path's K/V, query and gate on the same inputs: vLLM's eager projection (its
        # fused norm-RoPE kernel, which the flag would pick, is another launch than the one tested)
        layer.use_fused_qk_norm_rope_gate = False
        q, k, v, gate = layer._project_qkv_gate(qkv, mrope_positions)
        layer.use_fused_qk_norm_rope_gate = True
        key = k.view(n, layer.num_kv_heads, layer.head_dim)
        value = v.view(n, layer.num_kv_heads, layer.head_dim)
        before = host.clone()
        unfused = before.clone()
        with set_forward_context(metadata, config, num_tokens=n), a_3090():
            slots = hook.main_metadata(metadata).slot_mapping
            # the unfused writer into a copy of the pool
            layer.impl.do_kv_cache_update(layer, key, value, unfused.transpose(1, 2), slots)
            output = qkv.new_empty(n, layer.num_heads, layer.head_dim)
            # as Qwen4ExpQSAAttention.forward calls it on the fused path
            layer._run_qsa(projected_qk, mrope_positions, None, None, None, output, None, qkv)
        expected = [req_blocks[r][p // bs] * bs + p % bs for r, p in zip(token_req.tolist(), positions.tolist())]
        steps.append(dict(before=before, unfused=unfused, after=host.clone(), expected=expected,
                          offload_slots=slots.tolist(), output=output, query=q, gate=gate, token_req=token_req,
                          positions=positions, selection=layer.topk_indices_buffer[:n].clone()))

    out["fused_launches"] = [on_host for on_host, _ in launches]

    def head_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
        """The largest difference of two bf16 tensors ``(..., head_dim)`` in units of the last place
        of each head's largest magnitude (RoPE's differences of products leave small entries whose
        own last place says nothing about the rounding)."""
        a, b = a.float(), b.float()
        scale = torch.maximum(a.abs(), b.abs()).amax(-1, keepdim=True).clamp_min(2.0 ** -126)
        return float(((a - b).abs() / torch.exp2(torch.floor(torch.log2(scale)) - 7)).max())

    d = layer.head_dim
    results = []
    for step, (_, (fused_query, fused_gate)) in zip(steps, launches):
        before, after, unfused = (step[k].reshape(-1, layer.num_kv_heads, 2 * d)
                                  for k in ("before", "after", "unfused"))
        changed = (after.view(torch.int16) != before.view(torch.int16)).flatten(1).any(1)
        unfused_changed = (unfused.view(torch.int16) != before.view(torch.int16)).flatten(1).any(1)
        results.append(dict(
            tokens=len(step["expected"]),
            blocks=sorted({slot // bs for slot in step["expected"]}),
            offload_slots_expected=step["offload_slots"] == step["expected"],
            changed_rows=torch.nonzero(changed).flatten().tolist() == sorted(step["expected"]),
            unfused_changed_rows=torch.nonzero(unfused_changed).flatten().tolist() == sorted(step["expected"]),
            values_as_unfused=torch.equal(after[..., d:], unfused[..., d:]),
            key_ulps_from_unfused=head_ulps(after[..., :d], unfused[..., :d]),
            query_ulps_from_eager=head_ulps(fused_query, step["query"].view_as(fused_query)),
            gate_as_eager=torch.equal(fused_gate, step["gate"].view_as(fused_gate)),
        ))
    out["steps"] = results

    # The offload's attention over the host rows the fused launch wrote, with its query and gate,
    # against a torch reference over the rows the expected slots hold and the indexer's selection.
    errors, counts = [], []
    for step, (_, (query, gate)) in zip(steps, launches):
        flat_host = step["after"].reshape(-1, layer.num_kv_heads, 2 * d).float()
        ref = torch.zeros_like(step["output"], dtype=torch.float32)
        for t, (r, sel) in enumerate(zip(step["token_req"].tolist(), step["selection"])):
            count = int(sel[-1])
            counts.append(count)
            kv = flat_host[[req_blocks[r][p // bs] * bs + p % bs for p in sel[:count].tolist()]]
            for h in range(layer.num_heads):
                kh = h * layer.num_kv_heads // layer.num_heads
                w = torch.softmax(query[t, h].float() @ kv[:, kh, :d].T * d ** -0.5, dim=0)
                ref[t, h] = w @ kv[:, kh, d:]
        ref = ref.to(torch.bfloat16).float() * torch.sigmoid(gate.float().view_as(ref))
        errors.append(float((step["output"].float() - ref).abs().max()))
    out["attention_errors"] = errors
    out["selection_counts"] = counts
    out["positions"] = [p for step in steps for p in step["positions"].tolist()]
print(json.dumps(out))
