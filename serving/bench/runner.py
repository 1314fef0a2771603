"""A bench run: probe each endpoint, then the phases, the two sides of an --against run round by round.

Seed 000's method, kept here: greedy decoding with a fixed seed; fixed prompts measured after a
warm-up round; a cold round with text nobody sent before (each side of an A/B its own); ITL's median
next to mean tok/s (the mean carries the page-cache misses and drive stalls a user feels); A/B in
one run, alternating rounds, because restarts and neighbours move the numbers more than a patch does.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Callable

import httpx

from flashnext import __version__
from flashnext.errors import FlashnextError
from flashnext.serving.bench import metrics, workloads
from flashnext.serving.bench.advice import advice_for
from flashnext.serving.bench.client import (
    Completion, TopLogprobs, check_text, check_url, redact_url, scrub, served_model, stream_chat, url_secrets,
)
from flashnext.serving.bench.report import (
    AGAINST, BASELINE, THIS_RUN, ABReport, AgreementSummary, BenchReport, Capabilities, DecodePoint, Delta,
    EndpointReport, ErrorSample, FailureGroup, GreedyAnswer, LatencyPoint, NeedleResult, Scale, Settings, Side,
    StructuredResult, Summary, workload_differences,
)

PHASES = ("latency", "decode", "needle", "structured")
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


def _summary(values: list[float]) -> Summary | None:
    s = metrics.summary(values)
    return Summary(**s) if s else None


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
    latency: list[LatencyPoint] = field(default_factory=list)
    itl_samples: list[float] = field(default_factory=list)
    decode: list[DecodePoint] = field(default_factory=list)
    needle: list[NeedleResult] = field(default_factory=list)
    structured: StructuredResult | None = None
    greedy: list[GreedyAnswer] = field(default_factory=list)

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
        return EndpointReport(
            label=self.label, url=self.shown_url, model=self.model, capabilities=self.caps, scale=self.scale,
            latency=self.latency, itl_samples_s=self.itl_samples, decode=self.decode, needle=self.needle,
            structured=self.structured, greedy_answers=self.greedy, requests=self.requests,
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
            raise FlashnextError("flashnext bench compares at most two endpoints (URL and --against URL)")
        if baseline is not None and len(urls) != 1:
            raise FlashnextError("give --against or --baseline, not both")
        # Refused before any request: numbers measured with other settings would be compared as equals.
        self.setting_differences = workload_differences(baseline.settings, settings) if baseline else []
        if self.setting_differences and not allow_different_settings:
            first = self.setting_differences[0]
            more = f" (and {len(self.setting_differences) - 1} more)" if len(self.setting_differences) > 1 else ""
            raise FlashnextError(f"the baseline was measured with other settings ({first}{more}): run with its "
                                 "settings, or pass --allow-different-settings to compare anyway")
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
        s, n = self.settings, 0
        rounds = 1 + s.warmup + s.repeats
        if "latency" in s.phases:
            n += len(s.prompt_tokens) * sum(c * rounds for c in s.concurrency)
        if "decode" in s.phases:
            n += sum(c * (s.warmup + s.repeats) for c in s.decode_concurrency)
        if "needle" in s.phases:
            n += len(s.needle_tokens) * len(s.needle_depths)
        if "structured" in s.phases:
            n += s.structured_requests
        return n * len(self.endpoints)

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
        report = BenchReport(flashnext_version=__version__, started_at=started, finished_at=_now(),
                             settings=self.settings, endpoints=endpoints, ab=self._ab(started, endpoints),
                             notes=self.notes)
        return scrub_report(report, self.secrets)

    async def _run(self) -> None:
        s = self.settings
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(connect=10.0, read=s.stall_timeout_s, write=60.0, pool=None)
        for ep in self.endpoints:
            ep.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        try:
            for ep in self.endpoints:
                await self._probe(ep)
            if "latency" in s.phases:
                await self._latency()
            if "decode" in s.phases:
                await self._decode()
            if "needle" in s.phases:
                await self._needle()
            if "structured" in s.phases:
                await self._structured()
        finally:
            for ep in self.endpoints:
                await ep.client.aclose()

    # -- requests ---------------------------------------------------------------------------

    def _body(self, ep: Endpoint, messages: list[dict], max_tokens: int, *, run_to_length: bool = False,
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

    async def _round(self, ep: Endpoint, phase: str, bodies: list[dict]) -> list[Completion]:
        """Send ``bodies`` at once; count and sample the failures."""

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

    # -- phases -----------------------------------------------------------------------------

    async def _latency(self) -> None:
        s = self.settings
        # Round kinds in order: one cold (text nobody sent before), the warm-ups, the measured rounds.
        kinds = ["cold"] + ["warmup"] * s.warmup + ["measure"] * s.repeats
        for tokens in s.prompt_tokens:
            for c in s.concurrency:
                acc = {ep.label: _Samples() for ep in self.endpoints}
                for kind in kinds:
                    for ep in self.endpoints:
                        seed = None if kind == "cold" else s.seed
                        bodies = [self._body(ep, workloads.latency_prompt(tokens, ep.text_scale, slot, seed),
                                             s.ttft_max_tokens) for slot in range(c)]
                        done = await self._round(ep, "latency", bodies)
                        if kind != "warmup":
                            acc[ep.label].add(done, ttft_into="cold" if kind == "cold" else "warm",
                                              itl=kind == "measure")
                for ep in self.endpoints:
                    a = acc[ep.label]
                    ep.itl_samples.extend(a.itl)
                    ep.latency.append(LatencyPoint(
                        prompt_tokens=tokens, concurrency=c,
                        measured_prompt_tokens=int(statistics.median(a.prompt)) if a.prompt else None,
                        cold_ttft_s=_summary(a.cold), warm_ttft_s=_summary(a.warm), itl_s=_summary(a.itl),
                        cold_ttft_samples_s=a.cold, warm_ttft_samples_s=a.warm, failed=a.failed))

    async def _decode(self) -> None:
        s = self.settings
        for c in s.decode_concurrency:
            acc = {ep.label: {"rounds": [], "per": [], "itl": [], "failed": 0} for ep in self.endpoints}
            for i in range(s.warmup + s.repeats):
                measured = i - s.warmup
                for ep in self.endpoints:
                    bodies = [self._body(ep, workloads.decode_prompt(slot), s.decode_tokens, run_to_length=True,
                                         logprobs=True) for slot in range(c)]
                    done = await self._round(ep, "decode", bodies)
                    if measured < 0:
                        continue
                    a = acc[ep.label]
                    good = [r for r in done if r.ok and r.ttft_s is not None]
                    a["failed"] += len(done) - len(good)
                    for slot, r in enumerate(done):
                        if r.ok:
                            ep.greedy.append(_greedy(f"decode/c{c}/slot{slot}", measured, r))
                    if not good:
                        continue
                    first = min(r.sent_at + r.ttft_s for r in good)
                    last = max(r.sent_at + r.token_times_s[-1] for r in good)
                    tokens = sum(max(r.n_tokens - 1, 0) for r in good)
                    if last > first:
                        a["rounds"].append(tokens / (last - first))
                    a["per"].extend(t for r in good if (t := r.decode_tok_s) is not None)
                    for r in good:
                        a["itl"].extend(r.itl_s)
            for ep in self.endpoints:
                a = acc[ep.label]
                ep.itl_samples.extend(a["itl"])
                ep.decode.append(DecodePoint(concurrency=c, aggregate_tok_s=_summary(a["rounds"]),
                                             per_request_tok_s=_summary(a["per"]), itl_s=_summary(a["itl"]),
                                             round_tok_s=a["rounds"], failed=a["failed"]))

    async def _needle(self) -> None:
        s = self.settings
        cases = [(t, d) for t in s.needle_tokens for d in s.needle_depths]
        for start in range(0, len(cases), s.needle_concurrency):
            batch = cases[start:start + s.needle_concurrency]
            for ep in self.endpoints:
                needles = [workloads.needle_prompt(t, d, ep.text_scale, s.seed) for t, d in batch]
                done = await self._round(ep, "needle", [self._body(ep, n.prompt, s.needle_max_tokens) for n in needles])
                for n, r in zip(needles, done):
                    ep.needle.append(NeedleResult(
                        context_tokens=n.context_tokens, depth=n.depth, measured_prompt_tokens=r.prompt_tokens,
                        key=n.key, found=n.score(r.text) if r.ok else None, answer=r.text[:200], ttft_s=r.ttft_s,
                        error=None if r.ok else f"{r.error}: {r.error_detail}"))

    async def _structured(self) -> None:
        s = self.settings
        acc = {ep.label: ([], 0) for ep in self.endpoints}
        fmt = workloads.structured_response_format(s.structured_format)
        for start in range(0, s.structured_requests, s.structured_concurrency):
            slots = range(start, min(start + s.structured_concurrency, s.structured_requests))
            for ep in self.endpoints:
                done = await self._round(ep, "structured", [
                    self._body(ep, workloads.structured_prompt(i), s.structured_max_tokens, response_format=fmt)
                    for i in slots])
                invalid, failed = acc[ep.label]
                for i, r in zip(slots, done):
                    if not r.ok:
                        failed += 1
                    elif (why := workloads.validate_structured(r.text)) is not None:
                        invalid.append(f"request {i}: {why}")
                acc[ep.label] = (invalid, failed)
        for ep in self.endpoints:
            invalid, failed = acc[ep.label]
            ep.structured = StructuredResult(requests=s.structured_requests, concurrency=s.structured_concurrency,
                                             valid=s.structured_requests - len(invalid) - failed,
                                             invalid=invalid, failed=failed)

    # -- A/B --------------------------------------------------------------------------------

    def _ab(self, started: str, endpoints: list[EndpointReport]) -> ABReport | None:
        this = endpoints[0]
        if len(endpoints) == 2:
            ref, ref_side = endpoints[1], Side(name=AGAINST, url=endpoints[1].url, model=endpoints[1].model,
                                               started_at=started)
            differences = side_differences(this, ref, AGAINST)
        elif self.baseline is not None:
            ref = self.baseline.endpoints[0]
            ref_side = Side(name=BASELINE, url=ref.url, model=ref.model, started_at=self.baseline.started_at)
            differences = [f"setting {d}" for d in self.setting_differences] + side_differences(this, ref, BASELINE)
            if self.baseline.flashnext_version != __version__:
                differences.append(f"flashnext: baseline {self.baseline.flashnext_version}, this run {__version__}")
        else:
            return None
        return ABReport(this_run=Side(name=THIS_RUN, url=this.url, model=this.model, started_at=started),
                        reference=ref_side, agreement=agreement(ref.greedy_answers, this.greedy_answers),
                        noise_floor=noise_floor(this.greedy_answers), deltas=deltas(this, ref),
                        differences=differences)


@dataclass
class _Samples:
    """What the measured rounds of one latency point gave."""

    cold: list[float] = field(default_factory=list)
    warm: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    failed: int = 0

    def add(self, done: list[Completion], ttft_into: str, itl: bool) -> None:
        for r in done:
            if not r.ok or r.ttft_s is None:
                self.failed += 1
                continue
            if r.prompt_tokens:
                self.prompt.append(r.prompt_tokens)
            getattr(self, ttft_into).append(r.ttft_s)
            if itl:
                self.itl.extend(r.itl_s)


def _greedy(key: str, round_: int, c: Completion) -> GreedyAnswer:
    lp = c.logprobs
    return GreedyAnswer(key=key, round=round_, text=c.text, tokens=[t.token for t in lp] if lp else None,
                        logprobs=[t.logprob for t in lp] if lp else None,
                        top_logprobs=[t.top for t in lp] if lp else None)


def _as_logprobs(g: GreedyAnswer) -> list[TopLogprobs] | None:
    if g.tokens is None:
        return None
    return [TopLogprobs(t, lp, top) for t, lp, top in zip(g.tokens, g.logprobs, g.top_logprobs)]


def _agreement_summary(pairs: list[tuple[GreedyAnswer, GreedyAnswer]]) -> AgreementSummary | None:
    if not pairs:
        return None
    found = [metrics.compare(x.text, y.text, _as_logprobs(x), _as_logprobs(y)) for x, y in pairs]
    by = "tokens" if all(f.by == "tokens" for f in found) else "characters"
    if by == "characters":  # one side without logprobs: compare every pair the same way
        found = [metrics.compare(x.text, y.text, None, None) for x, y in pairs]
    compared = sum(f.compared for f in found)
    diverging = [f.first_divergence for f in found if f.first_divergence is not None]
    kl_n = sum(f.kl_positions for f in found)
    return AgreementSummary(
        by=by, answers=len(found), identical=len(found) - len(diverging),
        matching_fraction=sum(f.matching for f in found) / compared if compared else 1.0,
        mean_first_divergence=statistics.fmean(diverging) if diverging else None,
        kl_positions=kl_n, mean_kl_nats=sum(f.kl_sum for f in found) / kl_n if kl_n else None,
        mean_abs_logprob_diff=sum(f.abs_logprob_diff_sum for f in found) / kl_n if kl_n else None)


def agreement(a: list[GreedyAnswer], b: list[GreedyAnswer]) -> AgreementSummary | None:
    """``a``'s and ``b``'s answers to the same prompts in the same measured round (KL(a || b))."""
    theirs = {(g.key, g.round): g for g in b}
    return _agreement_summary([(g, theirs[(g.key, g.round)]) for g in a if (g.key, g.round) in theirs])


def noise_floor(a: list[GreedyAnswer]) -> AgreementSummary | None:
    """The first two measured rounds of each prompt against each other: the round-to-round spread
    that a difference between the sides has to exceed."""
    by_key: dict[str, dict[int, GreedyAnswer]] = {}
    for g in a:
        by_key.setdefault(g.key, {})[g.round] = g
    return _agreement_summary([(r[0], r[1]) for r in by_key.values() if 0 in r and 1 in r])


@dataclass(frozen=True)
class Headline:
    """A number a comparison looks at, with the samples it is taken from (in ``unit``)."""

    metric: str
    unit: str
    stat: str  # "mean" or "pNN" of the samples
    samples: list[float]

    @property
    def better(self) -> str:
        return "higher" if self.unit == "tok/s" else "lower"

    @property
    def value(self) -> float:
        return metrics.statistic(self.samples, self.stat)


def headline_metrics(e: EndpointReport) -> list[Headline]:
    """The numbers a comparison looks at: decode speed and TTFT, per point, and the pooled ITL."""
    out = [Headline(f"decode, {d.concurrency} concurrent, p50 of rounds", "tok/s", "p50", d.round_tok_s)
           for d in e.decode if d.round_tok_s]
    for p in e.latency:
        point = f"{p.prompt_tokens} tokens x {p.concurrency}"
        if p.warm_ttft_samples_s:
            out.append(Headline(f"warm TTFT, {point}, p50", "ms", "p50", [v * 1000 for v in p.warm_ttft_samples_s]))
        if p.cold_ttft_samples_s:
            out.append(Headline(f"cold TTFT, {point}, mean", "ms", "mean", [v * 1000 for v in p.cold_ttft_samples_s]))
    if e.itl_samples_s:
        itl = [v * 1000 for v in e.itl_samples_s]
        out += [Headline("ITL, p50", "ms", "p50", itl), Headline("ITL, p90", "ms", "p90", itl)]
    return out


def _relative_band(h: Headline) -> tuple[float, float] | None:
    """How far ``h`` moves against itself over its samples, in percent of its value."""
    ci, v = metrics.interval(h.samples, h.stat), h.value
    if ci is None or not v > 0:
        return None
    return (ci[0] - v) / v * 100, (ci[1] - v) / v * 100


def deltas(this: EndpointReport, reference: EndpointReport) -> list[Delta]:
    """This run against the reference in percent, each with the A/A noise band of both sides. What a
    float cannot hold (a percentile of an edited baseline's 1e308s, a change over a tiny reference)
    is left out: report.json holds finite numbers only."""
    theirs = {h.metric: h for h in headline_metrics(reference)}
    out = []
    for ours in headline_metrics(this):
        ref = theirs.get(ours.metric)
        if ref is None:
            continue
        t, r = ours.value, ref.value
        if not r > 0 or not math.isfinite(r) or not math.isfinite(t):
            continue
        if not math.isfinite(change := (t - r) / r * 100):
            continue
        bands = [_relative_band(ours), _relative_band(ref)]
        band = None
        if None not in bands and all(math.isfinite(x) for b in bands for x in b):
            band = [min(b[0] for b in bands), max(b[1] for b in bands)]
        out.append(Delta(metric=ours.metric, unit=ours.unit, better=ours.better, this_run=t, reference=r,
                         change_pct=change, samples=min(len(ours.samples), len(ref.samples)), noise_pct=band,
                         within_noise=None if band is None else band[0] <= change <= band[1]))
    return out


def side_differences(this: EndpointReport, ref: EndpointReport, ref_name: str) -> list[str]:
    """What differs between the sides' servers besides what is measured: the comparison is flagged, not refused."""
    out = []
    if this.model != ref.model:
        out.append(f"model: {ref_name} {ref.model!r}, this run {this.model!r}")
    if ref_name == BASELINE and this.url != ref.url:
        out.append(f"server: baseline {ref.url}, this run {this.url}")
    ours, theirs = this.capabilities.model_dump(), ref.capabilities.model_dump()
    for k in ours:
        if ours[k] != theirs[k]:
            yes = {True: "accepts", False: "does not accept"}
            out.append(f"server capability {k}: {ref_name} {yes[theirs[k]]}, this run {yes[ours[k]]}")
    return out


# The report's fields that carry text a server sent (or a URL): where an echoed secret can land.
# The others hold flashnext's own words (kinds, labels, Literal choices) and must stay as they are.
_SERVER_TEXT = frozenset({"url", "model", "detail", "answer", "error", "invalid", "text", "tokens",
                          "top_logprobs", "differences", "notes"})


def scrub_report(report: BenchReport, secrets: set[str]) -> BenchReport:
    """``report`` with each of ``secrets`` replaced wherever a server's text is kept (keys included)."""
    if not secrets:
        return report

    def walk(value, text: bool):
        if isinstance(value, str):
            return scrub(value, secrets) if text else value
        if isinstance(value, dict):
            return {(scrub(k, secrets) if text else k): walk(v, text or k in _SERVER_TEXT)
                    for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, text) for v in value]
        return value

    return BenchReport.model_validate(walk(report.model_dump(), False))


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
