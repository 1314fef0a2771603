"""``flashnext ple build --format nvfp4|fp8``: the PLE table as an overlay that vLLM 0.34.0's own
PLE methods read, small enough for host memory.

The BF16 table (95.4 GiB for Qwen3.8-Flash-Next) becomes NVFP4 (26.8 GiB: 90 B a row) or FP8
(47.7 GiB) in the layout of :mod:`flashnext.quant.formats.float_rows`, and config.json's text
config gains ``ple_embedding_dtype``, which makes vLLM's ``Qwen4ExpPLEEmbeddingMethod`` pick its
NVFP4 or FP8 method. With engram's ``cpu_offload`` (vLLM's default) the table then sits in pinned
host memory and the GPU gathers its rows through UVA: no file, no page faults, no prefetch.

The build streams each shard in bounded chunks twice: once for the table's largest magnitude (the
global scale), once to quantize and write. Each shard's rewritten file holds, in the base file's
order, every untouched tensor byte for byte and each table shard's ``weight`` with, for NVFP4, its
``weight_scale`` after it; the file of the first shard also takes the table's global scale. The
report gives the relative squared error against the BF16 rows, and for NVFP4 that of plain absmax
block scales over the same rows.

The build is resumable (the skeleton's ``resumable`` mode): after every chunk of the quantize pass
the journal records the bytes written, with their digests, the chunks done and the largest magnitude
their global scale came from. A resume takes none of it on trust (:meth:`PleQuantize.restore`):
every piece's digest is checked against the partial's bytes; each chunk said done must be among
those pieces; the first pass is done again, read-only, and must find the very largest magnitude
(so a written chunk's scale is the table's); and the error sums are not in the journal at all but
recomputed from the source rows and the bytes written. It then quantizes only the chunks not done,
and its overlay and report are those of an uninterrupted build on the same device, byte for byte.
What it still trusts: that bytes whose digest checks out are the encoding of their rows (searching
the block scales again is the build's cost); the report then states the error of the bytes the
overlay holds, whatever they are.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from typing import Callable

import torch

from flashnext.errors import FlashnextError, named
from flashnext.progress import Progress
from flashnext.quant.checkpoint.snapshot import Snapshot, text_config_of
from flashnext.quant.formats import float_rows
from flashnext.quant.formats.safetensors_io import ShardWriter, TensorSpec, read_rows
from flashnext.quant.overlays.builder import OverlayBuilder, OverlayKind
from flashnext.quant.ple.source import PleSource, find_ple_source
from flashnext.quant.quantizers.base import require_finite
from flashnext.quant.records.strict import Count, StrictRecord

KINDS = {"nvfp4": OverlayKind("ple-nvfp4", card_tags=("nvfp4", "ple")),
         "fp8": OverlayKind("ple-fp8", card_tags=("fp8", "ple"))}
CHUNK_ROWS = 1 << 16
# Plain absmax block scales are quantized too, for the report's comparison, on every this-many-th
# chunk: on all of them they would cost a quarter of the build again.
ABSMAX_SAMPLE_EVERY = 8


@dataclass
class _Errors:
    """The report's error sums of one table, over the chunks written, in order."""

    squared: float = 0.0
    reference: float = 0.0
    sample_rows: int = 0
    sample_squared: float = 0.0
    sample_absmax_squared: float = 0.0
    sample_reference: float = 0.0

    def add(self, n: int, rows: torch.Tensor, decoded: torch.Tensor, nvfp4: bool, scale: float) -> None:
        """Chunk ``n``: its BF16 ``rows`` and the rows its written bytes decode to."""
        x = rows.float()
        squared, reference = float(((decoded.float() - x) ** 2).sum()), float((x ** 2).sum())
        self.squared += squared
        self.reference += reference
        if nvfp4 and n % ABSMAX_SAMPLE_EVERY == 0:
            plain = float_rows.nvfp4_decode(*float_rows.nvfp4_encode(rows, scale, search=False), scale)
            self.sample_rows += rows.shape[0]
            self.sample_squared += squared
            self.sample_reference += reference
            self.sample_absmax_squared += float(((plain.float() - x) ** 2).sum())

    @staticmethod
    def _ratio(value: float, reference: float) -> float | None:
        return value / reference if reference > 0 else None

    def as_report(self, nvfp4: bool) -> dict:
        out = {"relative_mse": self._ratio(self.squared, self.reference)}
        if nvfp4:
            out["absmax_comparison"] = {
                "rows": self.sample_rows, "searched": self._ratio(self.sample_squared, self.sample_reference),
                "absmax": self._ratio(self.sample_absmax_squared, self.sample_reference)}
        return out


