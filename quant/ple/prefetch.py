"""PLE page prefetch: plan the pages a prompt's rows need and ask the kernel to read them early.

The table is mapped with ``MADV_RANDOM`` (readahead would multiply NVMe traffic), so a gather of
rows that are not in the page cache faults them in one page at a time, at queue depth 1 (seed 000
§1: 100 s to first token). Which rows a prompt needs depends only on its tokens, so when a request
is admitted a worker thread computes them and issues ``MADV_WILLNEED`` for their pages a window of
1024 tokens at a time, with ``process_madvise`` so that up to 1024 ranges go in one system call and
the kernel queues the reads in parallel. During decode, :class:`DecodeAdvisor` advises one token's
rows right before the gather with a preallocated ``iovec``.

``process_madvise`` is refused with EPERM in a container without CAP_SYS_PTRACE (podman's default
seccomp profile) and with ENOSYS before Linux 5.10; then advice falls back to one ``madvise`` per
range, which reads the same pages at a higher CPU cost, and this is logged once.
``VLLM_PLE_PREFETCH=0`` turns the prompt prefetcher off (patch ttft-01), ``VLLM_PLE_DECODE_ADVICE=0``
the per-step advice (patch decode-06).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from flashnext import envs
from flashnext.errors import FlashnextError
from flashnext.quant.records.inputs import open_regular
from flashnext.quant.ple.hashing import NgramHasher

log = logging.getLogger(__name__)

PAGE_SIZE = mmap.PAGESIZE
WINDOW_TOKENS = 1024
IOV_MAX = 1024
SYS_PIDFD_OPEN = 434      # the same number on every architecture since Linux 5.3
SYS_PROCESS_MADVISE = 440
MADV_RANDOM = 1
MADV_WILLNEED = 3


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


@dataclass(frozen=True)
class PageRanges:
    """Merged page ranges of one window: ``first[i]`` pages from ``first[i]`` (page numbers)."""

    first: np.ndarray
    count: np.ndarray

    @property
    def pages(self) -> int:
        return int(self.count.sum())


def row_pages(ids: np.ndarray, row_bytes: int) -> np.ndarray:
    """Sorted unique page numbers touched by the rows ``ids`` (any shape)."""
    start = ids.reshape(-1).astype(np.int64) * row_bytes
    first = start // PAGE_SIZE
    last = (start + row_bytes - 1) // PAGE_SIZE
    if row_bytes <= PAGE_SIZE:  # a row spans at most two pages
        return np.unique(np.concatenate([first, last]))
    spans = [np.arange(a, b + 1) for a, b in zip(first.tolist(), last.tolist())]
    return np.unique(np.concatenate(spans))


def merge_pages(pages: np.ndarray) -> PageRanges:
    """Runs of consecutive page numbers as (first, count)."""
    if pages.size == 0:
        return PageRanges(np.empty(0, np.int64), np.empty(0, np.int64))
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [pages.size]])
    return PageRanges(pages[starts], ends - starts)


def plan_windows(hasher: NgramHasher, tokens, row_bytes: int, context=None,
                 window: int = WINDOW_TOKENS) -> Iterator[PageRanges]:
    """For each window of ``window`` tokens, in order: the merged ranges of the pages its rows need.
    A generator, so a consumer can stop between windows."""
    tokens = np.asarray(tokens, dtype=np.int64)
    ctx = None if context is None else np.asarray(context, dtype=np.int64).reshape(1, -1)
    ids = hasher.ids(tokens, None, ctx)
    for w in range(0, len(tokens), window):
        yield merge_pages(row_pages(ids[w:w + window], row_bytes))


def plan_prompt(hasher: NgramHasher, tokens, row_bytes: int, context=None,
                window: int = WINDOW_TOKENS) -> list[PageRanges]:
    """Every window's page ranges at once (see :func:`plan_windows`)."""
    return list(plan_windows(hasher, tokens, row_bytes, context, window))


