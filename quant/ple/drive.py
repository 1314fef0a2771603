"""Random 4 KiB read latency and throughput of a drive, through O_DIRECT (no page cache).

Decode stalls when a PLE row read waits on the drive: seed 000 §3.7 saw a DRAM-less QLC NVMe drive
answer every read in about 140 ms for seconds at a time (up to 970 ms) while another drive held
p50 0.106 ms and max 22 ms. This measures, on a file of that drive:

* latency at queue depth 1 (p50, p99, max), what one faulting gather waits for;
* throughput with ``depth`` reads outstanding (threads issuing ``pread``), what a prefetcher can
  reach at best.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import random
import threading
import time
from pathlib import Path

from flashnext.errors import FlashnextError
from flashnext.quant.records.inputs import open_regular

BLOCK = 4096
# A drive whose tail is above these stalls decode (a decode step is ~10 ms on the reference rig).
P99_LIMIT_MS = 5.0
MAX_LIMIT_MS = 50.0
# The smallest file drive_check measures: 1024 blocks to read at random.
MIN_FILE_BYTES = 1024 * BLOCK


def _open_direct(path: Path) -> int:
    """``path`` opened for O_DIRECT reads, refused unless it is a regular file. Opened as a regular
    file first (a FIFO would block an open), then switched to O_DIRECT on the same descriptor."""
    try:
        with open_regular(path, "a file on the drive to check", buffering=0) as f:
            fd = os.dup(f.fileno())
    except FileNotFoundError:
        raise FlashnextError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise FlashnextError(f"{path}: is a directory; point drive-check at a file on the drive (ideally "
                             "the PLE table)") from None
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | getattr(os, "O_DIRECT", 0))
    except OSError as e:
        os.close(fd)
        raise FlashnextError(f"{path}: cannot open with O_DIRECT ({e.strerror}); "
                             "point drive-check at a file on the drive itself") from None
    return fd


def _reader(fd: int, blocks: int, seed: int, stop_at: float, latencies: list | None, counter: list) -> None:
    rng = random.Random(seed)
    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT wants
    n = 0
    try:
        while time.perf_counter() < stop_at:
            offset = rng.randrange(blocks) * BLOCK
            t = time.perf_counter()
            os.preadv(fd, [buf], offset)
            if latencies is not None:
                latencies.append(time.perf_counter() - t)
            n += 1
    finally:
        buf.close()
        counter.append(n)


def drive_check(path: Path, seconds: float = 10.0, depth: int = 32) -> dict:
    """Half of ``seconds`` at queue depth 1, half at ``depth``. Returns latencies in ms and IOPS."""
    path = Path(path)
    fd = _open_direct(path)
    try:
        size = os.fstat(fd).st_size
        blocks = size // BLOCK
        if size < MIN_FILE_BYTES:
            raise FlashnextError(f"{path} is {size} bytes: use a file of at least {MIN_FILE_BYTES >> 20} MiB "
                                 "(ideally the PLE table)")
        try:
            os.preadv(fd, [mmap.mmap(-1, BLOCK)], 0)
        except OSError as e:
            raise FlashnextError(f"{path}: O_DIRECT reads fail here ({e.strerror})") from None
        latencies: list[float] = []
        counts: list[int] = []
        started = time.perf_counter()
        _reader(fd, blocks, 1, started + seconds / 2, latencies, counts)
        qd1 = time.perf_counter() - started
        counts = []
        started = time.perf_counter()
        threads = [threading.Thread(target=_reader, args=(fd, blocks, 100 + i, started + seconds / 2, None, counts))
                   for i in range(depth)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deep = time.perf_counter() - started
    finally:
        os.close(fd)
    latencies.sort()
    ms = [x * 1000 for x in latencies]

    def pct(p: float) -> float:
        return ms[min(len(ms) - 1, int(p * len(ms)))]

    iops = sum(counts) / deep
    result = {
        "path": str(path), "file_bytes": size, "block_bytes": BLOCK,
        "qd1": {"reads": len(ms), "p50_ms": round(pct(0.5), 4), "p99_ms": round(pct(0.99), 4),
                "max_ms": round(ms[-1], 4), "iops": round(len(ms) / qd1, 1)},
        "deep": {"depth": depth, "reads": sum(counts), "iops": round(iops, 1),
                 "mb_per_s": round(iops * BLOCK / 1e6, 1)},
    }
    stalls = pct(0.99) > P99_LIMIT_MS or ms[-1] > MAX_LIMIT_MS
    result["verdict"] = ("tail latency would stall decode: place the PLE table on another drive "
                         f"(p99 > {P99_LIMIT_MS} ms or max > {MAX_LIMIT_MS} ms)") if stalls else "ok"
    result["ok"] = not stalls
    return result
