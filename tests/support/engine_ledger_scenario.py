"""Start and serve vLLM 0.34.0's own ``qwen4_exp`` model for the demo checkpoint on the CPU with the
patched tree (patch qsa-offload on) as one rank of a pipeline of WORLD gloo ranks, recording what
flashnext's code allocates and which Triton variants it launches; prints JSON. Run by
tests/serving/test_engine_ledger.py: ``python engine_ledger_scenario.py RANK PORT WORLD SNAPSHOT
KV_BYTES MAX_NUM_BATCHED_TOKENS MAX_NUM_SEQS CAPTURE_SIZES WARM_UP`` (CAPTURE_SIZES
comma-separated; WARM_UP 0 runs ``OffloadedQSA.bind`` without ``RowCache.warm``, as the tree was
before it).

Start-up, in the engine's order: the model built and vLLM's post-load step run over it
(``GPUModelRunner.load_model``: the QSA arena appears, and ``process_weights_after_loading``
merges decode-05's router rows), the block size set, the KV cache planned (``EngineCore._initialize_kv_caches``: every
rank's specs gathered and laid out together, each rank taking its own) and
allocated and bound (Model Runner V2's ``init_attn_backend`` and ``init_kv_cache``: the host rows
and the prefill kernels' warm-up), then one decode step of each CUDA-graph capture size through
the QSA layer. Serving: a prefill of MAX_NUM_SEQS short prompts, decode steps of 1..MAX_NUM_SEQS
rows, a long prompt in chunks of MAX_NUM_BATCHED_TOKENS over more arena windows than three, the
chunks batched with decodes. A rank that holds no QSA layer has start-up only: its other layers'
steps run no flashnext code this scenario reaches. Every step is the QSA layer's own ``forward`` (its projections,
``_run_qsa``, ``o_proj``) under a forward context holding the metadata vLLM's
``QSAIndexerMetadataBuilder`` built, then its decoder layer's MoE block (vLLM's
``Qwen4ExpSparseMoeBlock`` as patch decode-05 leaves it: 1..4 tokens routed by flashnext's kernel and
handed to vLLM's ``RoutedExperts.forward_modular``, more down vLLM's path). For each serving step
decode-05 takes, the block runs the step again with decode-05 off (``VLLM_MOE_FUSED_DECODE=0``),
what vLLM's own code allocates for it recorded as ``vllm_path``.

Recorded (support/allocations.py, support/triton_launches.py): each step's allocations whose call
stack passes through flashnext's code (not through a stand-in in this folder), with site and
bytes, whether each outlived its step, each site's peak within the step; every Triton launch's
cache key for an RTX 3090, by phase.

Stood in for: CUDA-graph capture, by one eager decode step of each capture size (on a GPU the
capture runs those steps' kernels once, recording them, which is what compiles their variants);
the kernels, which are recorded and not run (the interpreter takes seconds a query row; what they
compute is tested by test_qsa_offload.py and test_ledger.py), but for vLLM's metadata builder's and
decode-05's router, whose outputs the step reads; the scheduler (requests' blocks and chunks are
written out below); the layer's and block's weights (seeded numbers; the quantization config is
dropped, the CPU has no kernels for it); the QSA indexer and the reshape_and_cache_flash op
(CUDA-only: support/vllm_demo.py's ``stand_in_qsa_indexer`` and ``stand_in_cache_writer``); the
routed experts' kernel (no CPU MoE kernel in this build: support/moe_experts_stand_in.py, and their
post-load step is left out too).
"""
import json, os, sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from vllm.config import CacheConfig

import flashnext.quant
import flashnext.serving
from support import SUPPORT_DIR
from support.allocations import Allocations
from support.triton_launches import Launches
from support.vllm_demo import (
    QSASideMetadata, a_3090, allocate_kv_cache, build_model, demo_vllm, plan_kv_cache, stand_in_cache_writer,
    stand_in_qsa_indexer,
)
from support.moe_experts_stand_in import stand_in_experts_kernel

