"""Building and verifying the PLE table file that the patched vLLM maps (``VLLM_PLE_MMAP_PATH``).

The file is the checkpoint's ``ngram_embedding.shard_{i}.weight`` tensors concatenated in index
order: a raw C-contiguous ``[padded_rows, row_elements]`` array in the storage dtype, no header,
exactly ``padded_rows * row_bytes`` bytes, so row ``r`` sits at byte ``r * row_bytes`` (320-byte
BF16 rows straddle 4 KiB pages). Where the shards come from is ``source.py``'s; what vouches for
the file, the sidecar ``FILE.json``, is ``sidecar.py``'s.

``build`` streams shard by shard with bounded memory, fsyncs each shard, and keeps a journal
(``FILE.partial.json``) so that an interrupted build resumes at the first unfinished shard. A resume
hashes again the partial's bytes of each shard the journal says is done: each must be a shard of the
source and hash exactly as recorded (a bit flipped or a block zeroed since, a hash edited, a shard
claimed that was never copied: it starts over, saying why in one line). What it still trusts: that
bytes hashing as recorded are the source's (a copy is as dear as checking that; the source itself is
pinned by the sampled identity below, as for the overlay builds). The
output rules (the lock, leftovers, ``--force`` only over a table flashnext made, the rename) are
``fsutil.atomic_file``'s, the same as every writer's; only the journal and the resumable partial,
which no other output has, are this module's.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import stat
import time
from pathlib import Path
from typing import Any, Callable, Literal

from flashnext.errors import FlashnextError, VerificationMismatch, named
from flashnext.progress import Progress
from flashnext.quant.checkpoint.fsutil import (HeldDirectory, OutputFile, atomic_file, check_free_space, refuse_overlap,
                                               remove_stale_lock, write_text_at)
from flashnext.quant.checkpoint.snapshot import Snapshot
from flashnext.quant.formats.safetensors_io import copy_tensor_bytes, header_sha256
from flashnext.quant.overlays.resume import notice_on_stderr, starting_over
from flashnext.quant.ple.sidecar import (BLOCK_BYTES, BUILDER, CopyStats, Sidecar, SidecarShard, checked_text,
                                         read_sidecar, sidecar_path)
from flashnext.quant.ple.source import PleSource, TableShard, find_ple_source
from flashnext.quant.records.inputs import open_regular
from flashnext.quant.records.jsonfile import parse_json, validate
from flashnext.quant.records.strict import PartialIdentity, StrictRecord

__all__ = ["build_table", "verify_table", "find_ple_source", "read_sidecar", "sidecar_path"]

JOURNAL_FORMAT = "flashnext.ple-table-journal/1"
COPY_CHUNK = 64 << 20


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


def source_identity(source: PleSource) -> list:
    """What an interrupted build may resume against: each shard's name, dtype and shape, its file's
    safetensors header hash and a sampled hash of its bytes."""
    return [[s.index, s.name, s.entry.dtype, list(s.entry.shape), header_sha256(s.path), _content_sample(s)]
            for s in source.shards]


class _BlockHashes:
    """sha256 of a shard's bytes as a whole and of each :data:`BLOCK_BYTES` block, fed chunk by chunk."""

    def __init__(self):
        self.whole = hashlib.sha256()
        self.blocks: list[str] = []
        self._block = hashlib.sha256()
        self._in_block = 0

    def update(self, data: memoryview) -> None:
        self.whole.update(data)
        pos = 0
        while pos < len(data):
            take = min(BLOCK_BYTES - self._in_block, len(data) - pos)
            self._block.update(data[pos:pos + take])
            self._in_block += take
            pos += take
            if self._in_block == BLOCK_BYTES:
                self.blocks.append(self._block.hexdigest())
                self._block, self._in_block = hashlib.sha256(), 0

    def block_hashes(self) -> list[str]:
        return self.blocks + ([self._block.hexdigest()] if self._in_block else [])

    def record(self, shard: TableShard) -> SidecarShard:
        """The sidecar's (and the journal's) record of ``shard`` with these hashes."""
        return SidecarShard(index=shard.index, name=shard.name, first_row=shard.first_row, rows=shard.rows,
                            sha256=self.whole.hexdigest(), block_sha256=self.block_hashes())


