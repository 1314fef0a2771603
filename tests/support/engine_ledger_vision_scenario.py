"""Start vLLM 0.34.0's own Model Runner V2 for the demo checkpoint on the CPU with the patched tree and
patch vit-stream on, then encode images through vLLM's own encoder call site, recording what
flashnext's code allocates (support/allocations.py); prints JSON. Run by
tests/serving/test_engine_ledger_vision.py: ``python engine_ledger_vision_scenario.py SNAPSHOT PORT
DEPTH GRIDS`` (GRIDS: images as ``T:H:W`` patch grids, comma-separated, each encoded as one request).

Start-up, vLLM's own code in the engine's order: the model vLLM's registry resolves built by
``initialize_model`` (the vision tower on the CPU, vit-stream's ``build_context``), vLLM's post-load
step (``process_weights_after_loading``, whose model-level hook runs vit-stream's ``install``: the
blocks' host rows and two device slots), ``GPUModelRunner`` made and handed the model
(``load_model``: its model state builds vLLM's ``EncoderRunner``). Serving: each image's
``pixel_values`` and ``image_grid_thw`` made into vLLM's own ``MultiModalKwargsItem`` by the field
layout vLLM's Qwen3-VL processor gives them (``_create_qwen2vl_field_factory``,
``MultiModalKwargsItems.from_hf_inputs``), then ``EncoderRunner.execute_mm_encoder``, which batches
them (``group_and_batch_mm_kwargs``) and calls the model's ``embed_multimodal``, the tower's forward
through the streamed blocks.

Stood in for: the tower's checkpoint, whose one block vit-stream leaves resident (no more blocks
than slots): DEPTH blocks (the config's ``depth``), weights drawn from a seed, as
vit_stream_scenario.py does; the image processor (the demo has no tokenizer or processor: the pixels
are drawn, ``pixel_values`` as the processor lays them out, one row per patch); vLLM's Triton
position-embedding interpolation (its pure-torch one: ``HAS_TRITON`` off, Triton needs a GPU driver);
the pinned host rows (on the CPU ``BlockStream`` keeps them in pageable memory: same bytes); CUDA
streams and events, the runner's UVA buffers (vLLM's explicit-copy fallback); the other layers'
weights (the quantization config is dropped; nothing but the tower runs).
"""
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

import vllm.v1.worker.gpu.buffer_utils as buffer_utils

import support.no_cuda

buffer_utils.is_uva_available = lambda: False  # the runner's buffers: pinning needs the CUDA driver
support.no_cuda.install()

import vllm.model_executor.models.qwen3_vl as qwen3_vl  # noqa: E402

import flashnext.quant  # noqa: E402
import flashnext.serving  # noqa: E402
from support import SUPPORT_DIR  # noqa: E402
from support.allocations import Allocations  # noqa: E402
from support.vllm_demo import demo_vllm  # noqa: E402

qwen3_vl.HAS_TRITON = False
snapshot, port, depth = sys.argv[1], sys.argv[2], int(sys.argv[3])
grids = [[int(n) for n in grid.split(":")] for grid in sys.argv[4].split(",")]
CPU = torch.device("cpu")


def bf16_tower_of(config):
    config.__dict__.pop("quantization_config", None)
    if hasattr(config, "vision_config"):
        config.vision_config.depth = depth
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


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


with demo_vllm(snapshot, port, bf16_tower_of) as (config, _), recorder:
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.model_executor.models.qwen2_vl import _create_qwen2vl_field_factory
    from vllm.multimodal.inputs import MultiModalKwargsItems
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    g = torch.Generator().manual_seed(0)
    with recorded("load", "start-up"):
        model = initialize_model(vllm_config=config)
        with torch.no_grad():
            for p in model.visual.parameters():  # the tower's weights (stand-in: the demo has one block)
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        for module in model.modules():
            # The CPU's packed bf16 GEMM needs vllm._C, which this CUDA build of vLLM cannot load
            # without libcuda; vLLM's own flag for a layer that skips it gives torch's F.linear.
            module._cpu_skip_gemm_dispatch = True
            if isinstance(module, RoutedExperts):  # no CPU MoE kernel in this build: nothing to prepare
                module.quant_method.process_weights_after_loading = lambda layer: None
        process_weights_after_loading(model, config.model_config, CPU)  # as vLLM's loader ends the load
        runner = GPUModelRunner(config, CPU)
        runner.load_model(model=model)
    visual = model.visual
    stream = visual._flashnext_block_stream
    out["blocks"] = len(visual.blocks)
    out["streamed"] = stream is not None
    out["slot_bytes"] = nbytes([stream.slot_memory]) if stream else 0
    out["host_row_bytes"] = nbytes([stream.host]) if stream else 0
    out["tower_other_bytes"] = nbytes(p for n, p in visual.named_parameters() if not n.startswith("blocks."))
    encoder = runner.model_state.encoder_runner
    merge = config.model_config.hf_config.vision_config.spatial_merge_size
    patch = config.model_config.hf_config.vision_config
    row = patch.in_channels * patch.temporal_patch_size * patch.patch_size ** 2
    out["pixels"], out["embeddings"] = [], []
    for i, grid in enumerate(grids):
        pixels = torch.randn(grid[0] * grid[1] * grid[2], row, generator=g).to(torch.bfloat16)
        hf_inputs = {"pixel_values": pixels, "image_grid_thw": torch.tensor([grid])}
        items = MultiModalKwargsItems.from_hf_inputs(hf_inputs, _create_qwen2vl_field_factory(merge)(hf_inputs))
        with recorded(f"image {i}: {'x'.join(map(str, grid))} patches", "serving"), \
                set_forward_context(None, config), torch.no_grad():
            (embedding,) = encoder.execute_mm_encoder([("image", items["image"][0])])
        out["pixels"].append(grid[0] * grid[1] * grid[2] * patch.patch_size ** 2)
        out["embeddings"].append(list(embedding.shape))
        del embedding
    # every block's parameters are still views of the slots
    out["slots_kept"] = stream is not None and {p.untyped_storage().data_ptr() for b in visual.blocks
                                                for p in b.parameters()} == {stream.slot_memory.data_ptr()}
print(json.dumps(out))
