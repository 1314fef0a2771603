"""Reading safetensors headers and writing shards whose tensors arrive one at a time.

The on-disk format: an 8-byte little-endian header length, a JSON header mapping each tensor name
to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the
header) plus an optional ``"__metadata__"`` of strings, then the tensor bytes back to back.

:class:`ShardWriter` lays the header out up front from the tensors' specs and then accepts each
tensor's bytes in any order (``pwrite`` at its offset), so a shard can be produced while only one
batch of tensors is in memory. It records each piece it writes (:class:`WrittenBytes`), with its
sha256 for a resumable build's journal, and a shard reopened to go on is checked against those
digests first.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import os
import stat
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from flashnext.errors import FlashnextError
from flashnext.quant.records.inputs import FileIdentity, check_still, check_unchanged, open_regular
from flashnext.quant.records.jsonfile import parse_json

if TYPE_CHECKING:
    import torch

HEADER_LIMIT = 100 * 1024 * 1024
DTYPE_BYTES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8, "C64": 8,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as a safetensors header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int
    # The version of the file whose header this entry came from: its bytes are read only from that.
    source: FileIdentity | None = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    header_bytes: bytes  # the raw length prefix and JSON, for hashing
    identity: FileIdentity | None = field(default=None, compare=False, repr=False)

    @property
    def file_size(self) -> int:
        return max((e.end for e in self.entries.values()), default=self.data_start)

    def check_unchanged(self) -> None:
        """The file is still the version this header was read from: an output made from it calls
        this just before its final rename, so that a rewrite after the last read is caught too."""
        if self.identity is not None:
            check_unchanged(self.path, self.identity)

    def specs_in_file_order(self) -> list["TensorSpec"]:
        """Every tensor's spec, in the order its bytes lie in the file."""
        return [TensorSpec(e.name, e.dtype, e.shape) for e in sorted(self.entries.values(), key=lambda e: e.begin)]


def read_header(path: Path) -> ShardHeader:
    """Parse and validate a safetensors file's header as the safetensors library does: a JSON
    object (no duplicate names) of known dtypes and non-negative integer shapes, whose data offsets
    tile the data section from 0 to the end of the file with no gap or overlap, each tensor's byte
    count matching its shape; ``__metadata__`` maps strings to strings. Anything else is a
    :class:`FlashnextError` naming the file and the tensor."""
    path = Path(path)
    try:
        with open_regular(path, "a safetensors file") as f:
            opened = FileIdentity.of_open(f)
            prefix = f.read(8)
            if len(prefix) != 8:
                raise FlashnextError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", prefix)
            if length > HEADER_LIMIT:
                raise FlashnextError(f"{path}: safetensors header of {length} bytes is implausible")
            raw = f.read(length)
            check_still(f, opened, path)
            size = opened.size
    except FileNotFoundError:
        raise FlashnextError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise FlashnextError(f"{path}: is a directory, not a safetensors file") from None
    if len(raw) != length:
        raise FlashnextError(f"{path}: truncated safetensors header")
    if not raw.startswith(b"{"):
        raise FlashnextError(f"{path}: safetensors header does not start with '{{'")
    header = parse_json(raw, f"{path}: safetensors header")
    if not isinstance(header, dict):
        raise FlashnextError(f"{path}: safetensors header is not a JSON object")
    data_start = 8 + length
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise FlashnextError(f"{path}: __metadata__ must map strings to strings")
    entries = {}
    for name, info in header.items():
        entries[name] = _entry(path, name, info, data_start)
    cursor = 0
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin - data_start != cursor:
            raise FlashnextError(f"{path}: tensor {e.name} starts at data offset {e.begin - data_start}, "
                                 f"expected {cursor} (offsets must tile the data with no gap or overlap)")
        cursor = e.end - data_start
    if data_start + cursor != size:
        what = "truncated" if data_start + cursor > size else "has trailing bytes"
        raise FlashnextError(f"{path}: {what}: the header describes {data_start + cursor} bytes, "
                             f"the file has {size}")
    return ShardHeader(path, {name: replace(e, source=opened) for name, e in entries.items()}, metadata,
                       data_start, prefix + raw, opened)


def _entry(path: Path, name: str, info: object, data_start: int) -> TensorEntry:
    where = f"{path}: tensor {name}"
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise FlashnextError(f"{where}: needs exactly dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise FlashnextError(f"{where}: unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise FlashnextError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets) or offsets[0] > offsets[1]):
        raise FlashnextError(f"{where}: data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
    nbytes = DTYPE_BYTES[dtype]
    for d in shape:
        nbytes *= d
    if offsets[1] - offsets[0] != nbytes:
        raise FlashnextError(f"{where}: {dtype}{shape} is {nbytes} bytes but data_offsets span "
                             f"{offsets[1] - offsets[0]}")
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its name, safetensors dtype string and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """Safetensors dtype name -> torch dtype, for the dtypes torch can hold. Built on first use:
    reading headers, all that a command that only inspects a checkpoint does, needs no torch."""
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
            "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@functools.cache
def _dtype_names() -> dict[torch.dtype, str]:
    return {v: k for k, v in torch_dtypes().items()}


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, _dtype_names()[tensor.dtype], tuple(tensor.shape))


