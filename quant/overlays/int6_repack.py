"""``repack-int6``: INT6 modules to the bit-plane layout (or losslessly to INT8), and back.

Targets are module names matched with ``re.match`` (default: the shared experts). For each target
``M``, ``M.weight_packed`` must be compressed-tensors' dense 6-bit layout (``int32 [N, 6K/32]``,
checked against ``M.weight_shape``); anything else, such as compressed-tensors 0.17's padded 6-bit
layout (5 values per word), is refused. Scales and shapes are unchanged.

* default: ``weight_packed`` becomes the bit-plane bytes (``quant.formats.bitplane``), and config.json's
  ``flashnext.int6_bitplane`` lists the modules and the layout for the serving patch;
* ``--to int8``: ``weight_packed`` becomes 8-bit pack-quantized (q + 128), and a
  compressed-tensors group put first resolves exactly those modules to 8 bits, so stock vLLM serves
  them with its 8-bit Marlin path, at 33% more bytes;
* ``--reverse``: a snapshot with the bit-plane overlay applied goes back to dense 6-bit tensors,
  byte-identical to the original ones.

Bit planes pay only at the shared experts' shapes: everywhere else stock vLLM 0.33.0's own INT6
kernel (Humming) measured faster on the H200 (:data:`MEASURED_SLOWER`), so a bit-plane target list
that reaches another module is refused unless ``force_slower`` (``--force-slower``) is given. The
widening to INT8 and the reverse are not bit planes and are not held to it.

Shards are rewritten under their own names, other tensors copied byte for byte.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from flashnext.errors import FlashnextError, named
from flashnext.progress import Progress
from flashnext.quant.checkpoint.snapshot import CONFIG_FILE, Snapshot
from flashnext.quant.formats.bitplane import (LAYOUT, BitplaneRecord, bitplane_to_dense6, dense6_to_bitplane,
                                              dense6_to_int8)
from flashnext.quant.formats.ct_config import (DEFAULT_INT6_TARGETS, checked_quantization_config, is_compressed_tensors,
                                               quantization_config_of, weight_scheme)
from flashnext.quant.formats.packing import packed_words
from flashnext.quant.formats.safetensors_io import ShardWriter, TensorSpec, read_rows
from flashnext.quant.overlays.builder import OverlayBuilder, OverlayKind

INT8_GROUP = "flashnext_int6_widened_to_int8"
# Where bit planes were measured against the stock kernel (docs/benchmarks.md, "Against stock vLLM's
# kernels"): only the shared experts' shapes came out ahead.
MEASURED_FASTER = DEFAULT_INT6_TARGETS
MEASURED_SLOWER = ("bit planes measured slower than stock vLLM's INT6 kernel (Humming) outside the shared "
                   "experts on the H200: 1.2-1.9x at the attention projections' shapes at 1 and 8 tokens "
                   "(10240x2560: 18.8 against 12.7 us), 2.4x at 16384x16384")
MODES = ("bitplane", "int8", "reverse")


@dataclass(frozen=True)
class Target:
    module: str
    rows: int
    cols: int
    shard: str


def _read(snap: Snapshot, name: str) -> torch.Tensor:
    path, entry = snap.entry(name)
    return read_rows(path, entry, 0, entry.shape[0])


def find_targets(snap: Snapshot, pattern: str, mode: str) -> list[Target]:
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise FlashnextError(f"is not a valid regular expression: {e}", field="targets") from None
    bitplane_modules = set(recorded_bitplane_modules(snap))
    targets = []
    for name in snap.weight_map:
        if not name.endswith(".weight_packed"):
            continue
        module = name[: -len(".weight_packed")]
        if mode == "reverse":
            if module not in bitplane_modules:
                continue
        elif not regex.match(module):
            continue
        if f"{module}.weight_shape" not in snap.weight_map:
            raise FlashnextError(f"{module} has weight_packed but no weight_shape")
        rows, cols = _weight_shape(snap, module)
        _, entry = snap.entry(name)
        if mode == "reverse":
            expected = ("U8", (rows, cols * 3 // 4))
            what = "bit-plane"
        else:
            if module in bitplane_modules:
                raise FlashnextError(f"{module} is already in the bit-plane layout; use {named('reverse')} first")
            expected = ("I32", (rows, packed_words(cols, 6)))
            what = "dense 6-bit"
        if (entry.dtype, entry.shape) != expected:
            hint = " (5 values per word: compressed-tensors 0.17's padded 6-bit layout)" \
                if entry.dtype == "I32" and entry.shape == (rows, -(-cols // 5)) else ""
            raise FlashnextError(f"{name} is {entry.dtype}{list(entry.shape)}, not the {what} layout "
                                 f"{expected[0]}{list(expected[1])} for [{rows}, {cols}]{hint}")
        targets.append(Target(module, rows, cols, snap.weight_map[name]))
    if not targets:
        if mode != "reverse":
            raise FlashnextError(f"{pattern!r}: no module matches it", field="targets")
        raise FlashnextError("this snapshot has no bit-plane modules (config.json lists none) to reverse")
    return targets


def slower_modules(modules: list[str]) -> list[str]:
    """The ``modules`` outside :data:`MEASURED_FASTER`: where bit planes would serve slower than stock."""
    faster = re.compile(MEASURED_FASTER)
    return [m for m in modules if not faster.match(m)]


def refuse_slower(targets: list[Target], mode: str, force_slower: bool) -> None:
    """Raise, in one line, when a bit-plane repack reaches a module measured slower as bit planes."""
    slower = slower_modules([t.module for t in targets]) if mode == "bitplane" else []
    if slower and not force_slower:
        more = f" and {len(slower) - 1} more" if len(slower) > 1 else ""
        raise FlashnextError(f"repacks them anyway: the targets reach {slower[0]}{more}, where {MEASURED_SLOWER}",
                             field="force_slower")


def _new_spec(t: Target, mode: str) -> TensorSpec:
    name = f"{t.module}.weight_packed"
    if mode == "bitplane":
        return TensorSpec(name, "U8", (t.rows, t.cols * 3 // 4))
    if mode == "int8":
        return TensorSpec(name, "I32", (t.rows, packed_words(t.cols, 8)))
    return TensorSpec(name, "I32", (t.rows, packed_words(t.cols, 6)))


def _convert(snap: Snapshot, t: Target, mode: str) -> torch.Tensor:
    data = _read(snap, f"{t.module}.weight_packed")
    if mode == "bitplane":
        return dense6_to_bitplane(data, t.cols)
    if mode == "int8":
        return dense6_to_int8(data, t.cols)
    return bitplane_to_dense6(data, t.cols)


def recorded_bitplane_modules(snap: Snapshot) -> list[str]:
    """The modules config.json's ``flashnext.int6_bitplane`` lists (none when it has no such record)."""
    record = BitplaneRecord.from_config(snap.config, str(snap.root / CONFIG_FILE))
    return [] if record is None else record.modules


