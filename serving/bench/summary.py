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
        st = e.server_state
        if st is not None and st.available:
            side["server_state"] = {p.phase: {"preemptions": p.preemptions, "running_max": p.running_max,
                                              "waiting_max": p.waiting_max, "kv_cache_usage_max": p.kv_cache_usage_max,
                                              "prefix_cache_hit_rate": p.prefix_cache_hit_rate, **_gpu_steps(p)}
                                    for p in st.phases}
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
        lines += server_state_lines(e)
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


def server_state_lines(e) -> list[str]:
    """One line a phase of what /metrics said: preemptions first (seed 000 read 0 off the server)."""
    st = e.server_state
    if st is None or not st.available:
        return []
    lines = []
    for p in st.phases:
        said = [f"{p.preemptions} preemptions" if p.preemptions is not None else "preemptions not exposed"]
        if p.running_max is not None:
            said.append(f"running max {p.running_max:g}")
        if p.waiting_max is not None:
            said.append(f"waiting max {p.waiting_max:g}")
        if p.kv_cache_usage_max is not None:
            said.append(f"KV cache max {p.kv_cache_usage_max:.0%}")
        if p.prefix_cache_hit_rate is not None:
            said.append(f"prefix cache hits {p.prefix_cache_hit_rate:.0%}")
        lines.append(f"  server during {p.phase}: {', '.join(said)}")
        if p.gpu_steps:
            from flashnext.serving.bench.server_state import step_label

            steps = "; ".join(f"{step_label(g)} p50 {g.p50_s * 1e3:.2f} / p90 {g.p90_s * 1e3:.2f} ms ({g.steps} steps)"
                              for g in p.gpu_steps)
            itl = (f"; client ITL p50 {p.client_itl_s.p50 * 1e3:.2f} / p90 {p.client_itl_s.p90 * 1e3:.2f} ms"
                   if p.client_itl_s else "")
            lines.append(f"    GPU per step (CUDA events): {steps}{itl}")
    if st.gpu_step_note:
        lines.append(f"  note: {st.gpu_step_note}")
    return lines


def _gpu_steps(p) -> dict:
    """A phase's GPU time per step (patch step-time) for --json's summary, beside its client ITL."""
    from flashnext.serving.bench.server_state import step_label

    if not p.gpu_steps:
        return {}
    return {"gpu_step_p50_ms": {step_label(g): g.p50_s * 1e3 for g in p.gpu_steps},
            "client_itl_p50_ms": p.client_itl_s and p.client_itl_s.p50 * 1e3}
