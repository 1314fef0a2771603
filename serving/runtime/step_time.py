"""GPU time per decode step: CUDA events around a CUDA graph replay, read without a sync.

Seed 000 §3.0 measured a step's GPU time with CUDA events around the graph replay, because the torch
profiler inflates the kernels of a FULL cudagraph (12.15 ms reported, 10.66 ms real). An event pair
costs two ``cudaEventRecord`` calls on the host; reading it with ``elapsed_time`` before the GPU has
passed the end event would block the host, so a pair is only read once ``end.query()`` says it is
done: on a later step, or by the writer thread. Nothing here synchronizes.

Each worker process keeps one :class:`StepTimeRecorder`, a histogram per (graph, tokens), and a
thread that writes a snapshot of them every ``interval_s`` to ``<dir>/<rank file>.json``. The API
server process, which serves ``/metrics``, is another process (vLLM's engine core and its workers
are separate from it, and with one API server vLLM serves the plain ``prometheus_client.REGISTRY``
of that process only), so a histogram made in a worker never reaches ``/metrics`` by itself:
:class:`SnapshotCollector`, registered in the API server's registry, reads the snapshots on each
scrape and exposes them as the histogram :data:`METRIC`.

Torch is imported only by :func:`cuda_event`: the logic runs with any objects that have
``record()``, ``query()`` and ``elapsed_time(other)`` (the CPU tests' stand-ins).
"""

from __future__ import annotations

import bisect
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

METRIC = "flashnext:gpu_step_seconds"
UNTIMED = "flashnext:gpu_steps_untimed"
RANK_LABELS = ("dp_rank", "pp_rank", "tp_rank")
SERIES_LABELS = ("graph", "tokens")
LABELS = RANK_LABELS + SERIES_LABELS
SNAPSHOT_GLOB = "gpu-step-time-*.json"
FORMAT = 1


def _geometric_buckets(low_s: float, high_s: float, ratio: float) -> tuple[float, ...]:
    out = [low_s]
    while out[-1] < high_s:
        out.append(out[-1] * ratio)
    return tuple(round(b, 9) for b in out)


# Upper bounds in seconds, 5% apart from 0.2 ms to ~0.3 s: a quantile read from them by linear
# interpolation is within 2.5% (0.27 ms at the seed's 10.66 ms), finer than the profiler's 14% error.
BUCKETS_S = _geometric_buckets(0.0002, 0.3, 1.05)


class Event(Protocol):
    def record(self) -> None: ...
    def query(self) -> bool: ...
    def elapsed_time(self, end: Event) -> float: ...  # milliseconds, as torch.cuda.Event's


class Graph(Protocol):
    def replay(self) -> None: ...


def cuda_event() -> Event:
    """A timing CUDA event on the current device (recorded on the current stream)."""
    import torch

    return torch.cuda.Event(enable_timing=True)


@dataclass
class Histogram:
    """Counts per bucket of :data:`BUCKETS_S` (the last slot: above the largest bound)."""

    bounds: tuple[float, ...] = BUCKETS_S
    counts: list[int] = field(default_factory=list)
    sum_s: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum_s += seconds
        self.count += 1

    def cumulative(self) -> list[int]:
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out


class StepTimeRecorder:
    """Times each replay with an event pair from a pool of ``pairs``; a pair is read, and returned to
    the pool, only after its end event has completed.

    Under the GPU's pace a pair completes one or two steps after it was recorded, so a pool of 256
    is never empty in practice; if it is (the GPU hundreds of steps behind the host), that step is
    replayed without events and counted in ``untimed`` rather than waiting.
    """

    def __init__(self, new_event: Callable[[], Event] = cuda_event, pairs: int = 256):
        self._new_event = new_event
        self._capacity = pairs
        self._made = 0
        self._free: list[tuple[Event, Event]] = []
        self._pending: deque[tuple[Event, Event, Hashable]] = deque()
        self._lock = threading.Lock()  # the writer thread reads pairs too
        self.histograms: dict[Hashable, Histogram] = {}
        self.untimed = 0
        self.observed = 0  # every pair read so far; the writer compares it with its last snapshot's

    def replay(self, graph: Graph, key: Hashable) -> None:
        """``graph.replay()`` between a start and an end event; then read the pairs done by now."""
        with self._lock:
            pair = self._take()
        if pair is None:  # every pair made is in flight or done but not yet read: read, then try again
            self.collect()
            with self._lock:
                pair = self._take()
        if pair is None:
            self.untimed += 1
            graph.replay()
        else:
            start, end = pair
            start.record()
            graph.replay()
            end.record()
            with self._lock:
                self._pending.append((start, end, key))
        # After the launch: the GPU is already running this step while the host reads older pairs.
        self.collect()

    def collect(self) -> int:
        """Read every pending pair that has completed, oldest first; how many were read."""
        read = 0
        with self._lock:
            while self._pending and self._pending[0][1].query():
                start, end, key = self._pending.popleft()
                seconds = start.elapsed_time(end) / 1000.0
                hist = self.histograms.get(key)
                if hist is None:
                    hist = self.histograms[key] = Histogram()
                hist.observe(seconds)
                self._free.append((start, end))
                read += 1
            self.observed += read
        return read

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _take(self) -> tuple[Event, Event] | None:
        if self._free:
            return self._free.pop()
        if self._made < self._capacity:
            self._made += 1
            return self._new_event(), self._new_event()
        return None

    def snapshot(self, ranks: dict[str, int]) -> dict[str, Any]:
        """What a snapshot file holds: this process's ranks and a copy of every histogram."""
        with self._lock:
            series = [{"graph": str(graph), "tokens": int(tokens), "counts": list(h.counts), "sum_s": h.sum_s,
                       "count": h.count}
                      for (graph, tokens), h in sorted(self.histograms.items(), key=lambda kv: str(kv[0]))]
            untimed = self.untimed
        return {"format": FORMAT, "pid": os.getpid(), "ranks": dict(ranks), "bounds_s": list(BUCKETS_S),
                "series": series, "untimed": untimed}


