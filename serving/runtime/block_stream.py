"""A list of identically shaped modules, run in order, streamed from pinned host memory through a
few device *slots* (the mechanism of patch vit-stream).

Every parameter of block ``i`` is a view into slot ``i % slots``, set once. Before block ``i`` runs,
its weights are copied into its slot; the copy of block ``i + 1`` is issued on a side stream as
block ``i`` starts, after the slot's previous user (block ``i + 1 - slots``) has finished, so copies
overlap compute; block 0's copy for the next forward is issued when the last block ends. On the
CPU the copies are plain and in order. A slot that already holds the block (no more blocks than
slots) is not copied again. The host rows are the exact-size pool of :mod:`.host_pool`.

The slot layout is :func:`flashnext.serving.capacity.vision.slot_layout`, the one ``flashnext plan``
sizes the slots by, so the plan and the engine agree on the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashnext.errors import FlashnextError
from flashnext.serving.capacity.vision import VIT_STREAM_SLOTS, slot_layout
from flashnext.serving.runtime.host_pool import pinned_empty


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
