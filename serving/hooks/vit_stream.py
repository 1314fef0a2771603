"""Patch vit-stream: the vision tower's blocks streamed from pinned host memory through two device slots.

Seed 000 §6: a resident vision tower takes device memory that the first rank's K/V needs (783 ->
480 MB of K/V). Its blocks have identical parameters, so they can live in pinned host memory (the
exact-size pool of patch host-pool) and share a few device slots, copied in ahead of each block on
a side stream: :class:`flashnext.serving.runtime.block_stream.BlockStream`.

The tower is built on the CPU (:func:`build_context`) and moved at :func:`install`, after the
loader's repacking. ``VLLM_VIT_STREAM=0`` keeps the tower resident, built where vLLM builds it.

vLLM's post-load step (``model_loader.utils.device_loading_context``) takes each CPU-built quantized
module to the GPU and back into ``torch.empty_like(pin_memory=True)``: the tower's linears, 1.25 GiB
at the release's dimensions, pinned through PyTorch's caching host allocator. Once :func:`install`
has copied them into the stream's own rows and the device, those copies are free, and it hands
them back to the system: a free block of that cache is otherwise kept for the process's life.
"""

from __future__ import annotations

import contextlib

import torch

from flashnext import envs
from flashnext.serving.capacity.vision import VIT_STREAM_SLOTS
from flashnext.serving.runtime.block_stream import BlockStream

__all__ = ["enabled", "build_context", "install"]


def enabled() -> bool:
    return envs.VLLM_VIT_STREAM.enabled()


def build_context():
    """Where vLLM builds the vision tower: on the CPU while vit-stream is on, so that the tower is not
    on the device while the MoE weights are repacked at load (seed 000 §6: rank 0 ran out of memory
    there); :func:`install` moves it after loading."""
    return torch.device("cpu") if enabled() else contextlib.nullcontext()


def install(model: torch.nn.Module, slots: int = VIT_STREAM_SLOTS) -> BlockStream | None:
    """After loading: stream ``model.visual.blocks`` into ``slots`` device slots on the device of the
    rest of the model, and move the tower's other modules there."""
    visual = getattr(model, "visual", None)
    blocks = getattr(visual, "blocks", None)
    if not enabled() or not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
        return None
    device = next(p.device for name, p in model.named_parameters() if not name.startswith("visual."))
    stream = BlockStream(blocks, slots, device) if len(blocks) > slots else None
    for name, child in visual.named_children():
        if name != "blocks" or stream is None:
            child.to(device)
    visual._flashnext_block_stream = stream  # kept alive with the tower
    if device.type == "cuda":
        # torch.accelerator's since 2.12 (vLLM 0.34.0's 2.14); the same call under its older name before
        getattr(torch.accelerator, "empty_host_cache", torch._C._host_emptyCache)()
    return stream
