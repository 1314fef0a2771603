"""A bench run: probe each endpoint, then the phases (``phases/``), the two sides of an --against run round by round.

Seed 000's method, kept here: greedy decoding with a fixed seed; fixed prompts measured after a
warm-up round; a cold round with text nobody sent before (each side of an A/B its own); ITL's median
next to mean tok/s (the mean carries the page-cache misses and drive stalls a user feels); A/B in
one run, alternating rounds, because restarts and neighbours move the numbers more than a patch does.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from flashnext import __version__
from flashnext.errors import FlashnextError, named
from flashnext.serving.bench import workloads
from flashnext.serving.bench.ab import ab_report
from flashnext.serving.bench.advice import advice_for
from flashnext.serving.bench.client import (
    Completion, check_text, check_url, redact_url, scrub, served_model, stream_chat, url_secrets,
)
from flashnext.serving.bench.phases import PHASES
from flashnext.serving.bench.phases.base import summary_of
from flashnext.serving.bench.report import (
    AGAINST, THIS_RUN, BenchReport, Capabilities, EndpointReport, ErrorSample, FailureGroup, GpuStepTime,
    GreedyAnswer, PhaseServerState, Scale, ServerState, ServerWindow, Settings, workload_differences,
)
from flashnext.serving.bench.server_state import Monitor, Window, histogram_quantile, metrics_url

# Kept of each failure group (phase, kind, HTTP status); every failure is counted.
SAMPLES_PER_FAILURE = 3
_PROBE_CHARS = 2000


def chat_url(base: str) -> str:
    """``http://host:port``, ``.../v1`` or the full ``.../v1/chat/completions``: the chat endpoint
    (a query, such as ``?api_key=``, stays on it)."""
    url = httpx.URL(base)
    path = url.path.rstrip("/")
    if not path.endswith("/chat/completions"):
        path = f"{path}/chat/completions" if path.endswith("/v1") else f"{path}/v1/chat/completions"
    return str(url.copy_with(path=path))


def models_url(base: str) -> str:
    url = httpx.URL(chat_url(base))
    return str(url.copy_with(path=url.path.removesuffix("/chat/completions") + "/models"))


@dataclass
class Endpoint:
    label: str
    url: str                   # as given, credentials and all: only requests see it
    model: str | None
    client: httpx.AsyncClient | None = None
    caps: Capabilities | None = None
    scale: Scale | None = None
    requests: int = 0
    failures: dict[tuple[str, str, int | None], list] = field(default_factory=dict)  # key: [count, samples]
    # Each phase's results under its EndpointReport field, as the phases fill them.
    results: dict[str, Any] = field(default_factory=lambda: {
        p.report_field: p.empty_result() for p in PHASES.values() if p.report_field is not None})
    # Shared by the phases: the ITL of latency's measured rounds and decode's, decode's greedy answers.
    itl_samples: list[float] = field(default_factory=list)
    greedy: list[GreedyAnswer] = field(default_factory=list)
    monitor: Monitor | None = None              # its /metrics
    phase_states: list[PhaseServerState] = field(default_factory=list)

    @property
    def shown_url(self) -> str:
        return redact_url(self.url)

    @property
    def text_scale(self) -> workloads.TextScale:
        return workloads.TextScale(self.scale.chars_per_token, self.scale.template_tokens)

    def count_failure(self, phase: str, c: Completion) -> None:
        status = c.status if c.error == "http" and c.status is not None and c.status >= 400 else None
        count_samples = self.failures.setdefault((phase, c.error, status), [0, []])
        count_samples[0] += 1
        if len(count_samples[1]) < SAMPLES_PER_FAILURE:
            count_samples[1].append(ErrorSample(phase=phase, kind=c.error, status=status, detail=c.error_detail or ""))

    def report(self, settings: Settings) -> EndpointReport:
        errors: dict[str, int] = {}
        groups = []
        for (phase, kind, status), (count, samples) in self.failures.items():
            errors[kind] = errors.get(kind, 0) + count
            advice = advice_for(phase, kind, status, [x.detail for x in samples], settings.structured_format)
            groups.append(FailureGroup(phase=phase, kind=kind, status=status, count=count, advice=advice))
        m = self.monitor
        state = None if m is None else ServerState(
            url=m.shown_url, available=bool(m.available), note=m.note, failed_scrapes=m.failed_scrapes,
            gpu_step_note=m.gpu_step_note, phases=self.phase_states)
        return EndpointReport(
            label=self.label, url=self.shown_url, model=self.model, capabilities=self.caps, scale=self.scale,
            **self.results, server_state=state, itl_samples_s=self.itl_samples, greedy_answers=self.greedy,
            requests=self.requests,
            errors=errors, failures=groups, error_samples=[x for _, samples in self.failures.values() for x in samples])


class Bench:
    """One run against one endpoint, or two side by side (``urls`` of length 2).

    Example::

        report = Bench(settings, ["http://127.0.0.1:8000"]).run()
        report.endpoints[0].decode[0].aggregate_tok_s.p50
    """

    def __init__(self, settings: Settings, urls: list[str], models: list[str | None] = (None, None),
                 baseline: BenchReport | None = None, progress: Callable[[int], None] | None = None,
                 allow_different_settings: bool = False):
        if not 1 <= len(urls) <= 2:
            raise FlashnextError(f"flashnext bench compares at most two endpoints (URL and {named('against')} URL)")
        if baseline is not None and len(urls) != 1:
            raise FlashnextError(f"give {named('against')} or {named('baseline')}, not both")
        # Refused before any request: numbers measured with other settings would be compared as equals.
        self.setting_differences = workload_differences(baseline.settings, settings) if baseline else []
        if self.setting_differences and not allow_different_settings:
            first = self.setting_differences[0]
            more = f" (and {len(self.setting_differences) - 1} more)" if len(self.setting_differences) > 1 else ""
            raise FlashnextError(f"the baseline was measured with other settings ({first}{more}): run with its "
                                 f"settings, or pass {named('allow_different_settings')} to compare anyway")
        for url in urls:
            check_url(url)
        for model in models:
            if model is not None:
                check_text(model, "--model")
        self.settings = settings
        self.endpoints = [Endpoint(label, url, model) for label, url, model in zip((THIS_RUN, AGAINST), urls, models)]
        self.baseline = baseline
        self.progress = progress or (lambda n: None)
        self.notes: list[str] = []

    # -- the plan ---------------------------------------------------------------------------

    def planned_requests(self) -> int:
        """How many requests the phases will send to each endpoint (the probe's few not counted)."""
        per_endpoint = sum(p.planned_requests(self.settings) for p in self._phases())
        return per_endpoint * len(self.endpoints)

    def _phases(self) -> list:
        """The phases ``settings.phases`` names, in the registry's order, whatever order it names them in."""
        return [p for p in PHASES.values() if p.name in self.settings.phases]

    @property
    def secrets(self) -> set[str]:
        """What of the URLs must appear nowhere: not in the report, a message or a page."""
        return set().union(*(url_secrets(e.url) for e in self.endpoints))

    def run(self) -> BenchReport:
        """The report, with every secret of the URLs scrubbed out, even where a server echoed one."""
        started = _now()
        try:
            asyncio.run(self._run())
        except FlashnextError as e:
            raise FlashnextError(scrub(str(e), self.secrets)) from None
        endpoints = [e.report(self.settings) for e in self.endpoints]
        ab = ab_report(endpoints, started, self.baseline, self.setting_differences)
        report = BenchReport(flashnext_version=__version__, started_at=started, finished_at=_now(),
                             settings=self.settings, endpoints=endpoints, ab=ab, notes=self.notes)
        return scrub_report(report, self.secrets)

    async def _run(self) -> None:
        s = self.settings
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(connect=10.0, read=s.stall_timeout_s, write=60.0, pool=None)
        for ep in self.endpoints:
            ep.client = httpx.AsyncClient(timeout=timeout, limits=limits)
            # Its own connections: a scrape never waits behind the phase's streams, nor they behind it.
            ep.monitor = Monitor(httpx.AsyncClient(timeout=timeout), metrics_url(chat_url(ep.url)),
                                 redact_url(metrics_url(chat_url(ep.url))))
        sampling = None
        try:
            for ep in self.endpoints:
                await self._probe(ep)
            for ep in self.endpoints:
                await ep.monitor.scrape()
                if ep.monitor.available is False:
                    self.notes.append(f"{ep.label}: no server state (preemptions, running and waiting requests, "
                                      f"KV-cache usage): {ep.monitor.note}")
            sampling = asyncio.create_task(self._sample_every_interval())
            for phase in self._phases():
                starts = [await self.window_start(ep) for ep in self.endpoints]
                itl_before = [len(ep.itl_samples) for ep in self.endpoints]
                await phase.run(self)
                for ep, start, itl_from in zip(self.endpoints, starts, itl_before):
                    window = await self.window_end(ep, start)
                    if window is not None:
                        ep.phase_states.append(PhaseServerState(
                            phase=phase.name, client_itl_s=summary_of(ep.itl_samples[itl_from:]),
                            **window.model_dump()))
        finally:
            if sampling is not None:
                sampling.cancel()
                await asyncio.gather(sampling, return_exceptions=True)
            for ep in self.endpoints:
                await ep.client.aclose()
                await ep.monitor.client.aclose()

    # -- the server's /metrics ------------------------------------------------------------------

    async def _sample_every_interval(self) -> None:
        while True:
            await asyncio.sleep(self.settings.metrics_interval_s)
            await asyncio.gather(*(ep.monitor.scrape() for ep in self.endpoints))

    async def window_start(self, ep: Endpoint) -> float:
        """The start of a stretch whose server state a phase wants: scraped now (counters' start)."""
        start = time.perf_counter()
        await ep.monitor.scrape()
        return start

    async def window_end(self, ep: Endpoint, start: float) -> ServerWindow | None:
        """What ``ep``'s /metrics said since ``start`` (scraped now: counters' end); None without /metrics."""
        await ep.monitor.scrape()
        return server_window(ep.monitor.window(start, time.perf_counter()))

    # -- requests ---------------------------------------------------------------------------

    def body(self, ep: Endpoint, messages: list[dict], max_tokens: int, *, run_to_length: bool = False,
              logprobs: bool = False, response_format: dict | None = None) -> dict:
        body = {"model": ep.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "seed": self.settings.seed}
        if ep.caps.usage:
            body["stream_options"] = {"include_usage": True}
        if run_to_length and ep.caps.ignore_eos:
            body |= {"ignore_eos": True, "min_tokens": max_tokens}
        if logprobs and ep.caps.logprobs and self.settings.top_logprobs:
            body |= {"logprobs": True, "top_logprobs": self.settings.top_logprobs}
        if response_format is not None:
            body["response_format"] = response_format
        return {**body, **self.settings.extra_body}

    async def send(self, ep: Endpoint, phase: str, bodies: list[dict]) -> list[Completion]:
        """Send ``bodies`` to ``ep`` at once, as ``phase``'s requests; count and sample the failures."""

        async def one(body: dict) -> Completion:
            c = await stream_chat(ep.client, chat_url(ep.url), body, request_timeout=self.settings.request_timeout_s)
            self.progress(1)
            return c

        results = await asyncio.gather(*(one(b) for b in bodies))
        ep.requests += len(results)
        for c in results:
            if not c.ok:
                ep.count_failure(phase, c)
        return results

    async def _probe(self, ep: Endpoint) -> None:
        """The model name, what the server accepts, and its characters per token."""
        if ep.model is None:
            ep.model = await self._model_name(ep)
        url = chat_url(ep.url)
        base = {"model": ep.model, "max_tokens": 2, "temperature": 0, **self.settings.extra_body}

        async def ask(extra: dict, text: str = "Say hello.") -> Completion:
            return await stream_chat(ep.client, url, {**base, "messages": workloads.messages(text), **extra},
                                     request_timeout=self.settings.request_timeout_s)

        def answered(c: Completion) -> bool:  # an empty answer still shows the server works
            return c.ok or c.error == "empty"

        first = await ask({})
        if not answered(first):
            raise FlashnextError(f"{ep.shown_url}: a minimal streamed chat completion failed ({first.error}: "
                                 f"{first.error_detail}); is it an OpenAI-compatible server serving {ep.model!r}?")
        usage = await ask({"stream_options": {"include_usage": True}})
        has_usage = answered(usage) and usage.prompt_tokens is not None
        eos = await ask({"ignore_eos": True, "min_tokens": 2})
        lp = await ask({"logprobs": True, "top_logprobs": max(1, self.settings.top_logprobs)})
        ep.caps = Capabilities(ignore_eos=eos.ok, logprobs=answered(lp) and bool(lp.logprobs), usage=has_usage)
        if not ep.caps.ignore_eos:
            self.notes.append(f"{ep.label}: the server refused ignore_eos/min_tokens; decode answers may end "
                              "before --decode-tokens, and tok/s counts the tokens it did send")
        if not ep.caps.logprobs:
            self.notes.append(f"{ep.label}: the server returned no logprobs; A/B agreement is by characters "
                              "and no KL divergence is computed")
        extra = {"stream_options": {"include_usage": True}} if has_usage else {}
        short = await ask(extra, "x")
        rng = random.Random(f"probe/{self.settings.seed}")
        long = await ask(extra, "x " + workloads.filler(_PROBE_CHARS, rng))
        if short.prompt_tokens and long.prompt_tokens and long.prompt_tokens > short.prompt_tokens:
            per = (_PROBE_CHARS + 1) / (long.prompt_tokens - short.prompt_tokens)
            ep.scale = Scale(chars_per_token=per, template_tokens=max(short.prompt_tokens - 1, 0), measured=True)
        else:
            ep.scale = Scale(chars_per_token=4.0, template_tokens=0, measured=False)
            self.notes.append(f"{ep.label}: the server reported no prompt token counts; prompt lengths assume "
                              "4 characters per token")

    async def _model_name(self, ep: Endpoint) -> str:
        return await served_model(ep.client, models_url(ep.url), ep.shown_url)


# The report's fields that carry text a server sent (or a URL): where an echoed secret can land;
# each phase names its own (``Phase.server_text``). The others hold flashnext's own words (kinds,
# labels, Literal choices) and must stay as they are.
_SERVER_TEXT = frozenset({"url", "model", "detail", "text", "tokens", "top_logprobs", "differences", "notes",
                          "note"})


def server_text_fields() -> frozenset[str]:
    return _SERVER_TEXT.union(*(p.server_text for p in PHASES.values()))


def scrub_report(report: BenchReport, secrets: set[str]) -> BenchReport:
    """``report`` with each of ``secrets`` replaced wherever a server's text is kept (keys included)."""
    if not secrets:
        return report
    server_text = server_text_fields()

    def walk(value, text: bool):
        if isinstance(value, str):
            return scrub(value, secrets) if text else value
        if isinstance(value, dict):
            return {(scrub(k, secrets) if text else k): walk(v, text or k in server_text)
                    for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, text) for v in value]
        return value

    return BenchReport.model_validate(walk(report.model_dump(), False))


