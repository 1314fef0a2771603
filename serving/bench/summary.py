"""What ``flashnext bench`` says when a run is done: the summary lines, the problems and what to change.

The parts about one phase's results are that phase's (``phases/``); what is said here is about the
run as a whole: failed requests, the advice for them, the A/B headline numbers and verdicts.
"""

from __future__ import annotations

from flashnext.serving.bench.ab import headline_metrics
from flashnext.serving.bench.phases import PHASES
from flashnext.serving.bench.report import BenchReport


def problems(report: BenchReport) -> list[str]:
    """What went wrong, one line each: failed requests by kind, then each phase's own (needles missed
    in answers, invalid structured answers). A request that failed is counted as a failure only,
    never as a miss."""
    out = []
    for e in report.endpoints:
        if e.errors:
            out.append(f"{e.label}: {sum(e.errors.values())} of {e.requests} requests failed "
                       f"({', '.join(f'{k} {v}' for k, v in e.errors.items())})")
        for p in PHASES.values():
            out += p.problems(e)
    return out


def advice(report: BenchReport) -> list[str]:
    """For each failure group whose cause is known, what to change."""
    return [f"{e.label}, {f.phase}: {f.count} {f.kind}{f' {f.status}' if f.status else ''}: {f.advice}"
            for e in report.endpoints for f in e.failures if f.advice]


def summary(report: BenchReport) -> dict:
    """``--json``'s summary: the headline numbers by side, keyed with their units, and the phases' counts."""
    out = {}
    for e in report.endpoints:
        side = {"url": e.url, **{f"{h.metric} ({h.unit})": h.value for h in headline_metrics(e)}}
        for p in PHASES.values():
            side |= p.summary(e)
        out[e.label] = side
    if report.ab and report.ab.agreement:
        out["ab"] = {"this_run": report.ab.this_run.name, "reference": report.ab.reference.name,
                     **report.ab.agreement.model_dump(), "differences": report.ab.differences}
    return out


def summary_lines(report: BenchReport) -> list[str]:
    lines = []
    for e in report.endpoints:
        lines.append(f"{e.label}: {e.url} ({e.model}), {e.requests} requests")
        for p in PHASES.values():
            lines += p.summary_lines(e)
    ab = report.ab
    if ab:
        this, ref = ab.this_run.name, ab.reference.name
        if ab.agreement:
            g = ab.agreement
            kl = f", mean KL {g.mean_kl_nats:.4g} nats" if g.mean_kl_nats is not None else ""
            noise = f" ({this} vs itself: {ab.noise_floor.matching_fraction:.3f})" if ab.noise_floor else ""
            lines.append(f"{this} vs {ref}: {g.identical} of {g.answers} answers identical, "
                         f"{g.matching_fraction:.3f} of {g.by} match{noise}{kl}")
        for d in ab.deltas:
            if d.within_noise is False:
                lines.append(f"  {d.metric}: {d.this_run:.4g} {d.unit} against {d.reference:.4g} {d.unit}, "
                             f"{d.change_pct:+.1f}% (outside the noise band)")
        lines += [f"note: the sides differ in {x}" for x in ab.differences]
    return lines
