"""``TABLE.json``, the sidecar that vouches for a PLE table file: how it was built, from what, and
sha256 of every shard and of every 16 MiB block of each, so that ``ple verify`` can sample.

One record, one home: ``ple build`` writes it through :meth:`Sidecar.from_source`, ``ple verify``
reads it back through :func:`read_sidecar`, and the preflight asks :meth:`Sidecar.matches` whether
a snapshot is the one the table was built from, all three over the same :class:`Sidecar`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from flashnext import __version__
from flashnext.errors import FlashnextError
from flashnext.quant.formats.safetensors_io import DTYPE_BYTES
from flashnext.quant.ple.layout import INT64_MAX
from flashnext.quant.ple.source import PleSource
from flashnext.quant.records.jsonfile import parse_json, read_json, validate, validation_message
from flashnext.quant.records.strict import BuilderInfo, Count, Sha256, StrictRecord

FORMAT = "flashnext.ple-table/1"
BLOCK_BYTES = 16 << 20
BUILDER = "flashnext ple build"


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


class SourceRecord(StrictRecord):
    path: str
    repo_id: str | None
    revision: str | None


class FileStat(StrictRecord):
    """The table file as it was when written: a later write or copy changes it."""

    size: Count
    mtime_ns: Count
    inode: Count


@dataclass(frozen=True)
class CopyStats:
    """What the copy produced: every shard's hashes in index order, and the finished file's stat."""

    shards: list[SidecarShard]
    table: os.stat_result


# What decides whether a table serves a snapshot: its place (the decoder layer), the bytes' shape
# (dtype, rows, row width) and the hash's parameters that fix which row is which head's
# (multipliers, head sizes). The EOS id and the head offsets change which row a token reads, not
# the bytes, so a table stays good across them; the bytes themselves are ``ple verify``'s.
MATCHED = ("layer", "dtype", "rows", "row_elements", "row_bytes")
MATCHED_LAYOUT = ("multipliers", "head_sizes")


class Sidecar(StrictRecord):
    """``TABLE.json``: how the table file was built, with a hash per 16 MiB block."""

    format: Literal["flashnext.ple-table/1"]
    builder: BuilderInfo
    source: SourceRecord
    layer: Count
    dense_layer_id: Count
    dtype: Literal["BF16", "F8_E4M3"]
    # What every FP8 row is multiplied by: -0, 0 or a negative value would serve nonsense.
    scale: Annotated[float, Field(gt=0)] | None
    rows: Count
    row_elements: Annotated[int, Field(gt=0)]
    row_bytes: Annotated[int, Field(gt=0)]
    file_size: Count
    block_bytes: Annotated[int, Field(gt=0)]
    layout: SidecarLayout
    differences: list[str]
    shards: list[SidecarShard]
    table_stat: FileStat | None = None

    @classmethod
    def not_this_record(cls, data: Any) -> str | None:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return f"not a {FORMAT} sidecar"
        return None

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

    @classmethod
    def from_source(cls, source: PleSource, stats: CopyStats | None, where: str = "the sidecar") -> "Sidecar":
        """The sidecar of a table built from ``source``; without ``stats`` (before the copy) it has
        no shard hashes and no file stat yet. What it would refuse on reading is refused here, in
        one line naming ``where``."""
        snap, layout = source.snapshot, source.layout
        try:
            return cls(
                format=FORMAT, builder=BuilderInfo(name=BUILDER, version=__version__),
                source=SourceRecord(path=str(snap.root.absolute()), repo_id=snap.origin.repo_id,
                                    revision=snap.origin.revision),
                layer=source.layer, dense_layer_id=source.dense_layer_id, dtype=source.dtype, scale=source.scale,
                rows=layout.padded_rows, row_elements=source.row_elements, row_bytes=source.row_bytes,
                file_size=source.file_size, block_bytes=BLOCK_BYTES,
                layout=SidecarLayout(
                    vocab_size=layout.vocab_size, ngram_size=layout.ngram_size,
                    heads_per_ngram=layout.heads_per_ngram, multipliers=list(layout.multipliers),
                    head_sizes=list(layout.head_sizes), head_offsets=list(layout.head_offsets), rows=layout.rows,
                    padded_rows=layout.padded_rows, split_parts=layout.split_parts,
                    eos_token_id=layout.eos_token_id),
                differences=list(source.differences),
                shards=[] if stats is None else list(stats.shards),
                table_stat=None if stats is None else FileStat(size=stats.table.st_size,
                                                               mtime_ns=stats.table.st_mtime_ns,
                                                               inode=stats.table.st_ino))
        except ValidationError as e:
            raise FlashnextError(validation_message(e, where)) from None

    def mismatches(self, source: PleSource) -> list[str]:
        """The fields (of :data:`MATCHED` and ``layout.`` :data:`MATCHED_LAYOUT`) in which this
        table differs from one built from ``source`` now."""
        fresh = Sidecar.from_source(source, None)
        return ([k for k in MATCHED if getattr(self, k) != getattr(fresh, k)]
                + [f"layout.{k}" for k in MATCHED_LAYOUT if getattr(self.layout, k) != getattr(fresh.layout, k)])

    def matches(self, source: PleSource) -> bool:
        """Whether the table serves the snapshot ``source`` was found in (see :data:`MATCHED`)."""
        return not self.mismatches(source)

    def text(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=1) + "\n"


def sidecar_path(table: Path) -> Path:
    return table.with_name(table.name + ".json")


def check_sidecar(data: Any, path: Path) -> Sidecar:
    """A sidecar document as ``ple verify`` and the preflight take it; ``ple build`` puts what it is
    about to write through this too, so that it never writes a sidecar they refuse."""
    return validate(data, Sidecar, str(path))


def checked_text(sidecar: Sidecar, path: Path) -> str:
    """``sidecar`` as it will be written at ``path``, once it reads back as :func:`read_sidecar`
    reads it (what Python holds and JSON cannot, an integer past a double's range in a float
    field, is caught here and not by the reader)."""
    text = sidecar.text()
    check_sidecar(parse_json(text, str(path)), path)
    return text


def read_sidecar(table: Path) -> Sidecar:
    path = sidecar_path(Path(table))
    if not path.exists():
        raise FlashnextError(f"{path} is missing: was {table} made by `flashnext ple build`?")
    return check_sidecar(read_json(path, "a PLE table sidecar"), path)
