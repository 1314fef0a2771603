"""The vision tower's device memory on the first pipeline rank, and the slot rule of patch vit-stream.

:func:`slot_layout` is the one statement of how vit-stream packs a block's parameters into a device
slot: ``hooks/vit_stream.py`` lays out the real block's parameters with it, and the plan feeds it
the parameter sizes of the config's block, so that the slot ``plan`` and the preflight count is the
slot the hook allocates.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from flashnext.serving.capacity.model import VisionConfig

# Bytes each parameter of a streamed vision block is aligned to in its device slot.
VIT_SLOT_ALIGN = 256
# vLLM's default for Qwen3-VL's image processor without --mm-processor-kwargs max_pixels: 16,384
# tokens of 32 x 32 px (seed 000 §6: startup profiling then assumes a 16.7 MP image).
DEFAULT_MAX_PIXELS = 16384 * 32 * 32
# vit-stream's device slots: one block runs from one while the next block's copy fills the other.
VIT_STREAM_SLOTS = 2


def slot_layout(param_sizes: Iterable[int]) -> tuple[list[int], int]:
    """Each parameter's offset in a slot, in order, and the slot's bytes: every parameter starts
    on a :data:`VIT_SLOT_ALIGN` boundary, so that each view of the slot is aligned for its dtype."""
    offsets, offset = [], 0
    for nbytes in param_sizes:
        offsets.append(offset)
        offset += -(-nbytes // VIT_SLOT_ALIGN) * VIT_SLOT_ALIGN
    return offsets, offset


def slot_bytes(param_sizes: Iterable[int]) -> int:
    """One device slot of vit-stream for a block whose parameters are ``param_sizes`` bytes."""
    return slot_layout(param_sizes)[1]


@dataclass
class VisionPlan:
    """The vision tower's device memory on the first pipeline rank (vit-first-rank); bytes."""

    streamed: bool  # patch vit-stream: two block slots instead of every block
    max_pixels: int
    resident_weight_bytes: int
    streamed_weight_bytes: int
    weight_bytes: int  # the one that applies
    activation_bytes: int  # estimate, one image of max_pixels
    vram_bytes: int  # weight_bytes + activation_bytes


def vision_plan(vision: VisionConfig, streamed: bool, max_pixels: int) -> VisionPlan:
    resident = vision.other_bytes() + vision.depth * vision.block_bytes()
    slots = min(VIT_STREAM_SLOTS, vision.depth)
    stream = (vision.other_bytes() + slots * slot_bytes(vision.block_parameter_bytes())
              if vision.depth > slots else resident)
    weights = stream if streamed else resident
    activations = vision.activation_bytes(max_pixels)
    return VisionPlan(streamed, max_pixels, resident, stream, weights, activations, weights + activations)


def streamed_host_bytes(vision: VisionConfig) -> int:
    """The pinned host rows vit-stream keeps the blocks in: one slot-sized row per block."""
    return vision.depth * slot_bytes(vision.block_parameter_bytes())
