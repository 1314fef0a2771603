"""The server's own view of a run: vLLM's Prometheus ``/metrics``, sampled while the phases run.

Seed 000 read its preemption count from the server ("preemption 0" at 4 x 247,823), not from the
client's timings: a preempted request only shows on the client as a slow one. So each endpoint's
``/metrics`` is scraped at the start and end of every phase (the counters' difference: preemptions,
prefix-cache queries and hits) and every ``--metrics-interval`` seconds between (the gauges: running
and waiting requests, KV-cache usage), and the multiturn phase asks for the window of each of its
points (the seed's "average concurrently running requests").

A server without ``/metrics`` (llama.cpp's, ``transformers serve``) is noted, not an error: the
first scrape decides, and the endpoint is not asked again. A scrape never raises: a body that is
too large, not the Prometheus text format, or a server that stops answering is a note and a gap.

Where the server runs flashnext's patch step-time (``VLLM_GPU_STEP_TIME=1``), ``/metrics`` also has
the histogram ``flashnext:gpu_step_seconds``: GPU time per CUDA graph replay (a decode step), from
CUDA events around it, per rank (:mod:`flashnext.serving.runtime.step_time`). A phase's window has
each rank's steps in it (the buckets' increase), shown beside the client's ITL; a server without it
is noted.

The names are vLLM 0.34.0's (``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger.__init__``).
A counter ``vllm:X`` is exposed as the sample ``vllm:X_total`` (prometheus_client adds the
suffix). Every sample of a name is summed over its labels (``engine``, one per data-parallel
engine; ``model_name``), except KV-cache usage, where the fullest engine is what preempts, so its
largest value is kept.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import httpx

# vLLM 0.34.0's names, by what the report calls them.
GAUGES = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",   # a fraction, 1 = full, despite its name
}
COUNTERS = {
    "preemptions": "vllm:num_preemptions",
    "prefix_cache_queries": "vllm:prefix_cache_queries",   # tokens looked up
    "prefix_cache_hits": "vllm:prefix_cache_hits",         # tokens found
}
# flashnext's patch step-time (flashnext.serving.runtime.step_time.METRIC; a test holds them equal).
GPU_STEP = "flashnext:gpu_step_seconds"
GPU_STEP_KEY = ("dp_rank", "pp_rank", "tp_rank", "graph")   # its labels but tokens, which a window sums over
# vLLM's /metrics with its histograms is a few hundred KiB; far past that is not one.
_BODY_LIMIT = 16 << 20
_SCRAPE_TIMEOUT_S = 10.0


def metrics_url(chat_url: str) -> str:
    """The server's ``/metrics`` beside its ``/v1`` (vLLM mounts it at the root), query kept."""
    url = httpx.URL(chat_url)
    root = url.path.removesuffix("/chat/completions").removesuffix("/v1")
    return str(url.copy_with(path=f"{root.rstrip('/')}/metrics"))


def parse(text: str) -> dict[str, float]:
    """The values of :data:`GAUGES` and :data:`COUNTERS` in Prometheus text ``text``, by the
    report's names; a name the server does not expose is absent. Raises ValueError when ``text``
    is not the Prometheus text format."""
    from prometheus_client.parser import text_string_to_metric_families

    # By sample name, whatever family the parser put a sample in (without its # TYPE line a counter's
    # family is named after the sample, _total and all).
    wanted = {v: k for k, v in GAUGES.items()} | {f"{v}_total": k for k, v in COUNTERS.items()}
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is not None and math.isfinite(sample.value):
                found.setdefault(key, []).append(float(sample.value))
    totals = {k: (max(v) if k == "kv_cache_usage" else sum(v)) for k, v in found.items()}
    # finite values may sum past the largest float (a page of 1e308s): such a total is no number
    return {k: v for k, v in totals.items() if math.isfinite(v)}


@dataclass(frozen=True, order=True)
class StepKey:
    """One rank's one kind of graph ("model", or an MTP "draft")."""

    dp_rank: int
    pp_rank: int
    tp_rank: int
    graph: str

    @property
    def label(self) -> str:
        return step_label(self)