rank, port, world, snapshot = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
kv_bytes, batched_tokens, max_seqs = map(int, sys.argv[5:8])
capture_sizes = [int(n) for n in sys.argv[8].split(",")]
warm_up = sys.argv[9] == "1"
LONG_PROMPT = 3_300  # tokens: over four blocks of the demo's 1,024, a window each in its one-block arena
SHORT_PROMPT = 24  # tokens: MAX_NUM_SEQS of them fit one step's budget


def drop_quantization(config):
    config.__dict__.pop("quantization_config", None)
    return config


code = [Path(package.__file__).resolve().parent for package in (flashnext.serving, flashnext.quant)]
# what the stand-ins below allocate (support/: the experts' kernel, Triton's interpreter) is theirs
recorder = Allocations(code, code[0].parent, stand_ins=(SUPPORT_DIR,))
# vLLM's metadata builder runs its kernel, and decode-05's router: the step reads what they write
launches = Launches(run=frozenset({"_build_qsa_metadata_kernel", "_route_kernel"}))
steps = []
out = {"rank": rank}


@contextmanager
def recorded(name: str, phase: str):
    """A step's flashnext allocations and its Triton launches (their keys, and how many of each kernel)."""
    first = len(launches.keys)
    with recorder.step(name) as step:
        yield
    keys = launches.keys[first:]
    steps.append({**step.to_json(), "phase": phase,
                  "keys": sorted({json.dumps([name, repr(spec), options]) for name, spec, options in keys}),
                  "launches": dict(Counter(name for name, _, _ in keys))})


if not warm_up:
    from flashnext.quant.kernels.qsa_row_cache import RowCache

    RowCache.warm = lambda self, host_kv, q_heads, topk: None

