"""A/B statistics: how this run's answers and numbers compare with a reference's.

The reference is the ``--against`` side, measured in the same run, or a ``--baseline`` report. The
greedy answers are compared prompt by prompt and round by round (token agreement, KL from top-k
logprobs), against the noise floor of this run's own two measured rounds; the headline numbers are
compared in percent, each with the A/A noise band of both sides, because a change inside what a
side does against itself is no finding.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from flashnext import __version__
from flashnext.serving.bench import metrics
from flashnext.serving.bench.client import TopLogprobs
from flashnext.serving.bench.report import (
    AGAINST, BASELINE, THIS_RUN, ABReport, AgreementSummary, BenchReport, Delta, EndpointReport, GreedyAnswer, Side,
)


def ab_report(endpoints: list[EndpointReport], started: str, baseline: BenchReport | None,
              setting_differences: list[str]) -> ABReport | None:
    """This run (``endpoints[0]``) against the ``--against`` side (``endpoints[1]``) or the
    baseline; None with neither."""
    this = endpoints[0]
    if len(endpoints) == 2:
        ref, ref_side = endpoints[1], Side(name=AGAINST, url=endpoints[1].url, model=endpoints[1].model,
                                           started_at=started)
        differences = side_differences(this, ref, AGAINST)
    elif baseline is not None:
        ref = baseline.endpoints[0]
        ref_side = Side(name=BASELINE, url=ref.url, model=ref.model, started_at=baseline.started_at)
        differences = [f"setting {d}" for d in setting_differences] + side_differences(this, ref, BASELINE)
        if baseline.flashnext_version != __version__:
            differences.append(f"flashnext: baseline {baseline.flashnext_version}, this run {__version__}")
    else:
        return None
    return ABReport(this_run=Side(name=THIS_RUN, url=this.url, model=this.model, started_at=started),
                    reference=ref_side, agreement=agreement(ref.greedy_answers, this.greedy_answers),
                    noise_floor=noise_floor(this.greedy_answers), deltas=deltas(this, ref),
                    differences=differences)


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