def _weight_shape(snap: Snapshot, module: str) -> tuple[int, int]:
    """``M.weight_shape``: two positive integers, the dense matrix's [rows, cols]."""
    name = f"{module}.weight_shape"
    path, entry = snap.entry(name)
    if entry.dtype not in ("I64", "I32") or entry.shape != (2,):
        raise FlashnextError(f"{path}: {name} is {entry.dtype}{list(entry.shape)}, not an integer [2]")
    rows, cols = (int(v) for v in _read(snap, name).tolist())
    if rows <= 0 or cols <= 0:
        raise FlashnextError(f"{path}: {name} is [{rows}, {cols}]; both must be positive")
    return rows, cols


def _group_size(snap: Snapshot, module: str) -> int:
    path, entry = snap.entry(f"{module}.weight_scale")
    rows, cols = _weight_shape(snap, module)
    if len(entry.shape) != 2 or entry.shape[0] != rows or entry.shape[1] <= 0 or cols % entry.shape[1]:
        raise FlashnextError(f"{path}: {module}.weight_scale is {list(entry.shape)}, which is no group "
                             f"scaling of [{rows}, {cols}]")
    return cols // entry.shape[1]


def _new_config(snap: Snapshot, targets: list[Target], mode: str) -> dict:
    config = copy.deepcopy(snap.config)
    modules = [t.module for t in targets]
    if mode == "bitplane":
        BitplaneRecord(layout=LAYOUT, modules=modules).into(config)
    elif mode == "reverse":
        BitplaneRecord.remove_from(config)
    else:
        qc = quantization_config_of(config)
        if not is_compressed_tensors(qc):
            raise FlashnextError("int8 needs a compressed-tensors quantization_config in config.json", field="to")
        checked_quantization_config(qc, str(snap.root / CONFIG_FILE))
        sizes = {_group_size(snap, m) for m in modules}
        if len(sizes) != 1:
            raise FlashnextError(f"the targets mix group sizes {sorted(sizes)}; widen them in separate runs")
        groups = qc.get("config_groups") or {}
        if INT8_GROUP in groups:
            raise FlashnextError(f"config.json already has {INT8_GROUP}: widen from the original snapshot")
        qc["config_groups"] = {INT8_GROUP: weight_scheme(modules, 8, sizes.pop()), **groups}
    return config


