"""The PLE table file that the patched vLLM maps (``VLLM_PLE_MMAP_PATH``).

The file is the checkpoint's ``ngram_embedding.shard_{i}.weight`` tensors concatenated in index
order: a raw C-contiguous ``[padded_rows, row_elements]`` array in the storage dtype, no header,
exactly ``padded_rows * row_bytes`` bytes, so row ``r`` sits at byte ``r * row_bytes`` (320-byte
BF16 rows straddle 4 KiB pages). A JSON sidecar ``FILE.json`` records the layout, the dtype (and
the FP8 global scale), and sha256 of every shard and of every 16 MiB block of each shard, so that
``verify`` can sample.

``build`` streams shard by shard with bounded memory, fsyncs each shard, and keeps a journal
(``FILE.partial.json``) so that an interrupted build resumes at the first unfinished shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from flashnext import __version__
from flashnext.quant.errors import FlashnextError
from flashnext.quant.fsutil import check_free_space, write_text_atomic
from flashnext.quant.ple_layout import PleLayout, ple_layout
from flashnext.quant.safetensors_io import DTYPE_BYTES, TORCH_DTYPES, TensorEntry, read_rows
from flashnext.quant.snapshot import Snapshot

FORMAT = "flashnext.ple-table/1"
BLOCK_BYTES = 16 << 20
COPY_CHUNK = 64 << 20
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
    try:
        layer_ids = sorted(set(int(i) for i in tc["ple_layer_ids"]))
        formula = ple_layout(tc, dense_layer_id)
    except KeyError as e:
        raise FlashnextError(f"{snap.root / 'config.json'}: text config lacks {e.args[0]}; not a PLE model") from None
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
        divisor = int(tc.get("make_ngram_vocab_size_divisible_by", 1))
        layout = replace(formula, **overrides, rows=rows, padded_rows=-(-rows // divisor) * divisor)

    parts = layout.split_parts
    extra = sorted(i for i in found if i >= parts)
    if extra:
        raise FlashnextError(f"{snap.root}: extra PLE shard {found[extra[0]][0]}: config.json has split_ngram_parts={parts}")
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
            raise FlashnextError(f"{name} has shape {list(entry.shape)}; config.json implies "
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
        scale = _scalar(*snap.entry(scale_name))
    return PleSource(layer, dense_layer_id, prefix, layout, dtype, layout.head_dim, shards, scale, differences)


def _scalar(path: Path, entry: TensorEntry) -> float:
    """The first element of a (usually 0-d or 1-element) tensor."""
    with open(path, "rb") as f:
        f.seek(entry.begin)
        data = bytearray(f.read(entry.nbytes))
    return float(torch.frombuffer(data, dtype=TORCH_DTYPES[entry.dtype]).float()[0])


def sidecar_path(table: Path) -> Path:
    return table.with_name(table.name + ".json")


def _journal_path(table: Path) -> Path:
    return table.with_name(table.name + ".partial.json")


def _partial_path(table: Path) -> Path:
    return table.with_name(table.name + ".partial")


def _source_identity(source: PleSource) -> list:
    return [[s.index, s.name, s.entry.dtype, list(s.entry.shape), s.path.stat().st_size] for s in source.shards]


def _copy_shard(shard: TableShard, fd: int, row_bytes: int, progress) -> dict:
    """Copy one shard into the table file at its rows; returns its hashes."""
    whole = hashlib.sha256()
    blocks: list[str] = []
    block = hashlib.sha256()
    in_block = 0
    at = shard.first_row * row_bytes
    with open(shard.path, "rb", buffering=0) as src:
        done = 0
        while done < shard.entry.nbytes:
            data = os.pread(src.fileno(), min(COPY_CHUNK, shard.entry.nbytes - done), shard.entry.begin + done)
            if not data:
                raise FlashnextError(f"{shard.path}: truncated inside {shard.name}")
            view = memoryview(data)
            written = 0
            while written < len(view):
                written += os.pwrite(fd, view[written:], at + done + written)
            whole.update(data)
            pos = 0
            while pos < len(data):
                take = min(BLOCK_BYTES - in_block, len(data) - pos)
                block.update(view[pos:pos + take])
                in_block += take
                pos += take
                if in_block == BLOCK_BYTES:
                    blocks.append(block.hexdigest())
                    block, in_block = hashlib.sha256(), 0
            done += len(data)
            progress(len(data))
    if in_block:
        blocks.append(block.hexdigest())
    os.fsync(fd)
    return {"index": shard.index, "name": shard.name, "first_row": shard.first_row, "rows": shard.rows,
            "sha256": whole.hexdigest(), "block_sha256": blocks}


def build_table(src: Path, out: Path, dense_layer_id: int = 0, force: bool = False,
                progress: bool = True) -> dict:
    """Write the table file ``out`` and its sidecar from snapshot ``src``; resumes an interrupted build."""
    snap = Snapshot.open(src)
    source = find_ple_source(snap, dense_layer_id)
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and not force:
        size = out.stat().st_size
        what = "has the right size" if size == source.file_size else \
            f"is {size} bytes, not the {source.file_size} this table needs"
        raise FlashnextError(f"{out} already exists and {what}; pass --force to rebuild it")
    partial, journal_path = _partial_path(out), _journal_path(out)
    identity = _source_identity(source)
    done: dict[int, dict] = {}
    if partial.exists() and journal_path.exists():
        journal = json.loads(journal_path.read_text())
        if journal.get("source") == identity and partial.stat().st_size == source.file_size:
            done = {int(k): v for k, v in journal["shards"].items()}
    if not done:
        partial.unlink(missing_ok=True)
    remaining = sum(s.entry.nbytes for s in source.shards if s.index not in done)
    check_free_space(out.parent, remaining if partial.exists() else source.file_size, f"the PLE table {out}")

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=remaining, unit="B", unit_scale=True, desc="ple build", leave=False)
    fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, source.file_size)
        for shard in source.shards:
            if shard.index in done:
                continue
            done[shard.index] = _copy_shard(shard, fd, source.row_bytes, bar.update if bar else lambda n: None)
            write_text_atomic(journal_path, json.dumps({"source": identity, "shards": done}))
        os.fsync(fd)
    finally:
        os.close(fd)
        if bar is not None:
            bar.close()
    sidecar = {
        "format": FORMAT,
        "builder": {"name": "flashnext ple build", "version": __version__},
        "source": {"path": str(snap.root.absolute()), "repo_id": snap.origin.repo_id,
                   "revision": snap.origin.revision},
        "layer": source.layer, "dense_layer_id": source.dense_layer_id,
        "dtype": source.dtype, "scale": source.scale,
        "rows": source.layout.padded_rows, "row_elements": source.row_elements,
        "row_bytes": source.row_bytes, "file_size": source.file_size, "block_bytes": BLOCK_BYTES,
        "layout": {"vocab_size": source.layout.vocab_size, "ngram_size": source.layout.ngram_size,
                   "heads_per_ngram": source.layout.heads_per_ngram,
                   "multipliers": list(source.layout.multipliers),
                   "head_sizes": list(source.layout.head_sizes),
                   "head_offsets": list(source.layout.head_offsets),
                   "rows": source.layout.rows, "padded_rows": source.layout.padded_rows,
                   "split_parts": source.layout.split_parts, "eos_token_id": source.layout.eos_token_id},
        "differences": source.differences,
        "shards": [done[s.index] for s in source.shards],
    }
    os.replace(partial, out)
    write_text_atomic(sidecar_path(out), json.dumps(sidecar, indent=1) + "\n")
    journal_path.unlink(missing_ok=True)
    return {k: sidecar[k] for k in ("dtype", "scale", "rows", "row_bytes", "file_size", "differences")} | {
        "path": str(out), "sidecar": str(sidecar_path(out)), "shards": len(source.shards)}


def read_sidecar(table: Path) -> dict:
    path = sidecar_path(Path(table))
    try:
        sidecar = json.loads(path.read_text())
    except FileNotFoundError:
        raise FlashnextError(f"{path} is missing: was {table} made by `flashnext ple build`?") from None
    if sidecar.get("format") != FORMAT:
        raise FlashnextError(f"{path}: not a {FORMAT} sidecar")
    return sidecar


def verify_table(table: Path, full: bool = False, samples: int = 16, seed: int | None = None) -> dict:
    """Check size and hashes: ``samples`` random 16 MiB blocks (plus each end), or every byte."""
    table = Path(table)
    sidecar = read_sidecar(table)
    if not table.is_file():
        raise FlashnextError(f"{table}: no such table file")
    size = table.stat().st_size
    expected = sidecar["rows"] * sidecar["row_bytes"]
    if size != expected or sidecar["file_size"] != expected:
        raise FlashnextError(f"{table} is {size} bytes; its layout needs exactly {expected}")
    blocks = [(i, b) for i, s in enumerate(sidecar["shards"]) for b in range(len(s["block_sha256"]))]
    if full:
        chosen = blocks
    else:
        rng = random.Random(seed)
        chosen = sorted(set([blocks[0], blocks[-1]] + rng.sample(blocks, min(samples, len(blocks)))))
    row_bytes, block = sidecar["row_bytes"], sidecar["block_bytes"]
    checked = 0
    with open(table, "rb", buffering=0) as f:
        for i, b in chosen:
            shard = sidecar["shards"][i]
            start = shard["first_row"] * row_bytes + b * block
            length = min(block, shard["rows"] * row_bytes - b * block)
            data = os.pread(f.fileno(), length, start)
            if hashlib.sha256(data).hexdigest() != shard["block_sha256"][b]:
                raise FlashnextError(f"{table}: shard {shard['index']} ({shard['name']}) differs from its "
                                     f"source in bytes {start}..{start + length} (block {b})")
            checked += length
    return {"path": str(table), "ok": True, "mode": "full" if full else "sampled",
            "bytes_checked": checked, "file_size": size}