def server_window(w: Window | None) -> ServerWindow | None:
    if w is None:
        return None

    def gauge(name: str, i: int) -> float | None:
        return w.gauges[name][i] if name in w.gauges else None

    def counter(name: str) -> int | None:
        return round(w.counters[name]) if name in w.counters else None

    queries, hits = counter("prefix_cache_queries"), counter("prefix_cache_hits")
    gpu_steps = []
    for key, h in sorted(w.gpu_steps.items()):
        p50, p90 = histogram_quantile(h, 0.5), histogram_quantile(h, 0.9)
        gpu_steps.append(GpuStepTime(dp_rank=key.dp_rank, pp_rank=key.pp_rank, tp_rank=key.tp_rank, graph=key.graph,
                                     steps=round(h.count), mean_s=h.sum_s / h.count, p50_s=p50, p90_s=p90))
    return ServerWindow(
        samples=w.samples, running_mean=gauge("running", 0), running_max=gauge("running", 1),
        waiting_mean=gauge("waiting", 0), waiting_max=gauge("waiting", 1),
        kv_cache_usage_mean=gauge("kv_cache_usage", 0), kv_cache_usage_max=gauge("kv_cache_usage", 1),
        preemptions=counter("preemptions"), prefix_cache_queries=queries, prefix_cache_hits=hits,
        prefix_cache_hit_rate=hits / queries if queries and hits is not None else None, notes=w.notes,
        gpu_steps=gpu_steps)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