class _TableProgress(StrictRecord):
    """How far the build of one table got, as the journal holds it (checked by a resume)."""

    chunks: Count = 0  # chunks quantized and written, the first ones in order
    amax: float | None = None  # the table's largest magnitude, which their global scale comes from


def _chunks(source: PleSource):
    for shard in source.shards:
        for start in range(0, shard.rows, CHUNK_ROWS):
            stop = min(shard.rows, start + CHUNK_ROWS)
            yield shard, start, stop


def _chunk_count(source: PleSource) -> int:
    return sum(-(-shard.rows // CHUNK_ROWS) for shard in source.shards)


def _bytes_of_chunks(source: PleSource, chunks: int) -> int:
    """The BF16 bytes of the first ``chunks`` chunks of ``source``."""
    return sum((stop - start) * source.row_elements * 2
               for _, (_, start, stop) in zip(range(chunks), _chunks(source)))


def _block_scales_name(shard) -> str:
    """The NVFP4 block scales' tensor of a table shard's ``weight``."""
    return shard.name.removesuffix(".weight") + ".weight_scale"


def _tables(snap: Snapshot) -> list[PleSource]:
    layers = snap.text_config.get("ple_layer_ids") or []
    tables = [find_ple_source(snap, i) for i in range(len(set(layers)))]
    if not tables:
        raise FlashnextError(f"{snap.root}: config.json has no PLE layers (ple_layer_ids)")
    for table in tables:
        if table.dtype != "BF16":
            raise FlashnextError(f"{table.prefix}: the PLE table is {table.dtype}; {named('fmt')} quantizes a BF16 table "
                                 "(build from the BF16 release)")
        if table.row_elements % float_rows.NVFP4_BLOCK:
            raise FlashnextError(f"{table.prefix}: rows of {table.row_elements} values are not whole blocks of "
                                 f"{float_rows.NVFP4_BLOCK}")
    return tables


class PleQuantize(OverlayBuilder):
    """The BF16 PLE table of every PLE layer as NVFP4 or FP8."""

    kinds = tuple(KINDS.values())
    tool = "flashnext ple build"
    resumable = True

    def __init__(self, snap: Snapshot, fmt: str, device: str = "cpu"):
        from flashnext.quant.quantizers.device import usable_device

        if fmt not in KINDS:
            raise FlashnextError(f"{fmt}: one of bf16, {', '.join(KINDS)}", field="fmt")
        super().__init__(snap)
        self.fmt = fmt
        self.device = usable_device(device)
        self.tables = _tables(snap)
        if snap.text_config.get("ple_embedding_dtype") is not None:
            raise FlashnextError(f"config.json already says ple_embedding_dtype "
                                 f"{snap.text_config['ple_embedding_dtype']!r}: build from the BF16 snapshot")
        self.table_progress = {t.prefix: _TableProgress() for t in self.tables}
        self.errors = {t.prefix: _Errors() for t in self.tables}
        self.scales: dict[str, float] = {}

    @property
    def kind(self) -> str:
        return KINDS[self.fmt].name

    def _scale_name(self, table: PleSource) -> str:
        return f"{table.prefix}.ngram_embedding." + ("weight_scale_2" if self.fmt == "nvfp4" else "weight_scale")

    def _scale(self, amax: float) -> float:
        return float_rows.nvfp4_global_scale(amax) if self.fmt == "nvfp4" else float_rows.fp8_scale(amax)

    def _chunk_parts(self, shard, start: int, stop: int, d: int) -> list[tuple[str, int, int, torch.dtype]]:
        """Where rows ``start:stop`` of ``shard`` go: per tensor written, the offset and length of
        their bytes in it, and the dtype they are read back as."""
        if self.fmt == "nvfp4":
            half, blocks = d // 2, d // float_rows.NVFP4_BLOCK
            return [(shard.name, start * half, (stop - start) * half, torch.uint8),
                    (_block_scales_name(shard), start * blocks, (stop - start) * blocks, torch.float8_e4m3fn)]
        return [(shard.name, start * d, (stop - start) * d, torch.float8_e4m3fn)]

    def _decode(self, parts: list[torch.Tensor], scale: float) -> torch.Tensor:
        if self.fmt == "nvfp4":
            return float_rows.nvfp4_decode(*parts, scale)
        return float_rows.fp8_decode(*parts, scale)

    def _specs(self, shard, d: int) -> list[TensorSpec]:
        if self.fmt == "nvfp4":
            return [TensorSpec(shard.name, "U8", (shard.rows, d // 2)),
                    TensorSpec(_block_scales_name(shard), "F8_E4M3", (shard.rows, d // float_rows.NVFP4_BLOCK))]
        return [TensorSpec(shard.name, "F8_E4M3", (shard.rows, d))]

    def plan(self) -> dict[str, list[TensorSpec]]:
        replaced = {s.name: (t, s) for t in self.tables for s in t.shards}
        files = {self.snap.weight_map[name] for name in replaced}
        plans = {}
        for filename in sorted(files):
            specs = []
            for spec in self.snap.header(filename).specs_in_file_order():
                if spec.name in replaced:
                    table, shard = replaced[spec.name]
                    specs += self._specs(shard, table.row_elements)
                else:
                    specs.append(spec)
            plans[filename] = specs
        for table in self.tables:
            plans[self.snap.weight_map[table.shards[0].name]].append(TensorSpec(self._scale_name(table), "F32", (1,)))
        return plans

    def rewritten(self) -> set[str]:
        return {s.name for t in self.tables for s in t.shards}

    def new_weight_map(self, plans: dict[str, list[TensorSpec]]) -> dict[str, str]:
        weight_map = dict(self.snap.weight_map)
        for filename, specs in plans.items():
            for spec in specs:
                weight_map.setdefault(spec.name, filename)
        return weight_map

    def resume_identity(self) -> dict:
        from flashnext import __version__
        from flashnext.quant.ple.table import source_identity

        snap = self.snap

        def digest(obj) -> str:
            return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()

        # The PLE shards as the bf16 file build pins them (header hash and sampled bytes), the
        # headers of the files rewritten, config.json and the index. The device is not in it: a
        # build begun on a GPU may go on on the CPU.
        return {"source snapshot": {"tables": [source_identity(t) for t in self.tables],
                                    "headers": {f: hashlib.sha256(snap.header(f).header_bytes).hexdigest()
                                                for f in sorted(self.plan())},
                                    "config": digest(snap.config), "index": digest(snap.index)},
                "chunking": {"chunk_rows": CHUNK_ROWS, "absmax_sample_every": ABSMAX_SAMPLE_EVERY},
                "flashnext version": __version__}

    def resume_state(self) -> dict:
        return {prefix: p.model_dump(mode="json") for prefix, p in self.table_progress.items()}

    def restore(self, state: dict, writers: dict[str, ShardWriter], progress: bool) -> None:
        if set(state) != set(self.table_progress):
            raise FlashnextError(f"its journal is of the tables {sorted(state)}, not {sorted(self.table_progress)}")
        claimed = {t.prefix: self._claimed(t, state[t.prefix], writers) for t in self.tables}
        errors = {t.prefix: _Errors() for t in self.tables}
        checked = [t for t in self.tables if claimed[t.prefix].chunks]
        if checked:
            with Progress(sum(s.entry.nbytes for t in checked for s in t.shards), progress,
                          f"{self.tool} --format {self.fmt}: checking the interrupted build") as bar:
                for table in checked:
                    p = claimed[table.prefix]
                    amax = self._first_pass(table, bar.update,
                                            self._error_of_written(table, p, writers, errors[table.prefix]))
                    if amax != p.amax:
                        raise FlashnextError(f"its journal gives {table.prefix} the largest magnitude {p.amax!r}, "
                                             f"its source has {amax!r}")
        self.table_progress, self.errors = claimed, errors

    def _claimed(self, table: PleSource, state, writers: dict[str, ShardWriter]) -> _TableProgress:
        """The journal's progress of ``table``, once each chunk it says is done is among the pieces
        checked; the largest magnitude it gives is the resume's pass to check."""
        from flashnext.quant.records.jsonfile import validate

        p = validate(state, _TableProgress, f"the journal's {table.prefix}")
        n = _chunk_count(table)
        if p.chunks > n or (p.chunks and p.amax is None):
            raise FlashnextError(f"its journal's progress of {table.prefix} does not fit its {n} chunks")
        for k, (shard, start, stop) in zip(range(p.chunks), _chunks(table)):
            writer = writers[self.snap.weight_map[shard.name]]
            parts = self._chunk_parts(shard, start, stop, table.row_elements)
            if not all(writer.holds(tensor, offset, length) for tensor, offset, length, _ in parts):
                raise FlashnextError(f"its journal says {p.chunks} chunks of {table.prefix} were written, but records "
                                     f"no bytes of chunk {k}")
        # Of a build stopped in its first pass nothing is kept: that pass writes nothing to check.
        return p if p.chunks else _TableProgress()

    def _error_of_written(self, table: PleSource, p: _TableProgress, writers: dict[str, ShardWriter],
                          errors: _Errors) -> Callable:
        """What a resume's first pass does with each chunk: one already written is decoded from its
        bytes as the partial holds them, and its error added to ``errors``."""
        scale = self._scale(p.amax)

        def add(n: int, shard, start: int, stop: int, rows: torch.Tensor) -> None:
            if n >= p.chunks:
                return
            writer = writers[self.snap.weight_map[shard.name]]
            parts = [torch.frombuffer(writer.read_bytes(tensor, offset, length), dtype=torch.uint8)
                     .view(dtype).view(stop - start, -1).to(self.device)
                     for tensor, offset, length, dtype in self._chunk_parts(shard, start, stop, table.row_elements)]
            errors.add(n, rows, self._decode(parts, scale), self.fmt == "nvfp4", scale)

        return add

    def _first_pass(self, table: PleSource, advance: Callable[[int], None],
                    each: Callable | None = None) -> float:
        """The table's largest magnitude, read chunk by chunk (each also handed to ``each``)."""
        amax = 0.0
        for n, (shard, start, stop) in enumerate(_chunks(table)):
            rows = read_rows(shard.path, shard.entry, start, stop).to(self.device)
            require_finite(rows, f"{table.prefix} ({shard.path.name})", (start,))
            if rows.numel():
                amax = max(amax, float(rows.float().abs().max()))
            if each is not None:
                each(n, shard, start, stop, rows)
            advance(rows.numel() * 2)
        return amax

    def fill(self, writers: dict[str, ShardWriter], progress: bool) -> None:
        total = 2 * sum(s.entry.nbytes for t in self.tables for s in t.shards)
        # A resume did the first pass of each table it found chunks of, as it checked them.
        done = sum(_bytes_of_chunks(t, _chunk_count(t)) + _bytes_of_chunks(t, self.table_progress[t.prefix].chunks)
                   for t in self.tables if self.table_progress[t.prefix].chunks)
        with Progress(total, progress, f"{self.tool} --format {self.fmt}", initial=done) as bar:
            for table in self.tables:
                state = self.table_progress[table.prefix]
                if state.amax is None:
                    state.amax = self._first_pass(table, bar.update)
                self._write_table(table, writers, bar)

    def _write_table(self, table: PleSource, writers: dict[str, ShardWriter], bar) -> None:
        state = self.table_progress[table.prefix]
        scale = self.scales[table.prefix] = self._scale(state.amax)
        for n, (shard, start, stop) in enumerate(_chunks(table)):
            if n < state.chunks:
                continue
            rows = read_rows(shard.path, shard.entry, start, stop).to(self.device)
            if self.fmt == "nvfp4":
                parts = list(float_rows.nvfp4_encode(rows, scale))
            else:
                parts = [float_rows.fp8_encode(rows, scale)]
            writer = writers[self.snap.weight_map[shard.name]]
            for (tensor, offset, _, _), part in zip(self._chunk_parts(shard, start, stop, table.row_elements), parts):
                writer.write_bytes(tensor, part.view(torch.uint8).cpu().numpy().tobytes(), offset)
            self.errors[table.prefix].add(n, rows, self._decode(parts, scale), self.fmt == "nvfp4", scale)
            state.chunks = n + 1
            bar.update(rows.numel() * 2)
            self.checkpoint()
        # Written again by a resumed build whose chunks were all done: the same four bytes.
        writers[self.snap.weight_map[table.shards[0].name]].write(
            self._scale_name(table), torch.tensor([scale], dtype=torch.float32))

    def new_config(self) -> dict:
        config = copy.deepcopy(self.snap.config)
        text_config_of(config)["ple_embedding_dtype"] = float_rows.FORMATS[self.fmt]
        return config

    def report(self) -> dict:
        tables = []
        for t in self.tables:
            tables.append({"prefix": t.prefix, "rows": t.layout.padded_rows, "row_elements": t.row_elements,
                           "global_scale": self.scales.get(t.prefix),
                           **self.errors[t.prefix].as_report(self.fmt == "nvfp4")})
        return {"tool": self.tool, "format": self.fmt, "ple_embedding_dtype": float_rows.FORMATS[self.fmt],
                "device": str(self.device),
                "block_scales": "least squared error per block of 16" if self.fmt == "nvfp4" else None,
                "tables": tables}

    @classmethod
    def card_section(cls, report: dict) -> list[str]:
        lines = [f"## The PLE table as {report.get('format', '?').upper()}", "",
                 f"`ple_embedding_dtype: {report.get('ple_embedding_dtype')}`: vLLM 0.34.0's own PLE method reads it; "
                 "with engram's `cpu_offload` the table sits in pinned host memory.", ""]
        for t in report.get("tables", []):
            error = t.get("relative_mse")
            lines.append(f"- `{t['prefix']}`: {t['rows']:,} rows, relative squared error against BF16 {error:.3e}"
                         if error is not None else f"- `{t['prefix']}`")
        return lines


_PLE_PART = r"^(?P<table>.*ple\.ple_embedding\.ngram_embedding)\.shard_\d+\.(?P<part>weight|weight_scale)$"


def quantized_table_allocations(model: Snapshot) -> list[int]:
    """The bytes of each tensor vLLM's NVFP4 or FP8 method allocates for the quantized PLE tables that
    ``model`` serves (per table: its ``weight``, and for NVFP4 its ``weight_scale``), from the
    safetensors headers of the files that serve them: ``model`` is what vLLM loads, a view opened as
    a snapshot or a stack of overlays merged in memory
    (:attr:`~flashnext.quant.overlays.view.OverlayStack.served`)."""
    import re

    part = re.compile(_PLE_PART)
    sizes: dict[tuple[str, str], int] = {}
    for name in model.weight_map:
        m = part.match(name)
        if m:
            key = (m["table"], m["part"])
            sizes[key] = sizes.get(key, 0) + model.entry(name)[1].nbytes
    if not sizes:
        raise FlashnextError(f"{model.root}: config.json says the PLE table is quantized, but no PLE table tensors "
                             "were found")
    return [sizes[key] for key in sorted(sizes)]


def quantize_ple_table(src, out, fmt: str, force: bool = False, progress: bool = False, device: str = "cpu") -> dict:
    """Build the ``fmt`` PLE overlay ``out`` from snapshot ``src`` (never modified). Returns the report.

    >>> report = quantize_ple_table(Path("snapshot"), Path("ple-nvfp4"), "nvfp4")   # doctest: +SKIP
    >>> report["tables"][0]["relative_mse"]
    """
    return PleQuantize(Snapshot.open(src), fmt, device).build(out, force=force, progress=progress)