with demo_vllm(snapshot, port, drop_quantization, CacheConfig(mamba_cache_mode="align", enable_prefix_caching=True),
               scheduler={"max_num_seqs": max_seqs, "max_num_batched_tokens": batched_tokens}, rank=rank,
               world=world) as (config, qsa), \
        recorder, launches.recording(), torch.no_grad():
    from vllm.forward_context import set_forward_context
    from vllm.platforms.interface import Platform

    import vllm.models.qwen4_exp.nvidia.model as qsa_model

    from flashnext.serving.runtime import qsa_offload as runtime

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with recorded("load", "start-up"):
        model = build_model(config)
        for module in model.modules():
            # The CPU's packed bf16 GEMM needs vllm._C, which this CUDA build of vLLM cannot load
            # without libcuda; vLLM's own flag for a layer that skips it gives torch's F.linear.
            module._cpu_skip_gemm_dispatch = True
            if isinstance(module, RoutedExperts):  # their kernel is stood in for: nothing to prepare
                module.quant_method.process_weights_after_loading = lambda layer: None
        # vLLM's post-load step, as its loader ends the load (decode-05's router rows are merged here)
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, qsa.Qwen4ExpQSAAttention)]
    out["moe_blocks"] = sum(isinstance(m, qsa_model.Qwen4ExpSparseMoeBlock) for m in model.modules())
    out["qsa_layers"] = len(layers)
    out["arena_bytes"] = runtime.ARENA.cache.nbytes if runtime.ARENA.cache is not None else 0
    Platform._align_hybrid_block_size(config, qsa.Qwen4ExpQSABackend)
    block_size = config.cache_config.block_size
    with recorded("KV cache", "start-up"):
        _, layout, kv_config = plan_kv_cache(config, kv_bytes)
        attn_groups = allocate_kv_cache(config, kv_config, layout)
    out["num_blocks"], out["block_size"] = kv_config.num_blocks, block_size
    host_kv = layers[0].qsa_offload.host_kv if layers else None
    out["host_rows_bytes"] = host_kv.numel() * host_kv.element_size() if layers else 0
    out["steps"] = steps
    if not layers:
        print(json.dumps(out))
        sys.exit(0)
    (layer,) = layers

    g = torch.Generator().manual_seed(0)
    # the QSA layer's decoder layer's MoE block (decode-05's router rows merged at load: seeding
    # writes through the router's and shared gate's views into them)
    (block,) = [d.mlp for d in model.language_model.model.layers if getattr(d, "self_attn", None) is layer]
    for p in [*layer.parameters(), *block.parameters()]:
        if p.dtype.is_floating_point:
            p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
    stand_in_experts_kernel(block.experts.routed_experts)
    os.environ["VLLM_MOE_FUSED_DECODE"] = "1"
    vllm_code = Path(qsa.__file__).resolve().parents[3]  # the (patched) vllm package
    vllms = Allocations([vllm_code], vllm_code.parent, stand_ins=(SUPPORT_DIR,))
    stand_in_qsa_indexer(layer, g)
    stand_in_cache_writer(qsa)
    side_metadata = QSASideMetadata(config, kv_config, attn_groups, layer)
    hidden_size = config.model_config.hf_text_config.hidden_size

    def step(name: str, phase: str, blocks: list[list[int]], query_lens: list[int], computed: list[int]):
        """One step of the QSA layer over requests with these blocks, ``query_lens`` new tokens after
        ``computed`` (decodes first, as vLLM's batch reorder puts them), within the scheduler's budget
        (vLLM's builders write into buffers of that size)."""
        assert sum(query_lens) <= batched_tokens and len(query_lens) <= max_seqs
        metadata, positions, _, _ = side_metadata(blocks, query_lens, computed)
        hidden = torch.randn(len(positions), hidden_size, generator=g).to(torch.bfloat16)
        with recorded(name, phase), set_forward_context(metadata, config, num_tokens=len(positions)), a_3090():
            layer(positions, hidden)
            block(hidden)
        if phase == "serving" and steps[-1]["launches"].get("_route_kernel"):
            # decode-05 took the step: the same step through vLLM's own MoE path (decode-05 off),
            # what vLLM's code allocates for it recorded, for what decode-05's tensors stand in place of
            os.environ["VLLM_MOE_FUSED_DECODE"] = "0"
            try:
                with vllms, vllms.step(name) as stock, set_forward_context(metadata, config, num_tokens=len(positions)):
                    block(hidden)
            finally:
                os.environ["VLLM_MOE_FUSED_DECODE"] = "1"
            steps[-1]["vllm_path"] = stock.to_json()

    # CUDA-graph capture, stood in for: a decode step of each size, over the dummy run's block 0
    for size in capture_sizes:
        step(f"capture {size}", "start-up", [[0]] * size, [1] * size, [SHORT_PROMPT] * size)

    # Serving. Requests own distinct blocks: the short ones one each, the long one five.
    short = [[10 + r] for r in range(max_seqs)]
    step(f"prefill {max_seqs} x {SHORT_PROMPT}", "serving", short, [SHORT_PROMPT] * max_seqs, [0] * max_seqs)
    context = [SHORT_PROMPT] * max_seqs
    for rows in range(1, max_seqs + 1):
        step(f"decode {rows}", "serving", short[:rows], [1] * rows, context[:rows])
        context[:rows] = [c + 1 for c in context[:rows]]
    long_blocks = [100 + b for b in range(-(-LONG_PROMPT // block_size) + 1)]
    done, decoding = 0, 0
    while done < LONG_PROMPT:
        # the first chunk alone, each later one behind 4 more decodes, as a scheduler fills the budget
        chunk = min(batched_tokens - decoding, LONG_PROMPT - done)
        step(f"prefill chunk {done}+{chunk}" + (f" with {decoding} decodes" if decoding else ""), "serving",
             short[:decoding] + [long_blocks], [1] * decoding + [chunk], context[:decoding] + [done])
        context[:decoding] = [c + 1 for c in context[:decoding]]
        done += chunk
        decoding = min(decoding + 4, max_seqs - 1)
    step(f"decode {max_seqs} with the long prompt", "serving", short[:max_seqs - 1] + [long_blocks],
         [1] * max_seqs, context[:max_seqs - 1] + [LONG_PROMPT])

out["steps"] = steps
print(json.dumps(out))