def snapshot_path(directory: Path, ranks: dict[str, int]) -> Path:
    return Path(directory) / ("gpu-step-time-" + "-".join(f"{k}{ranks[k]}" for k in RANK_LABELS) + ".json")


def write_snapshot(path: Path, snapshot: dict[str, Any]) -> None:
    """Replace ``path`` whole (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(snapshot, separators=(",", ":")))
    os.replace(tmp, path)


class SnapshotWriter:
    """A daemon thread that reads completed pairs and rewrites this rank's snapshot every
    ``interval_s``: the last steps of a burst are written although no later step comes to read
    them, and the host's step path never touches the file."""

    def __init__(self, recorder: StepTimeRecorder, path: Path, ranks: dict[str, int], interval_s: float = 0.5):
        self.recorder, self.path, self.ranks, self.interval_s = recorder, Path(path), dict(ranks), interval_s
        self._written = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write_now()  # an empty snapshot at once: a previous run's file of this rank is replaced
        self._thread = threading.Thread(target=self._run, name="flashnext-step-time", daemon=True)
        self._thread.start()

    def write_now(self) -> None:
        self.recorder.collect()
        if self.recorder.observed == self._written and self._written >= 0:
            return
        self._written = self.recorder.observed
        try:
            write_snapshot(self.path, self.recorder.snapshot(self.ranks))
        except OSError:
            self.errors += 1  # a full disk must not stop the server; the scrape shows stale counts

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.write_now()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write_now()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_snapshots(directory: Path) -> list[dict[str, Any]]:
    """The snapshots of live worker processes in ``directory``; unreadable or foreign files are
    skipped (a scrape must answer whatever lies there)."""
    out = []
    try:
        paths = sorted(Path(directory).glob(SNAPSHOT_GLOB))
    except OSError:
        return out
    for path in paths:
        try:
            snap = json.loads(path.read_text())
            if snap.get("format") != FORMAT or not _alive(int(snap["pid"])):
                continue
            ranks = {k: int(snap["ranks"][k]) for k in RANK_LABELS}
            bounds = [float(b) for b in snap["bounds_s"]]
            series = [(str(s["graph"]), int(s["tokens"]), [int(c) for c in s["counts"]], float(s["sum_s"]))
                      for s in snap["series"]]
            if any(len(counts) != len(bounds) + 1 for _, _, counts, _ in series):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out.append({"ranks": ranks, "bounds_s": bounds, "series": series, "untimed": int(snap.get("untimed", 0))})
    return out


class SnapshotCollector:
    """A prometheus_client collector over the workers' snapshot files: :data:`METRIC`, a histogram
    labelled by rank, graph and tokens, and :data:`UNTIMED`, a counter by rank."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def describe(self):
        # The names only: registering must not read the files (prometheus_client calls this then).
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        yield HistogramMetricFamily(METRIC, _HELP, labels=LABELS)
        yield CounterMetricFamily(UNTIMED, _UNTIMED_HELP, labels=RANK_LABELS)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        hist = HistogramMetricFamily(METRIC, _HELP, labels=LABELS)
        untimed = CounterMetricFamily(UNTIMED, _UNTIMED_HELP, labels=RANK_LABELS)
        for snap in read_snapshots(self.directory):
            ranks = [str(snap["ranks"][k]) for k in RANK_LABELS]
            for graph, tokens, counts, sum_s in snap["series"]:
                cumulative, total = [], 0
                for bound, c in zip([*map(_le, snap["bounds_s"]), "+Inf"], counts):
                    total += c
                    cumulative.append((bound, total))
                hist.add_metric([*ranks, graph, str(tokens)], cumulative, sum_s)
            untimed.add_metric(ranks, snap["untimed"])
        yield hist
        yield untimed


def _le(bound: float) -> str:
    return repr(float(bound))


_HELP = ("GPU time of each CUDA graph replay (a decode step under FULL_DECODE_ONLY), from CUDA events "
         "around it; flashnext patch step-time")
_UNTIMED_HELP = "replays not timed because every event pair was still in flight (flashnext patch step-time)"
