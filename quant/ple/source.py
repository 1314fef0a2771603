"""Where a snapshot keeps one PLE layer's table, checked against its config.

The table lives in the checkpoint as ``…layers.N.ple.ple_embedding.ngram_embedding.shard_K.weight``
tensors; config.json says how many rows each must have (the layout formula of ``layout.py``). A
checkpoint may also carry the hash's buffers (multipliers, head sizes and offsets): vLLM uses those
over the formula, so the table file is laid out by them too, and each difference is recorded. Kept
apart from the build so that the preflight and ``ple ids`` can read a source without writing.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from flashnext.errors import FlashnextError
from flashnext.quant.checkpoint.snapshot import CONFIG_FILE, Snapshot
from flashnext.quant.formats.safetensors_io import DTYPE_BYTES, TensorEntry, read_rows, torch_dtypes
from flashnext.quant.ple.layout import PleLayout, ple_layout
from flashnext.quant.records.inputs import open_regular
from flashnext.quant.records.jsonfile import get_int

TABLE_DTYPES = ("BF16", "F8_E4M3")
_SHARD = re.compile(r"^(?P<prefix>.*layers\.(?P<layer>\d+)\.ple\.ple_embedding)\.ngram_embedding\.shard_(?P<index>\d+)\.weight$")


@dataclass
class TableShard:
    index: int
    name: str
    path: Path
    entry: TensorEntry
    first_row: int
    rows: int


@dataclass
class PleSource:
    """The PLE table of one PLE layer in a snapshot, validated against config.json."""

    snapshot: Snapshot = field(compare=False, repr=False)
    layer: int
    dense_layer_id: int
    prefix: str
    layout: PleLayout
    dtype: str
    row_elements: int
    shards: list[TableShard]
    scale: float | None = None
    differences: list[str] = field(default_factory=list)

    @property
    def row_bytes(self) -> int:
        return self.row_elements * DTYPE_BYTES[self.dtype]

    @property
    def file_size(self) -> int:
        return self.layout.padded_rows * self.row_bytes


def _read_buffer(snap: Snapshot, name: str) -> list[int] | None:
    if name not in snap.weight_map:
        return None
    path, entry = snap.entry(name)
    return [int(v) for v in read_rows(path, entry, 0, entry.shape[0]).reshape(-1).tolist()]


def find_ple_source(snap: Snapshot, dense_layer_id: int = 0) -> PleSource:
    """Locate the table of PLE layer ``dense_layer_id`` and check it against the config."""
    tc = snap.text_config
    where = f"{snap.root / CONFIG_FILE}: text config"
    ids = tc.get("ple_layer_ids")
    if ids is None:
        raise FlashnextError(f"{where} lacks ple_layer_ids; not a PLE model")
    if not isinstance(ids, list) or not all(type(i) is int and i >= 1 for i in ids):
        raise FlashnextError(f"{where}: ple_layer_ids must be a list of positive integers")
    layer_ids = sorted(set(ids))
    quantized = tc.get("ple_embedding_dtype")
    if quantized is not None:
        raise FlashnextError(f"{where} says ple_embedding_dtype {quantized!r}: the table is quantized for vLLM's own "
                             "PLE methods (`flashnext ple build --format`); table files and their checks take the "
                             "BF16 snapshot")
    formula = ple_layout(tc, dense_layer_id, where)
    if dense_layer_id >= len(layer_ids):
        raise FlashnextError(f"PLE layer {dense_layer_id} does not exist: ple_layer_ids is {layer_ids}")
    layer = layer_ids[dense_layer_id] - 1  # ple_layer_ids is 1-based
    found: dict[int, tuple[str, str]] = {}
    prefix = None
    for name in snap.weight_map:
        m = _SHARD.match(name)
        if m and int(m["layer"]) == layer:
            found[int(m["index"])] = (name, m["prefix"])
            prefix = m["prefix"]
    if not found:
        raise FlashnextError(f"{snap.root}: no PLE table shards for decoder layer {layer} "
                             "(…layers.N.ple.ple_embedding.ngram_embedding.shard_K.weight)")

    layout, differences = formula, []
    overrides = {}
    for field_name, attr in (("layer_multipliers", "multipliers"), ("ngram_heads_vocab_sizes", "head_sizes"),
                             ("ngram_heads_offsets", "head_offsets")):
        values = _read_buffer(snap, f"{prefix}.{field_name}")
        if values is None:
            continue
        expected = list(getattr(formula, attr))
        if len(values) != len(expected):
            raise FlashnextError(f"{prefix}.{field_name} has {len(values)} values, config implies {len(expected)}")
        if values != expected:
            differences.append(f"{field_name}: checkpoint {values} differs from the formula {expected}; "
                               "the checkpoint's values are used, as vLLM uses them")
        overrides[attr] = tuple(values)
    if overrides:
        sizes = overrides.get("head_sizes", formula.head_sizes)
        rows = sum(sizes)
        divisor = get_int(tc, "make_ngram_vocab_size_divisible_by", where, minimum=1, default=1)
        layout = replace(formula, **overrides, rows=rows, padded_rows=-(-rows // divisor) * divisor)

    parts = layout.split_parts
    extra = sorted(i for i in found if i >= parts)
    if extra:
        raise FlashnextError(f"{snap.root}: extra PLE shard {found[extra[0]][0]}: {CONFIG_FILE} has split_ngram_parts={parts}")
    shards: list[TableShard] = []
    dtypes: set[str] = set()
    for i in range(parts):
        begin, end = layout.shard_range(i)
        if i not in found:
            if end > begin:
                raise FlashnextError(f"{snap.root}: PLE shard {prefix}.ngram_embedding.shard_{i}.weight is missing")
            continue
        name = found[i][0]
        path, entry = snap.entry(name)
        if len(entry.shape) != 2 or entry.shape[0] != end - begin or entry.shape[1] != layout.head_dim:
            raise FlashnextError(f"{name} has shape {list(entry.shape)}; {CONFIG_FILE} implies "
                                 f"[{end - begin}, {layout.head_dim}]")
        dtypes.add(entry.dtype)
        shards.append(TableShard(i, name, path, entry, begin, end - begin))
    if len(dtypes) > 1:
        raise FlashnextError(f"{snap.root}: PLE shards have mixed dtypes {sorted(dtypes)}")
    dtype = dtypes.pop()
    if dtype not in TABLE_DTYPES:
        raise FlashnextError(f"PLE shards are {dtype}: the table file supports {', '.join(TABLE_DTYPES)}")
    scale = None
    if dtype == "F8_E4M3":
        scale_name = f"{prefix}.ngram_embedding.weight_scale"
        if scale_name not in snap.weight_map:
            raise FlashnextError(f"FP8 PLE shards need their global scale {scale_name}, which is missing")
        scale = _global_scale(scale_name, *snap.entry(scale_name))
    return PleSource(snap, layer, dense_layer_id, prefix, layout, dtype, layout.head_dim, shards, scale, differences)


SCALE_DTYPES = ("F32", "BF16", "F16", "F64")


def _global_scale(name: str, path: Path, entry: TensorEntry) -> float:
    """The FP8 table's global scale: one finite, positive floating-point value."""
    if entry.dtype not in SCALE_DTYPES:
        raise FlashnextError(f"{path}: {name} is {entry.dtype}; the FP8 PLE table's global scale is a "
                             f"floating-point value ({', '.join(SCALE_DTYPES)})")
    if math.prod(entry.shape) != 1:
        raise FlashnextError(f"{path}: {name} has shape {list(entry.shape)}; the FP8 PLE table's global scale "
                             "is one value")
    with open_regular(path, "a safetensors shard") as f:
        f.seek(entry.begin)
        data = bytearray(f.read(entry.nbytes))
    if len(data) != entry.nbytes:
        raise FlashnextError(f"{path}: truncated inside tensor {name}")
    import torch

    value = float(torch.frombuffer(data, dtype=torch_dtypes()[entry.dtype]).float()[0])
    if not value > 0 or not math.isfinite(value):
        raise FlashnextError(f"{path}: {name} is {value!r}; the FP8 PLE table's global scale must be finite "
                             "and positive")
    return value
