"""Patch vit-stream: the vision tower's blocks streamed from pinned host memory through two device slots.

Seed 000 §6: a resident vision tower takes device memory that the first rank's K/V needs (783 ->
480 MB of K/V). Its blocks have identical parameters, so they can live in pinned host memory (the
exact-size pool of patch host-pool) and share a few device *slots*: every parameter of block ``i``
is a view into slot ``i % slots``, set once. Before block ``i`` runs, its weights are copied into
its slot; the copy of block ``i + 1`` is issued on a side stream as block ``i`` starts, after the
slot's previous user (block ``i + 1 - slots``) has finished, so copies overlap compute; block 0's
copy for the next forward is issued when the last block ends. On the CPU
the copies are plain and in order. A slot that already holds the block (a tower with no more blocks
than slots) is not copied again.

The tower is built on the CPU (:func:`build_context`) and moved at :func:`install`, after the
loader's repacking. ``VLLM_VIT_STREAM=0`` keeps the tower resident, built where vLLM builds it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from flashnext import envs
from flashnext.errors import FlashnextError
from flashnext.serving.capacity.vision import VIT_STREAM_SLOTS, slot_layout  # `plan` sizes the slots by it


def enabled() -> bool:
    return envs.VLLM_VIT_STREAM.enabled()


@dataclass(frozen=True)
class _Slot:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


def block_layout(block: torch.nn.Module) -> tuple[list[_Slot], int]:
    """Where each parameter of a block sits in a slot, and the slot's size in bytes."""
    params = list(block.named_parameters())
    sizes = [param.numel() * param.element_size() for _, param in params]
    offsets, slot_bytes = slot_layout(sizes)
    layout = [_Slot(name, tuple(param.shape), param.dtype, offset, nbytes)
              for (name, param), offset, nbytes in zip(params, offsets, sizes)]
    return layout, slot_bytes


class BlockStream:
    """Streams ``blocks`` (an ``nn.ModuleList`` of identically shaped blocks, run in order) through
    ``slots`` buffers on ``device`` (default: where the blocks are). Construct after the weights are
    loaded; the blocks' parameters become views into the slots and their values move to host memory."""

    def __init__(self, blocks: torch.nn.ModuleList, slots: int = VIT_STREAM_SLOTS, device: torch.device | None = None):
        if len(blocks) == 0 or slots < 2:
            # one slot would be overwritten by the next block's copy while its own block still runs
            raise FlashnextError("vit-stream needs at least one block and two slots")
        self.layout, self.block_bytes = block_layout(blocks[0])
        for i, block in enumerate(blocks):
            if block_layout(block) != (self.layout, self.block_bytes):
                raise FlashnextError(f"vit-stream: block {i} differs from block 0 in its parameters; "
                                     "set VLLM_VIT_STREAM=0")
        if any(getattr(block, "do_not_compile", True) is False for block in blocks):
            raise FlashnextError("vit-stream: the vision blocks are compiled (torch.compile of the multimodal "
                                 "encoder), and a compiled block cannot stream; set VLLM_VIT_STREAM=0 or turn "
                                 "off compile_mm_encoder")
        self.device = torch.device(device) if device is not None else next(blocks[0].parameters()).device
        self.blocks = blocks
        self.slots = min(slots, len(blocks))
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            from flashnext.serving.hooks.host_pool import pinned_empty

            self.host = pinned_empty((len(blocks), self.block_bytes), torch.uint8)
        else:
            self.host = torch.empty(len(blocks), self.block_bytes, dtype=torch.uint8)
        self.slot_memory = torch.empty(self.slots, self.block_bytes, dtype=torch.uint8, device=self.device)
        for i, block in enumerate(blocks):
            params = dict(block.named_parameters())
            for s in self.layout:
                self._view(self.host[i], s).copy_(params[s.name].data)
                params[s.name].data = self._view(self.slot_memory[i % self.slots], s)
        self.holds = list(range(self.slots))  # which block each slot's bytes are now
        for i in range(self.slots):
            self.slot_memory[i].copy_(self.host[i])
        self.copy_stream = torch.cuda.Stream(self.device) if on_gpu else None
        self.ready = [torch.cuda.Event() if on_gpu else None for _ in blocks]
        self.slot_free = [torch.cuda.Event() if on_gpu else None for _ in range(self.slots)]
        self.issued: set[int] = set()
        for i, block in enumerate(blocks):
            block.forward = self._streamed(i, block.forward)

    def _streamed(self, i: int, forward):
        """``forward`` between the block's copy and its release. The instance's ``forward`` is
        wrapped, not hooked: vLLM's ``support_torch_compile`` blocks call ``self.forward`` directly,
        which module hooks never see."""
        def streamed_forward(*args, **kwargs):
            self._before(i)
            out = forward(*args, **kwargs)
            self._after(i)
            return out

        return streamed_forward

    @staticmethod
    def _view(row: torch.Tensor, s: _Slot) -> torch.Tensor:
        return row[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)

    @property
    def device_bytes(self) -> int:
        return self.slots * self.block_bytes

    def _copy(self, i: int) -> None:
        """Bring block ``i``'s weights into its slot (asynchronously on a GPU), unless already there."""
        slot = i % self.slots
        if self.holds[slot] == i or i in self.issued:
            return
        if self.copy_stream is None:
            self.slot_memory[slot].copy_(self.host[i])
        else:
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.slot_free[slot])  # the slot's last user has finished
                self.slot_memory[slot].copy_(self.host[i], non_blocking=True)
                self.ready[i].record(self.copy_stream)
            self.issued.add(i)
        self.holds[slot] = i

    def _before(self, i: int) -> None:
        self._copy(i)
        if i in self.issued:
            torch.cuda.current_stream(self.device).wait_event(self.ready[i])
            self.issued.discard(i)
        if i + 1 < len(self.blocks):
            self._copy(i + 1)  # waits (on the copy stream) for block i + 1 - slots to finish

    def _after(self, i: int) -> None:
        if self.copy_stream is not None:
            self.slot_free[i % self.slots].record(torch.cuda.current_stream(self.device))
        if i == len(self.blocks) - 1:
            self._copy(0)  # the next forward's first block, once this one no longer needs its slot


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
    return stream
