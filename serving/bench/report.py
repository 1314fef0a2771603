"""``report.json``: what ``flashnext bench`` measured (schema: ``manifests/bench-report.schema.json``).

Every model rejects unknown keys, so a report from another version fails loudly instead of being
half read (``--baseline`` reads one back), and every float is finite, so no report can hold what
JSON cannot (NaN, Infinity). Times are seconds (the tables of report.html show milliseconds); rates
are tokens per second.

The sides of a comparison have one name each, here, on the page and in the plots: "this run" (the
URL given), "against" (``--against URL2``, measured in the same run) and "baseline" (``--baseline``,
an earlier report).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from flashnext.errors import FlashnextError
from flashnext.quant.records.inputs import open_regular
from flashnext.quant.records.jsonfile import validate
from flashnext.quant.records.strict import StrictRecord
from flashnext.serving.bench.client import LOGPROB_FLOOR, LOGPROB_SLACK, Malformed, parse_strict, redact_url
from flashnext.serving.bench.defaults import IMAGES, MULTITURN

SCHEMA_VERSION = 2
# Schema 1 named the sides "A" and "B" (the baseline A in one place, this run A in another).

THIS_RUN, AGAINST, BASELINE = "this run", "against", "baseline"
SideName = Literal["this run", "against", "baseline"]
# Settings that do not change what a number means: how long the client waits, and which phases run
# (a phase's numbers are compared only where both reports have them).
CLIENT_SETTINGS = frozenset({"request_timeout_s", "stall_timeout_s", "phases", "metrics_interval_s"})
# A report of a long run with every ITL sample is tens of MiB; far past that is not one.
_REPORT_LIMIT = 512 << 20


class _Model(StrictRecord):
    # Lax where the other records are strict: the runner fills these from Python values (tuples,
    # numpy scalars), and a report read back is checked key by key all the same.
    model_config = ConfigDict(strict=False)


class Summary(_Model):
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float


class Settings(_Model):
    """The run's parameters, as given on the command line."""

    prompt_tokens: list[int]
    concurrency: list[int]
    decode_concurrency: list[int]
    decode_tokens: int
    ttft_max_tokens: int
    warmup: int
    repeats: int
    needle_tokens: list[int]
    needle_depths: list[float]
    needle_concurrency: int
    needle_max_tokens: int
    structured_requests: int
    structured_concurrency: int
    structured_max_tokens: int
    structured_format: Literal["json_schema", "json_object"]
    # The fields below have defaults so that a report written before they existed still loads as a
    # --baseline (it ran none of their phases); the command fills every one of them.
    multiturn_sessions: list[int] = MULTITURN["multiturn_sessions"]
    multiturn_turns: int = MULTITURN["multiturn_turns"]
    multiturn_first_tokens: int = MULTITURN["multiturn_first_tokens"]
    multiturn_turn_tokens: int = MULTITURN["multiturn_turn_tokens"]
    multiturn_output_tokens: int = MULTITURN["multiturn_output_tokens"]
    images: int = IMAGES["images"]
    image_size: list[int] = Field(default=IMAGES["image_size"], min_length=2, max_length=2,
                                  description="[width, height] in pixels")
    image_concurrency: int = IMAGES["image_concurrency"]
    image_prefill_tokens: int = IMAGES["image_prefill_tokens"]
    image_max_tokens: int = IMAGES["image_max_tokens"]
    metrics_interval_s: float = 1.0
    top_logprobs: int
    seed: int
    request_timeout_s: float
    stall_timeout_s: float
    phases: list[str]
    extra_body: dict


class Capabilities(_Model):
    """What the server accepted in the probe."""

    ignore_eos: bool = Field(description="accepts vLLM's ignore_eos/min_tokens, so decode runs to its length")
    logprobs: bool = Field(description="returns per-token logprobs (token agreement and KL need them)")
    usage: bool = Field(description="reports usage (token counts) in the stream")


class Scale(_Model):
    chars_per_token: float
    template_tokens: int
    measured: bool = Field(description="false: the server reported no usage, 4 characters per token assumed")


class ErrorSample(_Model):
    phase: str
    kind: str
    status: int | None = Field(description="the HTTP status of an http failure")
    detail: str