def step_label(step) -> str:
    """"pp0 model", "pp1/tp3 draft": the pipeline rank (the tensor and data ranks where not 0) and
    the graph, of anything with those attributes (a :class:`StepKey`, the report's GpuStepTime)."""
    ranks = [f"pp{step.pp_rank}"] + [f"{n}{v}" for n, v in (("tp", step.tp_rank), ("dp", step.dp_rank)) if v]
    return f"{'/'.join(ranks)} {step.graph}"


@dataclass
class StepHistogram:
    """Cumulative counts at each upper bound (seconds, the last +inf), as Prometheus keeps them."""

    bounds: tuple[float, ...]
    cumulative: list[float]
    sum_s: float

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def __add__(self, other: StepHistogram) -> StepHistogram:
        return StepHistogram(self.bounds, [a + b for a, b in zip(self.cumulative, other.cumulative)],
                             self.sum_s + other.sum_s)

    def __sub__(self, other: StepHistogram) -> StepHistogram:
        return StepHistogram(self.bounds, [a - b for a, b in zip(self.cumulative, other.cumulative)],
                             self.sum_s - other.sum_s)


def parse_gpu_steps(text: str) -> dict[StepKey, StepHistogram]:
    """The :data:`GPU_STEP` histogram in Prometheus text ``text``, one per rank and graph (summed
    over the token counts of the graphs replayed); empty when the server does not expose it."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[tuple, dict[float, float]] = {}
    sums: dict[tuple, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(GPU_STEP):   # by sample: a page without # TYPE lines names families so
                continue
            try:
                key = (StepKey(int(sample.labels["dp_rank"]), int(sample.labels["pp_rank"]),
                               int(sample.labels["tp_rank"]), sample.labels["graph"]), sample.labels.get("tokens"))
                if not math.isfinite(sample.value):
                    continue
                if sample.name == f"{GPU_STEP}_bucket":
                    buckets.setdefault(key, {})[float(sample.labels["le"])] = float(sample.value)
                elif sample.name == f"{GPU_STEP}_sum":
                    sums[key] = float(sample.value)
            except (KeyError, ValueError):
                continue
    out: dict[StepKey, StepHistogram] = {}
    for (step_key, tokens), by_bound in buckets.items():
        bounds = tuple(sorted(by_bound))
        if not bounds or not math.isinf(bounds[-1]):
            continue
        h = StepHistogram(bounds, [by_bound[b] for b in bounds], sums.get((step_key, tokens), 0.0))
        prev = out.get(step_key)
        out[step_key] = h if prev is None else (prev + h if prev.bounds == h.bounds else prev)
    return out


def histogram_quantile(h: StepHistogram, q: float) -> float | None:
    """The ``q`` quantile of ``h`` by linear interpolation inside its bucket, as Prometheus's
    ``histogram_quantile`` reads one; None for no observations. A quantile in the +inf bucket is
    the largest finite bound."""
    total = h.count
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(h.bounds, h.cumulative):
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            inside = count - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / inside if inside else 1.0)
        lower_bound, lower_count = bound, count
    return lower_bound


@dataclass
class Sample:
    at: float                    # time.perf_counter()
    values: dict[str, float]
    gpu_steps: dict[StepKey, StepHistogram] = field(default_factory=dict)


@dataclass
class Window:
    """What the server said between two moments of the run."""

    samples: int
    gauges: dict[str, tuple[float, float]]    # name: (mean, max) over the samples
    counters: dict[str, float]                # name: increase, end minus start
    notes: list[str] = field(default_factory=list)
    gpu_steps: dict[StepKey, StepHistogram] = field(default_factory=dict)   # the steps in the window


class Monitor:
    """One endpoint's ``/metrics``: each :meth:`scrape` (the runner's, at the phases' edges and every
    ``--metrics-interval``) adds a sample; :meth:`window` says what the samples of a stretch show."""

    def __init__(self, client: httpx.AsyncClient, url: str, shown_url: str):
        self.client, self.url, self.shown_url = client, url, shown_url
        self.available: bool | None = None    # None until the first scrape answers
        self.note: str | None = None          # why there is no server state, once known
        self.samples: list[Sample] = []
        self.failed_scrapes = 0
        self.gpu_step_time = False   # whether any scrape had flashnext:gpu_step_seconds

    @property
    def gpu_step_note(self) -> str | None:
        """Why there is no GPU step time, where /metrics answered without it."""
        if not self.available or self.gpu_step_time:
            return None
        return (f"no {GPU_STEP} on {self.shown_url}: the server does not run flashnext's patch step-time "
                "with VLLM_GPU_STEP_TIME=1 (GPU time per decode step)")

    async def scrape(self) -> None:
        """One sample, or a gap (a failure is counted; the first decides whether there is /metrics)."""
        if self.available is False:
            return
        try:
            values, gpu_steps = await self._read()
        except _NoMetrics as e:
            if self.available is None:
                self.available, self.note = False, str(e)
            else:
                self.failed_scrapes += 1
            return
        self.available = True
        self.gpu_step_time = self.gpu_step_time or bool(gpu_steps)
        self.samples.append(Sample(time.perf_counter(), values, gpu_steps))

    async def _read(self) -> tuple[dict[str, float], dict[StepKey, StepHistogram]]:
        try:
            import prometheus_client  # noqa: F401  (vLLM's own dependency; the bench extra's too)
        except ImportError:
            raise _NoMetrics("prometheus_client is not installed (pip install 'flashnext[bench]')") from None
        try:
            async with self.client.stream("GET", self.url, timeout=_SCRAPE_TIMEOUT_S) as r:
                if r.status_code >= 400:
                    raise _NoMetrics(f"{self.shown_url} answered HTTP {r.status_code}")
                raw = bytearray()
                async for piece in r.aiter_bytes():
                    raw += piece
                    if len(raw) > _BODY_LIMIT:
                        raise _NoMetrics(f"{self.shown_url} answered more than {_BODY_LIMIT} bytes")
        except httpx.HTTPError as e:
            raise _NoMetrics(f"{self.shown_url} did not answer ({type(e).__name__})") from None
        try:
            text = raw.decode("utf-8", "replace")
            values = parse(text)
            gpu_steps = parse_gpu_steps(text) if GPU_STEP in text else {}
        except (ValueError, TypeError, IndexError) as e:
            raise _NoMetrics(f"{self.shown_url} is not Prometheus text ({str(e)[:120]})") from None
        if not values:
            raise _NoMetrics(f"{self.shown_url} has none of vLLM's scheduler metrics "
                             f"({', '.join(GAUGES.values())})")
        return values, gpu_steps

    def window(self, start: float, end: float) -> Window | None:
        """The samples taken in [start, end] (perf_counter times), None without /metrics or samples."""
        inside = [s for s in self.samples if start <= s.at <= end]
        if not inside:
            return None
        gauges = {}
        for name in GAUGES:
            values = [s.values[name] for s in inside if name in s.values]
            if values:
                mean = sum(v / len(values) for v in values)  # each term first: a sum of 1e308s overflows
                gauges[name] = (mean, max(values))
        counters, notes = {}, []
        first, last = inside[0].values, inside[-1].values
        for name in COUNTERS:
            if name in first and name in last:
                if not math.isfinite(last[name] - first[name]):
                    notes.append(f"{COUNTERS[name]} went from {first[name]:g} to {last[name]:g}: an increase "
                                 "past the largest number, left out")
                elif last[name] >= first[name]:
                    counters[name] = last[name] - first[name]
                else:  # a counter only goes down when the server restarted in between
                    notes.append(f"{COUNTERS[name]} went down from {first[name]:g} to {last[name]:g}: "
                                 "the server restarted during the phase")
        gpu_steps = {}
        for key, end_h in inside[-1].gpu_steps.items():
            start_h = inside[0].gpu_steps.get(key)
            if start_h is not None and start_h.bounds != end_h.bounds:
                continue
            steps = end_h if start_h is None else end_h - start_h   # None: the rank's first steps came in the window
            if not all(math.isfinite(v) for v in (*steps.cumulative, steps.sum_s)):
                notes.append(f"{GPU_STEP} of {key.label} is past the largest number: left out")
            elif steps.count < 0:
                notes.append(f"{GPU_STEP} of {key.label} went down: the server restarted during the phase")
            elif steps.count > 0:
                gpu_steps[key] = steps
        return Window(samples=len(inside), gauges=gauges, counters=counters, notes=notes, gpu_steps=gpu_steps)


class _NoMetrics(Exception):
    """Why a scrape gave no sample, one line."""
