"""Build vLLM 0.34.0's own ``qwen4_exp`` vision tower for the demo checkpoint on the CPU (5 blocks
instead of the demo's 1, weights drawn from a seed), run an image through it resident, then let the
model's post-load hook (patch vit-stream) stream its blocks, and run the image again; print JSON.

``python vit_stream_scenario.py SNAPSHOT PORT``, against the stock and the patched vLLM trees.
"""
import json, sys
import torch

from support.vllm_demo import build_model, demo_vllm, finish_layers

snapshot, port = sys.argv[1], sys.argv[2]
DEPTH = 5


def bf16_five_blocks(config):
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if hasattr(config, "vision_config"):
        config.vision_config.depth = DEPTH
    return config


out = {}
with demo_vllm(snapshot, port, bf16_five_blocks) as (config, _):
    from vllm.forward_context import set_forward_context

    import vllm.model_executor.models.qwen3_vl as qwen3_vl

    # vLLM's own pure-torch position-embedding interpolation: its Triton one needs a GPU driver
    qwen3_vl.HAS_TRITON = False
    model = build_model(config)
    visual = model.visual
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in visual.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    finish_layers(visual)
    pixels = torch.randn(64, 3 * 2 * 16 * 16, generator=g).to(torch.bfloat16)
    grid = [[1, 4, 8], [1, 4, 8]]  # two images of 4 x 8 patches
    block_bytes = lambda b: sum(p.numel() * p.element_size() for p in b.parameters())
    out["blocks"] = len(visual.blocks)
    # the sizes `flashnext plan` computes for the tower, from vLLM's own modules
    out["vllm_block_bytes"] = block_bytes(visual.blocks[0])
    out["vllm_other_bytes"] = sum(p.numel() * p.element_size() for n, p in visual.named_parameters()
                                  if not n.startswith("blocks."))
    out["resident_block_bytes"] = sum(block_bytes(b) for b in visual.blocks)
    with set_forward_context(None, config), torch.no_grad():
        resident = visual(pixels, grid_thw=grid).clone()  # the output may be a reused buffer
        if hasattr(model, "process_weights_after_loading"):
            model.process_weights_after_loading()  # vLLM's model-level post-load hook
        stream = getattr(visual, "_flashnext_block_stream", None)
        out["streamed"] = stream is not None
        storages = {p.untyped_storage().data_ptr() for b in visual.blocks for p in b.parameters()}
        out["device_storages"] = len(storages)
        if stream is not None:
            out["device_bytes"] = stream.device_bytes
        runs = [visual(pixels, grid_thw=grid).clone() for _ in range(3)]  # the slots wrap around between runs
        out["finite"] = bool(torch.isfinite(resident.float()).all())
        out["bit_identical"] = all(torch.equal(r, resident) for r in runs)
print(json.dumps(out))