class FailureGroup(_Model):
    """Every failed request of one phase, kind and (for ``http``) HTTP status: all of them counted."""

    phase: str
    kind: str
    status: int | None = Field(description="the HTTP status of an http failure")
    count: int
    advice: str | None = Field(description="what to change, when the cause is known "
                                           "(flashnext.serving.bench.advice.KNOWN_CAUSES)")


class LatencyPoint(_Model):
    """TTFT and ITL at one prompt length and concurrency."""

    prompt_tokens: int = Field(description="the length asked for")
    measured_prompt_tokens: int | None = Field(description="median of the server's usage.prompt_tokens")
    concurrency: int
    cold_ttft_s: Summary | None = Field(description="first sight of a text (page cache and prefix cache cold)")
    warm_ttft_s: Summary | None = Field(description="fixed prompts after the warm-up rounds")
    itl_s: Summary | None
    cold_ttft_samples_s: list[float]
    warm_ttft_samples_s: list[float]
    failed: int


class DecodePoint(_Model):
    """Decode speed with ``concurrency`` requests generating at once."""

    concurrency: int
    aggregate_tok_s: Summary | None = Field(description="all requests' tokens after their first, per second of the round")
    per_request_tok_s: Summary | None
    itl_s: Summary | None
    round_tok_s: list[float]
    failed: int


class NeedleResult(_Model):
    context_tokens: int
    depth: float
    measured_prompt_tokens: int | None
    key: str
    found: bool | None = Field(description="null: the request failed (error says how), so no answer was scored")
    answer: str
    ttft_s: float | None
    error: str | None


class StructuredResult(_Model):
    requests: int
    concurrency: int
    valid: int
    invalid: list[str] = Field(description="why each answer that does not validate fails (one line each)")
    failed: int


class GreedyAnswer(_Model):
    """A greedy answer kept for A/B comparison (against a second endpoint or a saved run)."""

    key: str
    round: int
    text: str
    tokens: list[str] | None
    logprobs: list[float] | None
    top_logprobs: list[dict[str, float]] | None

    @model_validator(mode="after")
    def _one_entry_per_token(self):
        # The A/B walks the three side by side and takes exp() of the logprobs.
        given = [x is not None for x in (self.tokens, self.logprobs, self.top_logprobs)]
        if any(given) and not all(given):
            raise ValueError("tokens, logprobs and top_logprobs must be given together")
        if all(given) and not len(self.tokens) == len(self.logprobs) == len(self.top_logprobs):
            raise ValueError("tokens, logprobs and top_logprobs must have one entry per token")
        values = [*(self.logprobs or ()), *(v for top in self.top_logprobs or () for v in top.values())]
        if not all(LOGPROB_FLOOR <= v <= LOGPROB_SLACK for v in values):  # what the client accepts
            raise ValueError(f"a logprob is above 0 or below {LOGPROB_FLOOR}")
        return self


class GpuStepTime(_Model):
    """One rank's GPU time per CUDA graph replay in a stretch of the run (flashnext's patch step-time:
    CUDA events around vLLM's graph replay; under FULL_DECODE_ONLY each replay is a decode step)."""

    dp_rank: int
    pp_rank: int
    tp_rank: int
    graph: str = Field(description="model: the model's forward; draft: the MTP draft's")
    steps: int = Field(description="replays timed in the stretch")
    mean_s: float
    p50_s: float = Field(description="read from the histogram's buckets (5% apart) by linear interpolation")
    p90_s: float


class ServerWindow(_Model):
    """What the server's ``/metrics`` said over a stretch of the run (vLLM's names in
    ``flashnext.serving.bench.server_state``): gauges over the samples taken, counters' increase."""

    samples: int = Field(description="scrapes in the stretch: at its start, every --metrics-interval, at its end")
    running_mean: float | None = Field(description="vllm:num_requests_running, mean of the samples")
    running_max: float | None
    waiting_mean: float | None = Field(description="vllm:num_requests_waiting, mean of the samples")
    waiting_max: float | None
    kv_cache_usage_mean: float | None = Field(description="vllm:kv_cache_usage_perc (a fraction, 1 = full; "
                                                          "the fullest engine), mean of the samples")
    kv_cache_usage_max: float | None
    preemptions: int | None = Field(description="increase of vllm:num_preemptions_total")
    prefix_cache_queries: int | None = Field(description="increase of vllm:prefix_cache_queries_total (tokens)")
    prefix_cache_hits: int | None = Field(description="increase of vllm:prefix_cache_hits_total (tokens)")
    prefix_cache_hit_rate: float | None = Field(description="hits over queries in the stretch")
    notes: list[str] = Field(default=[], description="why a number is missing (a counter that went down)")
    gpu_steps: list[GpuStepTime] = Field(default=[], description="flashnext:gpu_step_seconds in the stretch, "
                                                                 "per rank and graph; empty without it")