class _TableWriter:
    """The table file as ``copy_tensor_bytes`` writes into it: a tensor's bytes land at its first row."""

    def __init__(self, fd: int, at: int):
        self.fd, self.at = fd, at

    def write_bytes(self, name: str, data, offset: int = 0) -> None:
        view = memoryview(data)
        written = 0
        while written < len(view):
            written += os.pwrite(self.fd, view[written:], self.at + offset + written)


def _copy_shard(shard: TableShard, fd: int, row_bytes: int, progress) -> SidecarShard:
    """Copy one shard into the table file at its rows; returns its hashes."""
    hashes = _BlockHashes()

    def copied(data: memoryview) -> None:
        hashes.update(data)
        progress(len(data))

    copy_tensor_bytes(shard.path, shard.entry, _TableWriter(fd, shard.first_row * row_bytes), COPY_CHUNK,
                      on_chunk=copied)
    os.fsync(fd)
    return hashes.record(shard)


def _held_shard(fd: int, shard: TableShard, row_bytes: int) -> SidecarShard:
    """The record of ``shard`` as the partial table ``fd`` holds its rows now."""
    hashes = _BlockHashes()
    begin, end = shard.first_row * row_bytes, (shard.first_row + shard.rows) * row_bytes
    for at in range(begin, end, COPY_CHUNK):
        hashes.update(memoryview(os.pread(fd, min(COPY_CHUNK, end - at), at)))
    return hashes.record(shard)


def _unheld(fd: int, source: PleSource, shards: dict[int, SidecarShard]) -> str | None:
    """Why the partial table ``fd`` does not hold the shards its journal says it does; None: it does."""
    by_index = {s.index: s for s in source.shards}
    for index, recorded in sorted(shards.items()):
        if index not in by_index:
            return f"its journal names a shard {index}, which the source does not have"
        if _held_shard(fd, by_index[index], source.row_bytes) != recorded:
            return f"its shard {index} ({by_index[index].name}) is not what its journal recorded"
    return None


def _flashnext_table(out: Path) -> bool:
    try:
        read_sidecar(out)
    except FlashnextError:
        return False
    return True


class BuildJournal(StrictRecord):
    """``OUT.journal``, beside the partial table of an interrupted ``ple build``: the source it was
    built from, the partial file, and the shards already in it (keyed by shard index, as JSON keys)."""

    format: Literal["flashnext.ple-table-journal/1"]
    source: list[list[Any]]
    partial: PartialIdentity | None
    shards: dict[str, SidecarShard]

    @classmethod
    def not_this_record(cls, data: Any) -> str | None:
        if not isinstance(data, dict) or data.get("format") != JOURNAL_FORMAT:
            return f"not a {JOURNAL_FORMAT} journal"
        return None


def _file_identity(fd: int) -> PartialIdentity:
    st = os.fstat(fd)
    return PartialIdentity(dev=st.st_dev, inode=st.st_ino)


def _start_over(parent: HeldDirectory, partial: Path) -> tuple[None, dict[int, SidecarShard]]:
    """Discard an interrupted build: only the partial's name goes (what a link points at is untouched)."""
    try:
        os.unlink(partial.name, dir_fd=parent.fd)
    except FileNotFoundError:
        pass
    return None, {}


