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

import contextlib
import hashlib
import json
import math
import os
import random
import re
import stat
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from flashnext import __version__
from flashnext.errors import FlashnextError, VerificationMismatch
from flashnext.progress import Progress
from flashnext.quant.checkpoint.fsutil import (HeldDirectory, check_free_space, make_parents, output_lock,
                                               refuse_overlap, refuse_overlap_open, remove_empty, remove_leftovers,
                                               write_text_at)
from flashnext.quant.records.inputs import open_regular
from flashnext.quant.records.jsonfile import get_int, parse_json, read_json, validate
from flashnext.quant.records.strict import Count, Sha256, StrictRecord
from flashnext.quant.overlays.manifest import header_sha256
from flashnext.quant.ple.layout import INT64_MAX, PleLayout, ple_layout
from flashnext.quant.formats.safetensors_io import DTYPE_BYTES, TensorEntry, read_rows, torch_dtypes
from flashnext.quant.checkpoint.snapshot import Snapshot

FORMAT = "flashnext.ple-table/1"
JOURNAL_FORMAT = "flashnext.ple-table-journal/1"
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
    where = f"{snap.root / 'config.json'}: text config"
    ids = tc.get("ple_layer_ids")
    if ids is None:
        raise FlashnextError(f"{where} lacks ple_layer_ids; not a PLE model")
    if not isinstance(ids, list) or not all(type(i) is int and i >= 1 for i in ids):
        raise FlashnextError(f"{where}: ple_layer_ids must be a list of positive integers")
    layer_ids = sorted(set(ids))
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
        scale = _global_scale(scale_name, *snap.entry(scale_name))
    return PleSource(layer, dense_layer_id, prefix, layout, dtype, layout.head_dim, shards, scale, differences)


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


class SidecarShard(StrictRecord):
    index: Count
    name: str
    first_row: Count
    rows: Count
    sha256: Sha256
    block_sha256: list[Sha256]


class SidecarLayout(StrictRecord):
    vocab_size: Count
    ngram_size: Count
    heads_per_ngram: Count
    multipliers: list[int]
    head_sizes: list[Count]
    head_offsets: list[Count]
    rows: Count
    padded_rows: Count
    split_parts: Count
    eos_token_id: Annotated[int, Field(ge=0, le=INT64_MAX)]


class Builder(StrictRecord):
    name: str
    version: str


class SourceRecord(StrictRecord):
    path: str
    repo_id: str | None
    revision: str | None


class FileStat(StrictRecord):
    """The table file as it was when written: a later write or copy changes it."""

    size: Count
    mtime_ns: Count
    inode: Count