class PhaseServerState(ServerWindow):
    phase: str
    client_itl_s: Summary | None = Field(default=None, description="the client's ITL in the phase (latency's "
                                                                   "and decode's), beside gpu_steps")


class ServerState(_Model):
    """The server's ``/metrics`` during the run, per phase; ``available`` false: it has none (noted)."""

    url: str = Field(description="the /metrics URL scraped")
    available: bool
    note: str | None = Field(description="why there is no server state")
    failed_scrapes: int = Field(description="scrapes after the first that got no answer (gaps in the samples)")
    gpu_step_note: str | None = Field(default=None, description="why there is no GPU time per step "
                                                                "(flashnext:gpu_step_seconds)")
    phases: list[PhaseServerState]


class TurnStats(_Model):
    """One turn of every session of a multiturn point."""

    turn: int = Field(description="1 = the first (long) turn")
    answered: int
    failed: int
    measured_prompt_tokens: int | None = Field(description="median of the server's usage.prompt_tokens: the "
                                                           "whole conversation so far")
    ttft_s: Summary | None
    itl_s: Summary | None


class MultiturnPoint(_Model):
    """``sessions`` agent sessions at once, each re-sending its whole conversation every turn."""

    sessions: int
    sessions_completed: int = Field(description="sessions whose every turn was answered "
                                                "(a failed turn ends its session)")
    failed: int
    wall_s: float = Field(description="from the first request sent to the last answer")
    generated_tokens: int
    throughput_tok_s: float | None = Field(description="every session's generated tokens over wall_s")
    per_user_tok_s: Summary | None = Field(description="each answer's tokens after its first, per second "
                                                       "(interactivity)")
    ttft_s: Summary | None = Field(description="every turn's")
    itl_s: Summary | None
    client_in_flight_mean: float | None = Field(description="requests the client had open, averaged over wall_s")
    server: ServerWindow | None = Field(description="/metrics during the point (running_mean: the average "
                                                    "number of concurrently running requests)")
    turns: list[TurnStats]


class ImageRequest(_Model):
    index: int
    sent_after_s: float = Field(description="seconds after the long prompt was sent")
    during_prefill: bool | None = Field(description="sent before the long prompt's first token; null: the long "
                                                    "prompt got no first token")
    ttft_s: float | None
    e2e_s: float | None
    error: str | None


class ImagesResult(_Model):
    """Generated images sent while a long text prompt prefills (seed 000 section 6: 45/45)."""

    images: int
    width: int
    height: int
    answered: int
    failed: int
    during_prefill: int = Field(description="image requests sent before the long prompt's first token")
    prefill_prompt_tokens: int = Field(description="the long prompt's length asked for")
    prefill_measured_prompt_tokens: int | None
    prefill_ttft_s: float | None
    prefill_error: str | None
    ttft_s: Summary | None = Field(description="the answered images'")
    requests: list[ImageRequest]


class EndpointReport(_Model):
    label: Literal["this run", "against"]
    url: str
    model: str
    capabilities: Capabilities
    scale: Scale
    latency: list[LatencyPoint]
    itl_samples_s: list[float] = Field(description="every inter-token latency of the warm latency and decode rounds")
    decode: list[DecodePoint]
    needle: list[NeedleResult]
    structured: StructuredResult | None
    # Defaults: a report written before these existed still loads as a --baseline.
    multiturn: list[MultiturnPoint] = []
    images: ImagesResult | None = None
    server_state: ServerState | None = Field(default=None, description="the server's /metrics during each phase")
    greedy_answers: list[GreedyAnswer]
    requests: int
    errors: dict[str, int] = Field(description="failed requests by kind (see flashnext.serving.bench.client.ERROR_KINDS)")
    failures: list[FailureGroup] = Field(description="failed requests by phase, kind and HTTP status, with advice")
    error_samples: list[ErrorSample] = Field(description="the first few failures of each failure group")


