"""Capacity planning: what a serving profile will get (KV cache blocks, token capacity, pinned host
memory, VRAM) before anything starts, computed with vLLM 0.34.0's own rules.

The package is split by concern, each module importing only those before it: ``model`` (the text
and vision configs), ``vision`` (the tower's memory and vit-stream's slot rule), ``shape`` (the one
reader of a profile's vLLM arguments), ``rules`` (host headroom and pinned-allocation rounding),
``kv`` (the KV cache specs, vLLM's grouping and the block-size rule the engine shares),
``qwen4_exp`` (that family's plan), ``ledger`` (every byte the patches hold per rank, and the
pinned host terms the preflight counts), ``vram`` (each rank's memory in one table, the one
``flashnext plan`` leads with, and the seed's measured weights and runtime it reads) and ``rig`` (a
rig's profile, decided by that table); the last three imported where they are used.

:data:`FAMILIES` is the one table of the model families that can be planned. ``flashnext plan``,
``serve``'s plan line and the preflight's host-RAM check all look a profile's family up in it, so a
new family is one planner registered here and nothing else branches on the family's name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from flashnext.errors import FlashnextError
from flashnext.serving.capacity import qwen4_exp
from flashnext.serving.capacity.kv import (KVCacheLayout, kv_cache_layout, offload_block_size, qsa_arena_blocks,
                                           qsa_layers_per_rank, rank_layers)
from flashnext.serving.capacity.model import (MANIFEST, ModelConfig, TextConfig, VisionConfig, base_manifest,
                                              load_text_config, load_vision_config)
from flashnext.serving.capacity.qwen4_exp import GroupPlan, Plan, plan
from flashnext.serving.capacity.rules import HOST_HEADROOM, next_power_of_two, pinned_bytes
from flashnext.serving.capacity.shape import ServingShape, extensible_kv_cache, gpu_memory_utilization
from flashnext.serving.capacity.vision import VisionPlan, slot_bytes, slot_layout, streamed_host_bytes

__all__ = [
    "FAMILIES", "GroupPlan", "HOST_HEADROOM", "KVCacheLayout", "MANIFEST", "ModelConfig", "Plan", "Planner",
    "ServingShape", "TextConfig", "VisionConfig", "VisionPlan", "base_manifest", "extensible_kv_cache",
    "gpu_memory_utilization",
    "kv_cache_layout", "load_text_config", "load_vision_config", "next_power_of_two", "offload_block_size",
    "pinned_bytes", "plan", "plan_profile", "planner_for", "qsa_arena_blocks", "qsa_layers_per_rank", "rank_layers",
    "slot_bytes", "slot_layout", "streamed_host_bytes",
]


class Planner(Protocol):
    """A family's plan of a profile (its overrides applied) for a model snapshot, or its config.json
    already read (None: the pinned base)."""

    def __call__(self, profile, kv_cache_memory_bytes: int | None = None, prefix_caching: bool | None = None,
                 model: Path | ModelConfig | None = None) -> Plan: ...


FAMILIES: dict[str, Planner] = {
    "qwen4_exp": qwen4_exp.plan_profile,
}


def planner_for(profile) -> Planner:
    """The planner of ``profile``'s model family; a family without one is a :class:`FlashnextError` that says so."""
    try:
        return FAMILIES[profile.model_family]
    except KeyError:
        raise FlashnextError(f"profile {profile.name} serves {profile.model_family}; plan models "
                             f"{', '.join(FAMILIES)} profiles only") from None


def plan_profile(profile, kv_cache_memory_bytes: int | None = None, prefix_caching: bool | None = None,
                 model: Path | ModelConfig | None = None) -> Plan:
    """The plan of ``profile`` (a :class:`~flashnext.serving.profiles.Profile`) by its family's planner."""
    return planner_for(profile)(profile, kv_cache_memory_bytes, prefix_caching, model)