class Sidecar(StrictRecord):
    """``TABLE.json``: how the table file was built, with a hash per 16 MiB block."""

    format: Literal["flashnext.ple-table/1"]
    builder: Builder
    source: SourceRecord
    layer: Count
    dense_layer_id: Count
    dtype: Literal["BF16", "F8_E4M3"]
    # What every FP8 row is multiplied by: -0, 0 or a negative value would serve nonsense.
    scale: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None
    rows: Count
    row_elements: Annotated[int, Field(gt=0)]
    row_bytes: Annotated[int, Field(gt=0)]
    file_size: Count
    block_bytes: Annotated[int, Field(gt=0)]
    layout: SidecarLayout
    differences: list[str]
    shards: list[SidecarShard]
    table_stat: FileStat | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "Sidecar":
        if (self.dtype == "F8_E4M3") != (self.scale is not None):
            raise ValueError("scale: an F8_E4M3 table needs its global scale" if self.scale is None
                             else "scale: a BF16 table has no global scale (null)")
        if self.row_bytes != self.row_elements * DTYPE_BYTES[self.dtype]:
            raise ValueError(f"row_bytes {self.row_bytes} is not row_elements x {self.dtype}")
        if self.file_size != self.rows * self.row_bytes:
            raise ValueError(f"file_size {self.file_size} is not rows x row_bytes")
        for shard in self.shards:
            if shard.first_row + shard.rows > self.rows:
                raise ValueError(f"shard {shard.index} ends past row {self.rows}")
            blocks = -(-shard.rows * self.row_bytes // self.block_bytes)
            if len(shard.block_sha256) != blocks:
                raise ValueError(f"shard {shard.index} has {len(shard.block_sha256)} block hashes, not {blocks}")
        return self


def sidecar_path(table: Path) -> Path:
    return table.with_name(table.name + ".json")


def _journal_path(table: Path) -> Path:
    return table.with_name(table.name + ".partial.json")


def _partial_path(table: Path) -> Path:
    return table.with_name(table.name + ".partial")


IDENTITY_SAMPLES = 16
IDENTITY_SAMPLE_BYTES = 64 << 10


def _content_sample(shard: TableShard) -> str:
    """sha256 of 64 KiB at 16 evenly spaced places of a shard's bytes, and of its last 64 KiB."""
    digest = hashlib.sha256()
    n = shard.entry.nbytes
    starts = sorted({min(n, i * n // IDENTITY_SAMPLES) for i in range(IDENTITY_SAMPLES)}
                    | {max(0, n - IDENTITY_SAMPLE_BYTES)})
    with open_regular(shard.path, "a safetensors shard", buffering=0) as f:
        for start in starts:
            digest.update(os.pread(f.fileno(), min(IDENTITY_SAMPLE_BYTES, n - start), shard.entry.begin + start))
    return digest.hexdigest()


def _source_identity(source: PleSource) -> list:
    """What an interrupted build may resume against: each shard's name, dtype and shape, its file's
    safetensors header hash and a sampled hash of its bytes."""
    return [[s.index, s.name, s.entry.dtype, list(s.entry.shape), header_sha256(s.path), _content_sample(s)]
            for s in source.shards]


def _copy_shard(shard: TableShard, fd: int, row_bytes: int, progress) -> dict:
    """Copy one shard into the table file at its rows; returns its hashes."""
    whole = hashlib.sha256()
    blocks: list[str] = []
    block = hashlib.sha256()
    in_block = 0
    at = shard.first_row * row_bytes
    with open_regular(shard.path, "a safetensors shard", buffering=0) as src:
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


def _flashnext_table(out: Path) -> bool:
    try:
        read_sidecar(out)
    except FlashnextError:
        return False
    return True


def _read_entry(parent: HeldDirectory, name: str) -> bytes:
    """The bytes of the regular file ``name`` in ``parent``, never through a link."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent.fd)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FlashnextError(f"{parent.path / name} is not a regular file")
        return f.read()


def _file_identity(fd: int) -> dict:
    st = os.fstat(fd)
    return {"dev": st.st_dev, "inode": st.st_ino}


def _start_over(parent: HeldDirectory, partial: Path) -> tuple[None, dict]:
    """Discard an interrupted build: only the partial's name goes (what a link points at is untouched)."""
    try:
        os.unlink(partial.name, dir_fd=parent.fd)
    except FileNotFoundError:
        pass
    return None, {}


def _resume(parent: HeldDirectory, out: Path, identity: list, force: bool) -> tuple[int | None, dict[int, dict]]:
    """The partial file an interrupted build of ``out`` left, opened for writing, and the shards it
    already holds; (None, {}) to start over. It resumes only a build from this very source, into the
    very file that build created (the journal has its device and inode; a regular file with one
    link). A build from another source, a damaged journal, or a partial that is not the journal's
    (a link to a source shard, a swapped file) is refused and never written; ``force`` starts over
    instead."""
    partial, journal_path = _partial_path(out), _journal_path(out)
    if parent.lstat(journal_path.name) is None:
        if parent.lstat(partial.name) is not None:
            raise FlashnextError(f"{partial} exists but is no interrupted flashnext build (no {journal_path.name}); "
                                 "remove it or choose another --out")
        return None, {}
    if parent.lstat(partial.name) is None:
        return None, {}
    try:
        journal = parse_json(_read_entry(parent, journal_path.name), str(journal_path))
        if (not isinstance(journal, dict) or journal.get("format") != JOURNAL_FORMAT
                or not isinstance(journal.get("shards"), dict)):
            raise FlashnextError(f"{journal_path}: not a {JOURNAL_FORMAT} journal")
        shards = {int(k): validate(v, SidecarShard, str(journal_path)).model_dump()
                  for k, v in journal["shards"].items()}
    except (FlashnextError, ValueError, OSError) as e:
        if force:
            return _start_over(parent, partial)
        raise FlashnextError(f"{journal_path} is damaged ({e}); pass --force to start over") from None
    if journal.get("source") != identity:
        if force:
            return _start_over(parent, partial)
        raise FlashnextError(f"{partial} is an interrupted build from a different source (the PLE shards changed "
                             "since); pass --force to start over")
    recorded = journal.get("partial")
    try:
        fd = os.open(partial.name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent.fd)
    except OSError:
        fd = None  # a link (O_NOFOLLOW), or nothing this process may write
    if fd is not None:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and recorded == _file_identity(fd):
            return fd, shards
        os.close(fd)
    if force or (recorded is None and not shards):  # killed before the partial was recorded: none of it is ours
        return _start_over(parent, partial)
    raise FlashnextError(f"{partial} is not the partial file this build created (a link, or replaced since); "
                         "flashnext will not write into it: remove it, or pass --force to start over")


def build_table(src: Path, out: Path, dense_layer_id: int = 0, force: bool = False,
                progress: bool = True) -> dict:
    """Write the table file ``out`` and its sidecar from snapshot ``src``; resumes an interrupted
    build from the same source. Only one build of ``out`` runs at a time."""
    snap = Snapshot.open(src)
    source = find_ple_source(snap, dense_layer_id)
    out = Path(out).absolute()
    # All of the sidecar but the hashes is known now: what ple verify would refuse costs nothing yet.
    _checked_sidecar_text(_sidecar_document(snap, source, [], None), out)
    refuse_overlap(out, {"the source snapshot": snap.root})
    if out.is_dir():
        raise FlashnextError(f"{out} is a directory; --out names the table file to write")
    created = make_parents(out)
    try:
        with output_lock(out) as parent:
            return _build_locked(snap, source, out, parent, force, progress)
    except BaseException:
        remove_empty(created)
        raise


def _build_locked(snap: Snapshot, source: PleSource, out: Path, parent: HeldDirectory, force: bool,
                  progress: bool) -> dict:
    # Every name below is opened, created, renamed and removed through ``parent``, held since the
    # lock: swapping the output's folder, or any name in it, for a link afterwards changes nothing.
    inputs = {"the source snapshot": snap.root}
    refuse_overlap_open(parent, out.name, inputs)
    for sibling in (out, sidecar_path(out), _journal_path(out)):
        remove_leftovers(sibling, parent)
    table = parent.through(out.name)
    if table.exists() and not force:
        size = table.stat().st_size
        what = "has the right size" if size == source.file_size else \
            f"is {size} bytes, not the {source.file_size} this table needs"
        raise FlashnextError(f"{out} already exists and {what}; pass --force to rebuild it")
    if (table.exists() or table.is_symlink()) and not _flashnext_table(table):
        raise FlashnextError(f"{out} exists and was not made by `flashnext ple build` (no valid {sidecar_path(out).name}); "
                             "--force only replaces flashnext's own table: remove it yourself or choose another --out")
    if sidecar_path(table).exists() and not table.exists():
        try:
            read_sidecar(table)
        except FlashnextError:
            raise FlashnextError(f"{sidecar_path(out)} exists and is not a flashnext sidecar; remove it or "
                                 "choose another --out") from None
    partial, journal_path = _partial_path(out), _journal_path(out)
    identity = _source_identity(source)
    fd, done = _resume(parent, out, identity, force)
    bar = None
    try:
        allocated = 0 if fd is None else os.fstat(fd).st_blocks * 512
        check_free_space(out.parent, max(0, source.file_size - allocated), f"the PLE table {out}")
        journal = {"format": JOURNAL_FORMAT, "source": identity, "partial": None, "shards": done}
        if fd is None:
            # The journal first, so that a partial always has its journal; then the partial, created
            # exclusively, whose device and inode a resume must find again.
            write_text_at(parent, journal_path.name, json.dumps(journal))
            fd = parent.create(partial.name, os.O_RDWR)
        journal["partial"] = _file_identity(fd)
        write_text_at(parent, journal_path.name, json.dumps(journal))
        remaining = sum(s.entry.nbytes for s in source.shards if s.index not in done)
        bar = Progress(remaining, progress, "ple build")
        os.ftruncate(fd, source.file_size)
        for shard in source.shards:
            if shard.index in done:
                continue
            done[shard.index] = _copy_shard(shard, fd, source.row_bytes, bar.update)
            write_text_at(parent, journal_path.name, json.dumps(journal))
        os.fsync(fd)
        st = os.fstat(fd)
    finally:
        if fd is not None:
            os.close(fd)
        if bar is not None:
            bar.close()
    sidecar = _sidecar_document(snap, source, [done[s.index] for s in source.shards], st)
    try:
        snap.check_unchanged()
    except FlashnextError:
        # Copied from a source that changed meanwhile: no part of this partial is worth resuming.
        _start_over(parent, partial)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(journal_path.name, dir_fd=parent.fd)
        raise
    _still_the_partial(parent, partial, st)
    refuse_overlap_open(parent, out.name, inputs)
    # The sidecar goes first: a table file never exists without the sidecar that vouches for it.
    write_text_at(parent, sidecar_path(out).name, _checked_sidecar_text(sidecar, out))
    _still_the_partial(parent, partial, st)
    parent.rename(partial.name, out.name)
    os.fsync(parent.fd)
    try:
        os.unlink(journal_path.name, dir_fd=parent.fd)
    except FileNotFoundError:
        pass
    return {k: sidecar[k] for k in ("dtype", "scale", "rows", "row_bytes", "file_size", "differences")} | {
        "path": str(out), "sidecar": str(sidecar_path(out)), "shards": len(source.shards)}


def _still_the_partial(parent: HeldDirectory, partial: Path, st: os.stat_result) -> None:
    """The name about to be renamed is still the file this build wrote (not one swapped in)."""
    if not parent.holds(partial.name, (st.st_dev, st.st_ino)):
        raise FlashnextError(f"{partial} was replaced while the table was being written (is someone else writing "
                             "in that folder?); nothing was written to the table: run again")


def _sidecar_document(snap: Snapshot, source: PleSource, shards: list[dict], st: os.stat_result | None) -> dict:
    return {
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
        "shards": shards,
        "table_stat": None if st is None else {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                              "inode": st.st_ino},
    }


def _checked_sidecar_text(document: dict, out: Path) -> str:
    """The sidecar of ``out`` as it will be written, once it reads back as ``ple verify`` reads it."""
    text = json.dumps(document, indent=1) + "\n"
    try:
        check_sidecar(parse_json(text, str(sidecar_path(out))), sidecar_path(out))
    except FlashnextError as e:
        raise FlashnextError(f"ple build wrote nothing to {out}: its sidecar would be refused when read back "
                             f"({e})") from None
    return text


def read_sidecar(table: Path) -> Sidecar:
    path = sidecar_path(Path(table))
    if not path.exists():
        raise FlashnextError(f"{path} is missing: was {table} made by `flashnext ple build`?")
    return check_sidecar(read_json(path, "a PLE table sidecar"), path)


def _open_table(table: Path):
    """The table file opened for ``ple verify``, refused unless it is a regular file."""
    try:
        return open_regular(table, "a PLE table file", buffering=0)
    except (FileNotFoundError, IsADirectoryError):
        raise FlashnextError(f"{table}: no such table file") from None


def check_sidecar(data: dict, path: Path) -> Sidecar:
    """A sidecar document as ``ple verify`` and the preflight take it; ``ple build`` puts what it is
    about to write through this too, so that it never writes a sidecar they refuse."""
    if data.get("format") != FORMAT:
        raise FlashnextError(f"{path}: not a {FORMAT} sidecar")
    return validate(data, Sidecar, str(path))


def verify_table(table: Path, full: bool = False, samples: int = 16, seed: int | None = None,
                 seconds: float | None = None, progress: bool = False) -> dict:
    """Check size and hashes against the sidecar: every byte (``full``, with a bar of the bytes
    hashed when ``progress``); or, with a time budget ``seconds``, random 16 MiB blocks (both ends
    first) until the budget is spent; or else ``samples`` random blocks plus both ends. The result
    says how much was covered."""
    table = Path(table)
    sidecar = read_sidecar(table)
    with _open_table(table) as f:
        size = os.fstat(f.fileno()).st_size
    if size != sidecar.file_size:
        raise VerificationMismatch(f"{table} is {size} bytes; its layout needs exactly {sidecar.file_size}",
                                   printed=False)
    blocks = [(i, b) for i, s in enumerate(sidecar.shards) for b in range(len(s.block_sha256))]
    rng = random.Random(seed)
    if full:
        chosen = blocks
    elif seconds is not None:
        chosen = blocks[:1] + blocks[-1:] + rng.sample(blocks[1:-1], max(0, len(blocks) - 2))
    else:
        chosen = sorted(set(blocks[:1] + blocks[-1:] + rng.sample(blocks, min(samples, len(blocks)))))
    row_bytes, block = sidecar.row_bytes, sidecar.block_bytes
    checked = 0
    started = time.monotonic()

    def block_length(i: int, b: int) -> int:
        return min(block, sidecar.shards[i].rows * row_bytes - b * block)

    # Only --full has a bar: it reads the whole table (95 GiB for the real model); a sample, at most
    # 18 blocks.
    with _open_table(table) as f, \
            Progress(sum(block_length(i, b) for i, b in chosen), full and progress, "ple verify") as bar:
        for n, (i, b) in enumerate(chosen):
            if seconds is not None and n >= 2 and time.monotonic() - started > seconds:
                break
            shard = sidecar.shards[i]
            start = shard.first_row * row_bytes + b * block
            length = block_length(i, b)
            data = os.pread(f.fileno(), length, start)
            if hashlib.sha256(data).hexdigest() != shard.block_sha256[b]:
                raise VerificationMismatch(f"{table}: shard {shard.index} ({shard.name}) differs from its "
                                           f"source in bytes {start}..{start + length} (block {b})", printed=False)
            checked += length
            bar.update(length)
    elapsed = time.monotonic() - started
    hashed = sum(block_length(i, b) for i, b in blocks)
    st = table.stat()
    stat = sidecar.table_stat
    return {"path": str(table), "ok": True, "mode": "full" if full else "sampled",
            "bytes_checked": checked, "bytes_hashed_in_sidecar": hashed, "file_size": size,
            "coverage": checked / hashed if hashed else 1.0, "seconds": round(elapsed, 3),
            "unchanged_since_build": None if stat is None else
            (stat.size, stat.mtime_ns, stat.inode) == (st.st_size, st.st_mtime_ns, st.st_ino)}