class AgreementSummary(_Model):
    by: Literal["tokens", "characters"]
    answers: int
    identical: int
    matching_fraction: float = Field(description="equal positions over compared positions, all answers together")
    mean_first_divergence: float | None = Field(description="over answers that diverge")
    kl_positions: int
    mean_kl_nats: float | None = Field(description="mean KL(reference || this run) from top-k logprobs, "
                                                   "before each divergence")
    mean_abs_logprob_diff: float | None


class Side(_Model):
    """One side of a comparison."""

    name: SideName
    url: str
    model: str
    started_at: str = Field(description="when that side's run started")


class Delta(_Model):
    """One headline number on both sides, and this run's change against the reference."""

    metric: str
    unit: Literal["tok/s", "ms"]
    better: Literal["higher", "lower"]
    this_run: float
    reference: float
    change_pct: float = Field(description="(this run - reference) / reference, in percent")
    samples: int = Field(description="the fewer samples of the two sides that the number is taken from")
    noise_pct: list[float] | None = Field(
        description="[low, high]: the A/A noise band, how far each side's number moves against itself over its "
                    "repeated rounds (about 95%), in percent; null with a single sample")
    within_noise: bool | None = Field(description="the change lies inside the noise band; null without one")


class ABReport(_Model):
    this_run: Side
    reference: Side = Field(description="what this run is compared with: the --against side or the --baseline")
    agreement: AgreementSummary | None = Field(description="this run against the reference")
    noise_floor: AgreementSummary | None = Field(description="this run against itself: two measured rounds of "
                                                             "the same prompts")
    deltas: list[Delta]
    differences: list[str] = Field(description="what differs between the sides besides what is measured (model, "
                                               "server, allowed setting differences): read the deltas with these")


class BenchReport(_Model):
    schema_version: Literal[2] = SCHEMA_VERSION
    flashnext_version: str
    started_at: str
    finished_at: str
    settings: Settings
    endpoints: list[EndpointReport]
    ab: ABReport | None
    notes: list[str]

    @classmethod
    def not_this_record(cls, data) -> str | None:
        if isinstance(data, dict) and data.get("schema_version") == 1:
            return (f"a report of an older flashnext bench (schema 1, schema {SCHEMA_VERSION} now): run that "
                    "side again to compare with it")
        return None


def load_report(path: Path) -> BenchReport:
    """A saved ``report.json`` (``--baseline``), or one line saying why it cannot be used: read
    before the run, so that a bad one costs no measuring. Its URLs are shown redacted."""
    path = Path(path)
    raw = _read_regular(path)
    try:
        doc = parse_strict(raw, str(path))
    except Malformed as e:
        raise FlashnextError(f"{e} (not a report.json of flashnext bench)") from None
    report = validate(doc, BenchReport, f"{path}: not a flashnext bench report (schema {SCHEMA_VERSION})")
    if not report.endpoints:
        raise FlashnextError(f"{path}: the report has no endpoint to compare with")
    for e in report.endpoints:
        e.url = redact_url(e.url)
    return report


def workload_differences(baseline: Settings, this_run: Settings) -> list[str]:
    """The settings that change what a number means and differ between the two runs, one line each."""
    ours, theirs = this_run.model_dump(), baseline.model_dump()
    return [f"{k}: baseline {_shown(theirs[k])}, this run {_shown(ours[k])}"
            for k in ours if k not in CLIENT_SETTINGS and ours[k] != theirs[k]]


def _shown(value) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "(none)"
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, str)) else str(value)


def _read_regular(path: Path) -> bytes:
    """``path``'s bytes if it is a regular file (a FIFO would hang the read) of a report's size."""
    try:
        f = open_regular(path, "a report.json of flashnext bench")
    except FileNotFoundError:
        raise FlashnextError(f"{path}: no such report: pass the report.json of an earlier flashnext bench run") from None
    except IsADirectoryError:
        raise FlashnextError(f"{path}: is a directory; pass the report.json in it") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size > _REPORT_LIMIT:
            raise FlashnextError(f"{path}: {size} bytes is larger than any report.json of flashnext bench")
        raw = f.read(_REPORT_LIMIT + 1)
    if not raw.strip():
        raise FlashnextError(f"{path}: empty, not a report.json of flashnext bench")
    return raw

