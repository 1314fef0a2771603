"""What ``flashnext bench`` says when a run is done: the summary lines, the problems and what to change."""

from __future__ import annotations

from flashnext.serving.bench.report import BenchReport
from flashnext.serving.bench.runner import headline_metrics


def problems(report: BenchReport) -> list[str]:
    """What went wrong, one line each: failed requests by kind, needles missed in answers, invalid
    structured answers. A request that failed is counted as a failure only, never as a miss."""
    out = []
    for e in report.endpoints:
        if e.errors:
            out.append(f"{e.label}: {sum(e.errors.values())} of {e.requests} requests failed "
                       f"({', '.join(f'{k} {v}' for k, v in e.errors.items())})")
        answered = [n for n in e.needle if n.found is not None]
        missed = [n for n in answered if not n.found]
        if missed:
            out.append(f"{e.label}: needle missed in {len(missed)} of {len(answered)} answers")
        if e.structured and e.structured.invalid:
            out.append(f"{e.label}: {len(e.structured.invalid)} of {e.structured.requests} structured answers "
                       f"do not validate ({e.structured.invalid[0]})")
    return out


def advice(report: BenchReport) -> list[str]:
    """For each failure group whose cause is known, what to change."""
    return [f"{e.label}, {f.phase}: {f.count} {f.kind}{f' {f.status}' if f.status else ''}: {f.advice}"
            for e in report.endpoints for f in e.failures if f.advice]


def summary(report: BenchReport) -> dict:
    """``--json``'s summary: the headline numbers by side, keyed with their units."""
    out = {e.label: {"url": e.url, **{f"{h.metric} ({h.unit})": h.value for h in headline_metrics(e)},
                     "needle_found": sum(bool(n.found) for n in e.needle),
                     "needle_answered": sum(n.found is not None for n in e.needle), "needle_total": len(e.needle),
                     "structured_valid": e.structured.valid if e.structured else None}
           for e in report.endpoints}
    if report.ab and report.ab.agreement:
        out["ab"] = {"this_run": report.ab.this_run.name, "reference": report.ab.reference.name,
                     **report.ab.agreement.model_dump(), "differences": report.ab.differences}
    return out


def summary_lines(report: BenchReport) -> list[str]:
    lines = []
    for e in report.endpoints:
        lines.append(f"{e.label}: {e.url} ({e.model}), {e.requests} requests")
        for p in e.latency:
            warm = f"warm p50 {p.warm_ttft_s.p50 * 1000:.1f} ms" if p.warm_ttft_s else "warm -"
            cold = f"cold {p.cold_ttft_s.mean * 1000:.1f} ms" if p.cold_ttft_s else "cold -"
            itl = (f", ITL p50/p90/p99 {p.itl_s.p50 * 1000:.2f}/{p.itl_s.p90 * 1000:.2f}/{p.itl_s.p99 * 1000:.2f} ms"
                   if p.itl_s else "")
            lines.append(f"  TTFT {p.prompt_tokens:>7} tokens x{p.concurrency}: {cold}, {warm}{itl}")
        for d in e.decode:
            if d.aggregate_tok_s:
                per = f" (per request p50 {d.per_request_tok_s.p50:.1f} tok/s)" if d.per_request_tok_s else ""
                lines.append(f"  decode x{d.concurrency}: {d.aggregate_tok_s.p50:.1f} tok/s in all{per}")
        if e.needle:
            answered = sum(n.found is not None for n in e.needle)
            failed = f" ({len(e.needle) - answered} requests failed)" if answered < len(e.needle) else ""
            lines.append(f"  needle: found {sum(bool(n.found) for n in e.needle)} of {answered} answered{failed}")
        if e.structured:
            lines.append(f"  structured: {e.structured.valid} of {e.structured.requests} valid")
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
