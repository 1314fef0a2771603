"""Where the draft head's routed experts are in a snapshot, and what the overlay calls them.

The source layouts (fused ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]``, or
per-expert ``experts.{e}.{gate,up,down}_proj.weight``) are found and checked against config.json
here, once, before anything is written; the builder then asks this module for batches of experts as
float32 and for the names and shapes of the tensors that replace them, so that the naming rule
(the one vLLM's FusedMoE loader maps to ``w13_*`` / ``w2_*``) has one home.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flashnext.errors import FlashnextError
from flashnext.quant.checkpoint.snapshot import CONFIG_FILE, INDEX_FILE, Snapshot
from flashnext.quant.formats.safetensors_io import TensorSpec, read_rows
from flashnext.quant.records.jsonfile import get_int

if TYPE_CHECKING:
    import torch

BITS = 4
PROJECTIONS = ("gate", "up", "down")
FLOAT_DTYPES = ("BF16", "F16", "F32")  # the expert dtypes it quantizes

_FUSED = re.compile(r"^(?P<prefix>(?:.*\.)?mtp\.layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<prefix>(?:.*\.)?mtp\.layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.(?P<suffix>\w+)$")


def scale_dtype_for(source_dtype: str) -> str:
    """The dtype the scales are stored in: the experts' own, except that F32 experts get BF16
    scales (what vLLM's INT4 kernels take)."""
    return "BF16" if source_dtype == "F32" else source_dtype


@dataclass
class DraftLayerExperts:
    """The routed experts of one MTP layer in the source snapshot."""

    prefix: str  # e.g. "mtp.layers.0.mlp.experts"
    layer: int
    layout: str  # "fused" or "per_expert"
    num_experts: int
    hidden: int
    intermediate: int
    dtype: str
    sources: dict[str, str] = field(default_factory=dict)  # source tensor name -> shard file

    def source_shard(self, proj: str) -> str:
        if self.layout == "fused":
            key = f"{self.prefix}.{'down_proj' if proj == 'down' else 'gate_up_proj'}"
        else:
            key = f"{self.prefix}.0.{proj}_proj.weight"
        return self.sources[key]

    def shape(self, proj: str) -> tuple[int, int]:
        return (self.hidden, self.intermediate) if proj == "down" else (self.intermediate, self.hidden)

    @property
    def router(self) -> str:
        """The layer's router weight ``[num_experts, hidden]``, which ``--calib`` routes tokens with."""
        return f"{self.prefix.removesuffix('.experts')}.gate.weight"


def find_draft_experts(snap: Snapshot) -> list[DraftLayerExperts]:
    """Locate and validate the MTP routed experts against config.json."""
    tc = snap.text_config
    where = f"{snap.root / CONFIG_FILE}: text config"
    E, H, I = (get_int(tc, key, where, minimum=1)
               for key in ("num_experts", "hidden_size", "moe_intermediate_size"))
    fused: dict[str, dict[str, str]] = {}
    per_expert: dict[str, dict[str, str]] = {}
    for name in snap.weight_map:
        if m := _FUSED.match(name):
            fused.setdefault(m["prefix"], {})[name] = snap.weight_map[name]
        elif m := _PER_EXPERT.match(name):
            if m["suffix"] != "weight":
                raise FlashnextError(
                    f"{snap.root}: the MTP experts are already quantized ({name}); "
                    "make-mtp-int4 needs a snapshot with BF16 MTP experts")
            per_expert.setdefault(m["prefix"], {})[name] = snap.weight_map[name]
    if not fused and not per_expert:
        raise FlashnextError(
            f"{snap.root}: no MTP routed experts in {INDEX_FILE} (looked for "
            "mtp.layers.N.mlp.experts.gate_up_proj or mtp.layers.N.mlp.experts.E.gate_proj.weight); "
            "this snapshot has no draft head")
    layers = []
    for prefix, names in sorted(fused.items()):
        layer = DraftLayerExperts(prefix, int(_FUSED.match(next(iter(names)))["layer"]), "fused",
                                  E, H, I, "", names)
        for proj, shape in (("gate_up_proj", (E, 2 * I, H)), ("down_proj", (E, H, I))):
            name = f"{prefix}.{proj}"
            if name not in names:
                raise FlashnextError(f"{snap.root}: {name} is missing from {INDEX_FILE}")
            layer.dtype = _check_tensor(snap, name, shape, layer.dtype)
        layers.append(layer)
    for prefix, names in sorted(per_expert.items()):
        if prefix in fused:
            raise FlashnextError(f"{snap.root}: {prefix} is stored both fused and per expert")
        layer = DraftLayerExperts(prefix, int(_PER_EXPERT.match(next(iter(names)))["layer"]),
                                  "per_expert", E, H, I, "", names)
        for e in range(E):
            for proj in PROJECTIONS:
                name = f"{prefix}.{e}.{proj}_proj.weight"
                if name not in names:
                    raise FlashnextError(f"{snap.root}: {name} is missing from {INDEX_FILE}")
                layer.dtype = _check_tensor(snap, name, layer.shape(proj), layer.dtype)
        extra = [n for n in names if int(_PER_EXPERT.match(n)["expert"]) >= E]
        if extra:
            raise FlashnextError(f"{snap.root}: {extra[0]} is beyond num_experts={E} of config.json")
        layers.append(layer)
    return layers


def _check_tensor(snap: Snapshot, name: str, shape: tuple[int, ...], dtype: str) -> str:
    _, entry = snap.entry(name)
    if entry.dtype not in FLOAT_DTYPES:
        raise FlashnextError(f"{name} is {entry.dtype}: the MTP experts are already quantized or "
                             "not floating point; make-mtp-int4 needs BF16/F16/F32 experts")
    if entry.shape != shape:
        raise FlashnextError(f"{name} has shape {list(entry.shape)} but config.json implies "
                             f"{list(shape)} (num_experts, hidden_size, moe_intermediate_size)")
    if dtype and entry.dtype != dtype:
        raise FlashnextError(f"{name} is {entry.dtype} while other MTP experts are {dtype}")
    return entry.dtype


def expert_tensor_names(prefix: str, expert: int, proj: str) -> tuple[str, str, str]:
    base = f"{prefix}.{expert}.{proj}_proj"
    return f"{base}.weight_packed", f"{base}.weight_scale", f"{base}.weight_shape"


def expert_specs(layer: DraftLayerExperts, group_size: int, proj: str) -> list[TensorSpec]:
    """The tensors that replace the layer's ``proj`` experts, in the order they are planned."""
    from flashnext.quant.formats.packing import packed_words

    scale_dtype = scale_dtype_for(layer.dtype)
    rows, cols = layer.shape(proj)
    specs = []
    for e in range(layer.num_experts):
        packed, scale, shape = expert_tensor_names(layer.prefix, e, proj)
        specs += [TensorSpec(packed, "I32", (rows, packed_words(cols, BITS))),
                  TensorSpec(scale, scale_dtype, (rows, cols // group_size)),
                  TensorSpec(shape, "I64", (2,))]
    return specs


def updated_weight_map(weight_map: dict[str, str], layers: list[DraftLayerExperts]) -> dict[str, str]:
    """The index's weight_map with each layer's BF16 expert entries replaced in place."""
    new_names: dict[str, list[tuple[str, str]]] = {}
    for layer in layers:
        entries = []
        for e in range(layer.num_experts):
            for proj in PROJECTIONS:
                for n in expert_tensor_names(layer.prefix, e, proj):
                    entries.append((n, layer.source_shard(proj)))
        new_names[layer.prefix] = entries
    anchors = {min(layer.sources, key=list(weight_map).index): layer.prefix for layer in layers}
    dropped = {n for layer in layers for n in layer.sources}
    out: dict[str, str] = {}
    for name, filename in weight_map.items():
        if name in anchors:
            out.update(new_names[anchors[name]])
        if name not in dropped:
            out[name] = filename
    return out


def load_batch(snap: Snapshot, layer: DraftLayerExperts, start: int, stop: int,
               device: torch.device) -> dict[str, torch.Tensor]:
    """``{proj: [b, rows, cols] float32}`` for experts ``[start, stop)``."""
    import torch

    if layer.layout == "fused":
        gate_up = read_rows(*snap.entry(f"{layer.prefix}.gate_up_proj"), start, stop)
        down = read_rows(*snap.entry(f"{layer.prefix}.down_proj"), start, stop)
        gate_up = gate_up.to(device=device, dtype=torch.float32)
        I = layer.intermediate
        # vLLM 0.34.0 splits the fused tensor with chunk(2, dim=1): rows [0, I) are gate (w1),
        # rows [I, 2I) are up (w3).
        return {"gate": gate_up[:, :I], "up": gate_up[:, I:],
                "down": down.to(device=device, dtype=torch.float32)}
    out = {}
    for proj in PROJECTIONS:
        mats = []
        for e in range(start, stop):
            path, entry = snap.entry(f"{layer.prefix}.{e}.{proj}_proj.weight")
            mats.append(read_rows(path, entry, 0, entry.shape[0]))
        out[proj] = torch.stack(mats).to(device=device, dtype=torch.float32)
    return out


def load_router(snap: Snapshot, layer: DraftLayerExperts) -> torch.Tensor:
    """The layer's router ``[num_experts, hidden]`` as float32 (``--calib`` needs it)."""
    import torch

    if layer.router not in snap.weight_map:
        raise FlashnextError(f"needs the MTP router {layer.router}, which the snapshot does not have", field="calib")
    file, entry = snap.entry(layer.router)
    router = read_rows(file, entry, 0, entry.shape[0]).to(torch.float32)
    if tuple(router.shape) != (layer.num_experts, layer.hidden):
        raise FlashnextError(f"{layer.router} has shape {tuple(router.shape)}; expected "
                             f"[{layer.num_experts}, {layer.hidden}]")
    return router