def _encode_header(specs: list[TensorSpec], metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offsets: dict[str, int] = {}
    cursor = 0
    for spec in specs:
        if spec.name in offsets:
            raise FlashnextError(f"tensor {spec.name} appears twice in one shard")
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                             "data_offsets": [cursor, cursor + spec.nbytes]}
        offsets[spec.name] = cursor
        cursor += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw, offsets


def shard_size(specs: list[TensorSpec], metadata: dict[str, str]) -> int:
    prefix, _ = _encode_header(specs, metadata)
    return len(prefix) + sum(s.nbytes for s in specs)


@dataclass(frozen=True)
class WrittenBytes:
    """One piece a :class:`ShardWriter` wrote: ``length`` bytes of ``tensor`` from ``offset`` within
    it, and, where the writer keeps digests (a resumable build's), their sha256."""

    tensor: str
    offset: int
    length: int
    sha256: str | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


def _offset(piece: WrittenBytes) -> int:
    return piece.offset


HASH_READ = 16 << 20  # what a resumed writer reads at a time to check a piece's digest


class ShardWriter:
    """Writes a safetensors file whose tensors are known up front and filled in any order.

    >>> specs = [TensorSpec("a", "F32", (2,))]
    >>> with ShardWriter(path, specs) as w:          # doctest: +SKIP
    ...     w.write("a", torch.zeros(2))
    """

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None,
                 digests: bool = False, resumed: list[WrittenBytes] | None = None, shown: Path | None = None):
        """``digests``: keep the sha256 of every piece written (:attr:`written`, what a journal
        records). ``resumed``: reopen the shard an interrupted build made at ``path`` (never through
        a link, never truncated) to go on writing it, with the pieces its journal records; each is
        checked against the file's bytes first, a FlashnextError naming the first that differs.
        ``shown``: the path messages name, where ``path`` goes through a held directory's descriptor."""
        self.path = Path(path)
        self.shown = Path(shown or path)
        self.specs = {s.name: s for s in specs}
        prefix, offsets = _encode_header(specs, metadata or {})
        self._base = len(prefix)
        self._offsets = offsets
        self.size = len(prefix) + sum(s.nbytes for s in specs)
        self._digests = digests or resumed is not None
        # Per tensor, the pieces whose bytes are in the file as written: sorted, never overlapping.
        self._pieces: dict[str, list[WrittenBytes]] = {s.name: [] for s in specs}
        if resumed is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        else:
            self._fd = self._reopen(resumed)
        os.pwrite(self._fd, prefix, 0)
        os.ftruncate(self._fd, self.size)

    def _reopen(self, resumed: list[WrittenBytes]) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise FlashnextError(f"{self.shown}: cannot be opened again ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size != self.size:
                raise FlashnextError(f"{self.shown} is not the {self.size}-byte shard this build began")
            for piece in resumed:
                spec = self.specs.get(piece.tensor)
                if spec is None:
                    raise FlashnextError(f"{self.shown}: has no tensor {piece.tensor!r}")
                if piece.end > spec.nbytes:
                    raise FlashnextError(f"{self.shown}: {piece.tensor} has no bytes {piece.offset}..{piece.end}")
                if self._digest(fd, piece) != piece.sha256:
                    raise FlashnextError(f"{self.shown}: bytes {piece.offset}..{piece.end} of {piece.tensor} are not "
                                         "those written there")
                self._record(piece)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _digest(self, fd: int, piece: WrittenBytes) -> str:
        digest = hashlib.sha256()
        at = self._base + self._offsets[piece.tensor] + piece.offset
        for start in range(at, at + piece.length, HASH_READ):
            digest.update(os.pread(fd, min(HASH_READ, at + piece.length - start), start))
        return digest.hexdigest()

    def _record(self, piece: WrittenBytes) -> None:
        """``piece`` is in the file now; the pieces it overwrote, wholly or in part, no longer are."""
        pieces = self._pieces[piece.tensor]
        i = bisect.bisect_right(pieces, piece.offset, key=_offset)
        first = i - 1 if i and pieces[i - 1].end > piece.offset else i
        last = i
        while last < len(pieces) and pieces[last].offset < piece.end:
            last += 1
        pieces[first:last] = [piece]

    @property
    def written(self) -> list[WrittenBytes]:
        """Every piece whose bytes are in the file as written, tensor by tensor."""
        return [piece for pieces in self._pieces.values() for piece in pieces]

    def holds(self, tensor: str, offset: int, length: int) -> bool:
        """Whether pieces written (or checked, when resumed) cover ``length`` bytes of ``tensor``
        from ``offset``."""
        pieces = self._pieces.get(tensor, [])
        i = bisect.bisect_right(pieces, offset, key=_offset) - 1
        at, end = offset, offset + length
        while at < end:
            if not 0 <= i < len(pieces) or not pieces[i].offset <= at < pieces[i].end:
                return False
            at, i = pieces[i].end, i + 1
        return True

    def read_bytes(self, tensor: str, offset: int, length: int) -> bytearray:
        """``length`` bytes of ``tensor`` from ``offset``, as the file holds them."""
        at = self._base + self._offsets[tensor] + offset
        data = bytearray()
        while len(data) < length:
            chunk = os.pread(self._fd, length - len(data), at + len(data))
            if not chunk:
                raise FlashnextError(f"{self.shown}: truncated inside tensor {tensor}")
            data += chunk
        return data

    def sync(self) -> None:
        """Make what was written so far durable (before a journal says it was)."""
        os.fsync(self._fd)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(f"{name} is not in this shard's header")
        got = spec_of(name, tensor)
        if got.dtype != spec.dtype or got.shape != spec.shape:
            raise ValueError(f"{name}: header says {spec.dtype}{list(spec.shape)}, "
                             f"got {got.dtype}{list(got.shape)}")
        import torch

        data = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
        self.write_bytes(name, memoryview(data))

    def write_bytes(self, name: str, data, offset: int = 0) -> None:
        """Write raw bytes of a tensor (possibly in pieces, at ``offset`` within the tensor)."""
        spec = self.specs[name]
        view = memoryview(data).cast("B")
        if offset + len(view) > spec.nbytes:
            raise ValueError(f"{name}: write past the end of the tensor")
        if not view:
            return
        piece = WrittenBytes(name, offset, len(view), hashlib.sha256(view).hexdigest() if self._digests else None)
        at = self._base + self._offsets[name] + offset
        while view:
            n = os.pwrite(self._fd, view, at)
            view, at = view[n:], at + n
        self._record(piece)

    def close(self) -> None:
        """fsync and close; every tensor must have been written in full."""
        if self._fd < 0:
            return
        try:
            missing = sorted(name for name, spec in self.specs.items() if not self.holds(name, 0, spec.nbytes))
            if missing:
                raise RuntimeError(f"{self.shown}: {len(missing)} tensors never written, e.g. {missing[:3]}")
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _open_source(source: Path, entry: TensorEntry, buffering: int = -1):
    """``source`` opened to read ``entry``'s bytes: the same version of the file its header came from."""
    f = open_regular(source, "a safetensors file", buffering=buffering)
    try:
        _check_source(f, entry, source)
    except BaseException:
        f.close()
        raise
    return f


def _check_source(f, entry: TensorEntry, source: Path) -> None:
    if entry.source is not None:
        check_still(f, entry.source, source)


def read_rows(source: Path, entry: TensorEntry, start: int, stop: int) -> torch.Tensor:
    """Read ``tensor[start:stop]`` (along dim 0) with ``pread`` into a private buffer.

    Unlike a memory map, nothing stays resident after the caller drops the tensor, so a stream of
    such reads keeps the resident set bounded by what is in flight.
    """
    import torch

    dtypes = torch_dtypes()
    if entry.dtype not in dtypes:
        raise FlashnextError(f"{source}: {entry.name} has unsupported dtype {entry.dtype}")
    row_bytes = entry.nbytes // entry.shape[0] if entry.shape and entry.shape[0] else 0
    length = (stop - start) * row_bytes
    buffer = bytearray(length)
    view = memoryview(buffer)
    with _open_source(source, entry, buffering=0) as f:
        done = 0
        while done < length:
            n = os.preadv(f.fileno(), [view[done:]], entry.begin + start * row_bytes + done)
            if n <= 0:
                raise FlashnextError(f"{source}: truncated inside tensor {entry.name}")
            done += n
        _check_source(f, entry, source)
    if not length:
        return torch.empty((stop - start, *entry.shape[1:]), dtype=dtypes[entry.dtype])
    return torch.frombuffer(buffer, dtype=dtypes[entry.dtype]).view(stop - start, *entry.shape[1:])


def copy_tensor_bytes(source: Path, entry: TensorEntry, writer, chunk: int = 64 << 20,
                      on_chunk: Callable[[memoryview], None] | None = None) -> None:
    """Copy one tensor's raw bytes from ``source`` into ``writer`` under the same name, unchanged.

    ``writer`` is a :class:`ShardWriter` or anything with its ``write_bytes(name, data, offset)``;
    ``on_chunk`` sees every chunk as it is written, in order (a hash over the copy costs no second
    read of a multi-GB tensor)."""
    with _open_source(source, entry, buffering=0) as f:
        done = 0
        while done < entry.nbytes:
            data = os.pread(f.fileno(), min(chunk, entry.nbytes - done), entry.begin + done)
            if not data:
                raise FlashnextError(f"{source}: truncated inside tensor {entry.name}")
            writer.write_bytes(entry.name, data, done)
            if on_chunk is not None:
                on_chunk(memoryview(data))
            done += len(data)
        _check_source(f, entry, source)


def header_sha256(path: Path) -> str | None:
    """sha256 of a safetensors file's length prefix and JSON header (names, dtypes, shapes and
    offsets): a cheap fingerprint of a multi-GB shard. None for other files."""
    if not str(path).endswith(".safetensors"):
        return None
    return hashlib.sha256(read_header(path).header_bytes).hexdigest()