def _resume(parent: HeldDirectory, out: Path, source: PleSource, identity: list, force: bool,
            notice: Callable[[str], None]) -> tuple[int | None, dict[int, SidecarShard]]:
    """The partial file an interrupted build of ``out`` left, opened for writing, and the shards it
    already holds; (None, {}) to start over. It resumes only a build from this very source, into the
    very file that build created (the journal has its device and inode; a regular file with one
    link). A build from another source, a damaged journal, or a partial that is not the journal's
    (a link to a source shard, a swapped file) is refused and never written; ``force`` starts over
    instead. The very partial whose bytes are not the shards the journal says it holds starts over,
    after one line to ``notice``."""
    partial, journal_path = _partial_path(out), _journal_path(out)
    if parent.lstat(journal_path.name) is None:
        if parent.lstat(partial.name) is not None:
            raise FlashnextError(f"{partial} exists but is no interrupted flashnext build (no {journal_path.name}); "
                                 f"remove it or choose another {named('out')}")
        return None, {}
    if parent.lstat(partial.name) is None:
        return None, {}
    try:
        journal = validate(parse_json(parent.read_regular(journal_path.name), str(journal_path)), BuildJournal,
                           str(journal_path))
        shards = {int(k): shard for k, shard in journal.shards.items()}
    except (FlashnextError, ValueError, OSError) as e:
        if force:
            return _start_over(parent, partial)
        raise FlashnextError(f"{journal_path} is damaged ({e}); pass {named('force')} to start over") from None
    if journal.source != identity:
        if force:
            return _start_over(parent, partial)
        raise FlashnextError(f"{partial} is an interrupted build from a different source (the PLE shards changed "
                             f"since); pass {named('force')} to start over")
    recorded = journal.partial
    try:
        fd = os.open(partial.name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent.fd)
    except OSError:
        fd = None  # a link (O_NOFOLLOW), or nothing this process may write
    if fd is not None:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and recorded == _file_identity(fd):
            why = _unheld(fd, source, shards)
            if why is None:
                return fd, shards
            os.close(fd)
            notice(starting_over(partial, why))
            return _start_over(parent, partial)
        os.close(fd)
    if force or (recorded is None and not shards):  # killed before the partial was recorded: none of it is ours
        return _start_over(parent, partial)
    raise FlashnextError(f"{partial} is not the partial file this build created (a link, or replaced since); "
                         f"flashnext will not write into it: remove it, or pass {named('force')} to start over")


def _sidecar(source: PleSource, stats: CopyStats | None, out: Path) -> tuple[Sidecar, str]:
    """The sidecar of ``out`` and its text as it will be written, once it reads back as ``ple
    verify`` reads it."""
    try:
        sidecar = Sidecar.from_source(source, stats, str(sidecar_path(out)))
        return sidecar, checked_text(sidecar, sidecar_path(out))
    except FlashnextError as e:
        raise FlashnextError(f"ple build wrote nothing to {out}: its sidecar would be refused when read back "
                             f"({e})") from None


def build_table(src: Path, out: Path, dense_layer_id: int = 0, force: bool = False,
                progress: bool = True, notice: Callable[[str], None] = notice_on_stderr) -> dict:
    """Write the table file ``out`` and its sidecar from snapshot ``src``; resumes an interrupted
    build from the same source (``notice`` takes the line it says when it cannot). Only one build of
    ``out`` runs at a time."""
    snap = Snapshot.open(src)
    source = find_ple_source(snap, dense_layer_id)
    out = Path(out).absolute()
    # All of the sidecar but the hashes is known now: what ple verify would refuse costs nothing yet.
    _sidecar(source, None, out)
    inputs = {"the source snapshot": snap.root}
    refuse_overlap(out, inputs)  # first: an --out inside the snapshot is refused as that, not as an existing file
    if out.exists() and not out.is_dir() and not force:
        size = out.stat().st_size
        what = "has the right size" if size == source.file_size else \
            f"is {size} bytes, not the {source.file_size} this table needs"
        remove_stale_lock(out)
        raise FlashnextError(f"{out} already exists and {what}; pass {named('force')} to rebuild it")
    with atomic_file(out, force, inputs, is_ours=_flashnext_table,
                     maker=f"`{BUILDER}` (no valid {sidecar_path(out).name})",
                     companions=(sidecar_path(out), _journal_path(out)), what="the table file") as output:
        return _build_locked(snap, source, output, force, progress, notice)