KINDS = {"bitplane": OverlayKind("int6-bitplane"), "int8": OverlayKind("int6-to-int8"),
         "reverse": OverlayKind("int6-dense")}


class Int6Repack(OverlayBuilder):
    """INT6 modules to the bit-plane layout, widened to INT8, or back to dense 6-bit."""

    kinds = tuple(KINDS.values())
    tool = "repack-int6"

    def __init__(self, snap: Snapshot, targets: str = DEFAULT_INT6_TARGETS, mode: str = "bitplane",
                 force_slower: bool = False):
        if mode not in MODES:
            raise FlashnextError(f"unknown mode {mode!r}")
        super().__init__(snap)
        self.mode = mode
        self.found = find_targets(snap, targets, mode)
        refuse_slower(self.found, mode, force_slower)
        self.by_shard: dict[str, dict[str, Target]] = {}
        for t in self.found:
            self.by_shard.setdefault(t.shard, {})[f"{t.module}.weight_packed"] = t

    @property
    def kind(self) -> str:
        return KINDS[self.mode].name

    def plan(self) -> dict[str, list[TensorSpec]]:
        return {filename: [_new_spec(replaced[s.name], self.mode) if s.name in replaced else s
                           for s in self.snap.header(filename).specs_in_file_order()]
                for filename, replaced in self.by_shard.items()}

    def rewritten(self) -> set[str]:
        return {name for replaced in self.by_shard.values() for name in replaced}

    def fill(self, writers: dict[str, ShardWriter], progress: bool) -> None:
        # Over the bytes of the tensors converted here; those copied unchanged (OverlayBuilder.build,
        # before fill) are not on the bar.
        sizes = {name: self.snap.entry(name)[1].nbytes for replaced in self.by_shard.values() for name in replaced}
        with Progress(sum(sizes.values()), progress, self.tool) as bar:
            for filename, replaced in self.by_shard.items():
                for name, target in replaced.items():
                    writers[filename].write(name, _convert(self.snap, target, self.mode))
                    bar.update(sizes[name])

    def new_config(self) -> dict:
        return _new_config(self.snap, self.found, self.mode)

    def report(self) -> dict:
        shards = list(self.by_shard)
        before = sum(self.snap.header(f).file_size for f in shards)
        return {"tool": self.tool, "mode": self.mode, "layout": LAYOUT if self.mode == "bitplane" else None,
                "modules": [t.module for t in self.found], "shards": shards, "bytes_before": before}


def repack_int6(src: Path, out: Path, targets: str = DEFAULT_INT6_TARGETS, mode: str = "bitplane",
                force: bool = False, progress: bool = False, force_slower: bool = False) -> dict:
    """Build the INT6 overlay ``out`` from snapshot ``src`` (never modified). Returns the report."""
    report = Int6Repack(Snapshot.open(src), targets, mode, force_slower).build(out, force=force, progress=progress)
    report["bytes_after"] = report["bytes_written"]
    return report