class TableMapping:
    """A read-only shared mapping of the table file, advised MADV_RANDOM, with the advice calls."""

    def __init__(self, path: Path, row_bytes: int):
        self.path = Path(path)
        self.row_bytes = row_bytes
        try:
            with open_regular(self.path, "a PLE table file", buffering=0) as f:
                self._fd = os.dup(f.fileno())
        except IsADirectoryError:
            raise FlashnextError(f"{self.path}: is a directory, not a PLE table") from None
        self.size = os.fstat(self._fd).st_size
        if self.size == 0:
            os.close(self._fd)
            raise FlashnextError(f"{self.path} is empty: not a PLE table")
        self._mm = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)
        self._mm.madvise(mmap.MADV_RANDOM)
        self.bytes = np.frombuffer(self._mm, dtype=np.uint8)
        self.address = self.bytes.ctypes.data
        self.rows = self.bytes.reshape(-1, row_bytes)
        self._pidfd = -1
        self.batched = self._probe_process_madvise()

    def _probe_process_madvise(self) -> bool:
        pidfd = _libc.syscall(SYS_PIDFD_OPEN, os.getpid(), 0)
        if pidfd < 0:
            self._fallback(ctypes.get_errno())
            return False
        self._pidfd = pidfd
        iov = (_Iovec * 1)(_Iovec(self.address, min(PAGE_SIZE, self.size)))
        if _libc.syscall(SYS_PROCESS_MADVISE, pidfd, iov, 1, MADV_WILLNEED, 0) < 0:
            self._fallback(ctypes.get_errno())
            return False
        return True

    _warned = False

    def _fallback(self, err: int) -> None:
        if not TableMapping._warned:
            TableMapping._warned = True
            reason = {errno.EPERM: "EPERM: no CAP_SYS_PTRACE in this container",
                      errno.ENOSYS: "ENOSYS: kernel older than 5.10"}.get(err, errno.errorcode.get(err, str(err)))
            log.warning("PLE page prefetch uses per-range madvise (process_madvise refused: %s)", reason)

    def advise_iovecs(self, iov, n: int) -> None:
        """WILLNEED for the first ``n`` entries of ``iov`` (addresses inside this mapping)."""
        if self.batched:
            done = 0
            while done < n:
                count = min(IOV_MAX, n - done)
                view = ctypes.cast(ctypes.byref(iov, done * ctypes.sizeof(_Iovec)), ctypes.POINTER(_Iovec))
                if _libc.syscall(SYS_PROCESS_MADVISE, self._pidfd, view, count, MADV_WILLNEED, 0) < 0:
                    err = ctypes.get_errno()
                    if err in (errno.EPERM, errno.ENOSYS):
                        self.batched = False
                        self._fallback(err)
                        return self.advise_iovecs(iov, n)
                done += count
        else:
            for i in range(n):
                _libc.madvise(iov[i].iov_base, iov[i].iov_len, MADV_WILLNEED)

    def advise_ranges(self, ranges: PageRanges) -> None:
        n = len(ranges.first)
        if n == 0:
            return
        iov = (_Iovec * n)()
        base = self.address
        first = (ranges.first * PAGE_SIZE).tolist()
        length = np.minimum(ranges.count * PAGE_SIZE, self.size - ranges.first * PAGE_SIZE).tolist()
        for i in range(n):
            iov[i].iov_base = base + first[i]
            iov[i].iov_len = length[i]
        self.advise_iovecs(iov, n)

    def residency(self) -> tuple[int, int]:
        """(resident pages, total pages) of the whole table, by mincore."""
        pages = (self.size + PAGE_SIZE - 1) // PAGE_SIZE
        vec = np.zeros(pages, dtype=np.uint8)
        if _libc.mincore(self.address, self.size, vec.ctypes.data) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return int((vec & 1).sum()), pages

    def close(self) -> None:
        self.rows = self.bytes = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a numpy view still refers to it; the mapping goes when that does
        os.close(self._fd)
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


class PromptPrefetcher:
    """A worker thread that advises each admitted prompt's pages, window by window.

    >>> pf = PromptPrefetcher(mapping, hasher)      # doctest: +SKIP
    >>> pf.submit("req-1", prompt_token_ids)        # at admission
    >>> pf.cancel("req-1")                          # at finish or preemption
    """

    def __init__(self, mapping: TableMapping, hasher: NgramHasher, window: int = WINDOW_TOKENS):
        self.mapping = mapping
        self.hasher = hasher
        self.window = window
        self.enabled = envs.VLLM_PLE_PREFETCH.enabled()
        self._jobs: queue.Queue = queue.Queue()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self.windows_advised = 0
        self._thread = threading.Thread(target=self._run, name="ple-prefetch", daemon=True)
        if self.enabled:
            self._thread.start()

    def submit(self, request_id: str, tokens, context=None) -> None:
        if self.enabled:
            with self._lock:
                self._cancelled.discard(request_id)
            self._jobs.put((request_id, tokens, context))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)

    def drain(self) -> None:
        """Wait until every submitted prompt has been advised (or cancelled)."""
        self._jobs.join()

    def stop(self) -> None:
        if self.enabled and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                request_id, tokens, context = job
                for ranges in plan_windows(self.hasher, tokens, self.mapping.row_bytes, context, self.window):
                    with self._lock:
                        if request_id in self._cancelled:
                            break
                    self.mapping.advise_ranges(ranges)
                    self.windows_advised += 1
            except Exception:  # prefetch is advice: a failure must never reach the engine
                log.exception("PLE prompt prefetch failed")
            finally:
                self._jobs.task_done()


class DecodeAdvisor:
    """Advise a decode step's rows (first and last page of each) in one system call.

    ``advise_rows`` takes row ids the engine already computed (the serving patch's case);
    ``advise`` hashes one token itself (for callers that only have tokens).
    """

    def __init__(self, mapping: TableMapping, hasher: NgramHasher | None = None, max_rows: int = 64):
        self.mapping = mapping
        self.hasher = hasher
        self.row_bytes = mapping.row_bytes
        self.iov = (_Iovec * max_rows)()
        self.base = mapping.address

    def advise_rows(self, rows) -> None:
        rb, base = self.row_bytes, self.base
        if len(rows) > len(self.iov):
            self.iov = (_Iovec * len(rows))()
        iov = self.iov
        n = 0
        for row in rows:
            start = int(row) * rb
            page = start - start % PAGE_SIZE
            end = start + rb
            iov[n].iov_base = base + page
            iov[n].iov_len = end - page + (-(end - page) % PAGE_SIZE)
            n += 1
        self.mapping.advise_iovecs(iov, n)

    def advise(self, token: int, prev: tuple[int, ...]) -> None:
        self.advise_rows(self.hasher.token_ids(token, prev))