def _build_locked(snap: Snapshot, source: PleSource, output: OutputFile, force: bool, progress: bool,
                  notice: Callable[[str], None]) -> dict:
    # Every name below is opened, created, renamed and removed through the held parent: swapping
    # the output's folder, or any name in it, for a link afterwards changes nothing.
    out, parent = output.path, output.parent
    table = output.through()
    if sidecar_path(table).exists() and not table.exists():
        try:
            read_sidecar(table)
        except FlashnextError:
            raise FlashnextError(f"{sidecar_path(out)} exists and is not a flashnext sidecar; remove it or "
                                 f"choose another {named('out')}") from None
    partial, journal_path = _partial_path(out), _journal_path(out)
    identity = source_identity(source)
    fd, done = _resume(parent, out, source, identity, force, notice)
    bar = None

    def journal_text() -> str:
        return BuildJournal(format=JOURNAL_FORMAT, source=identity, partial=None if fd is None else _file_identity(fd),
                            shards={str(i): s for i, s in done.items()}).model_dump_json()

    try:
        allocated = 0 if fd is None else os.fstat(fd).st_blocks * 512
        check_free_space(out.parent, max(0, source.file_size - allocated), f"the PLE table {out}")
        if fd is None:
            # The journal first, so that a partial always has its journal; then the partial, created
            # exclusively, whose device and inode a resume must find again.
            write_text_at(parent, journal_path.name, journal_text())
            fd = output.create(partial.name)
        write_text_at(parent, journal_path.name, journal_text())
        total = sum(s.entry.nbytes for s in source.shards)
        bar = Progress(total, progress, "ple build",
                       initial=sum(s.entry.nbytes for s in source.shards if s.index in done))
        os.ftruncate(fd, source.file_size)
        for shard in source.shards:
            if shard.index in done:
                continue
            done[shard.index] = _copy_shard(shard, fd, source.row_bytes, bar.update)
            write_text_at(parent, journal_path.name, journal_text())
        os.fsync(fd)
        st = os.fstat(fd)
    finally:
        if fd is not None:
            os.close(fd)
        if bar is not None:
            bar.close()
    stats = CopyStats([done[s.index] for s in source.shards], st)
    try:
        snap.check_unchanged()
    except FlashnextError:
        # Copied from a source that changed meanwhile: no part of this partial is worth resuming.
        _start_over(parent, partial)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(journal_path.name, dir_fd=parent.fd)
        raise
    sidecar, text = _sidecar(source, stats, out)
    output.check(partial.name, st)
    # The sidecar goes first: a table file never exists without the sidecar that vouches for it.
    write_text_at(parent, sidecar_path(out).name, text)
    try:
        output.commit(partial.name, st)
    finally:
        # Once the partial is the table (the rename done, even if its fsync then failed), its journal
        # records a partial that is gone: it must not be left beside the finished table.
        if parent.lstat(partial.name) is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(journal_path.name, dir_fd=parent.fd)
    return {"dtype": sidecar.dtype, "scale": sidecar.scale, "rows": sidecar.rows, "row_bytes": sidecar.row_bytes,
            "file_size": sidecar.file_size, "differences": sidecar.differences,
            "path": str(out), "sidecar": str(sidecar_path(out)), "shards": len(source.shards)}


def _open_table(table: Path):
    """The table file opened for ``ple verify``, refused unless it is a regular file."""
    try:
        return open_regular(table, "a PLE table file", buffering=0)
    except (FileNotFoundError, IsADirectoryError):
        raise FlashnextError(f"{table}: no such table file") from None


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
        raise VerificationMismatch(f"{table}: the file is {size} bytes; its layout needs exactly {sidecar.file_size}",
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
