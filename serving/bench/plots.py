"""Drawing and table helpers for the report's pictures (PNG) and page, and the parts no one phase owns:
the pooled ITL histogram, the A/B plot and tables, an endpoint's heading and failures."""

from __future__ import annotations

import html
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the phases draw with these helpers, and load without the bench extra
    from flashnext.serving.bench.report import BenchReport

COLORS = ("tab:blue", "tab:orange")


def figure():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here, nor in a container
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(8, 4.5), dpi=110)


def finish_axes(ax, xlabel: str, ylabel: str, title: str, legend_size: int = 8) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    _legend_below(ax, legend_size)


def _legend_below(ax, size: int) -> None:
    """The legend under the axes: inside them it covers the lines it names."""
    n = len(ax.get_legend_handles_labels()[1])
    ax.legend(fontsize=size, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2 if n > 3 else 1,
              frameon=False)


def png(plt, fig) -> bytes:
    buf = io.BytesIO()
    # "tight" grows the picture to hold the legend below the axes.
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _side_names(report: BenchReport) -> tuple[str, str]:
    ab = report.ab
    return ab.this_run.name, ab.reference.name


def itl_plot(report: BenchReport) -> bytes | None:
    if not any(e.itl_samples_s for e in report.endpoints):
        return None
    from flashnext.serving.bench.metrics import percentile

    plt, fig, ax = figure()
    every = [v * 1000 for e in report.endpoints for v in e.itl_samples_s]
    # A few stalls would stretch the axis until every other gap sits in the first bin: the axis ends
    # at the pooled p99, and the legend counts what lies past it.
    low, high = min(every), percentile(every, 99)
    if high <= low:
        high = max(every) if max(every) > low else low + 1e-3
    bins = [low + (high - low) * i / 60 for i in range(61)]  # one set for both sides: comparable bars
    for color, e in zip(COLORS, report.endpoints):
        if e.itl_samples_s:
            ms = [v * 1000 for v in e.itl_samples_s]
            past = sum(v > high for v in ms)
            ax.hist([v for v in ms if v <= high], bins=bins, alpha=0.55, color=color,
                    label=f"{e.label} ({len(ms)} gaps" + (f", {past} past {high:.3g} ms not drawn)" if past else ")"))
    finish_axes(ax, "inter-token latency (ms)", "gaps (count)", "ITL distribution (warm latency and decode rounds)")
    return png(plt, fig)


def ab_plot(report: BenchReport) -> bytes | None:
    if report.ab is None or not report.ab.deltas:
        return None
    from matplotlib.patches import Patch

    plt, fig, ax = figure()
    this, ref = _side_names(report)
    ds = report.ab.deltas
    looks = {"better": ("tab:green", ""), "worse": ("tab:red", ""), "within noise": ("silver", ""),
             "one sample, no noise band": ("white", "///")}
    for i, d in enumerate(ds):
        if d.noise_pct:  # behind the bar: a change inside it is what the side does against itself
            ax.fill_betweenx([i - 0.4, i + 0.4], d.noise_pct[0], d.noise_pct[1], color="tab:blue", alpha=0.18,
                             linewidth=0, zorder=1)
        color, hatch = looks[_verdict_key(d)]
        ax.barh(i, d.change_pct, height=0.45, color=color, hatch=hatch, edgecolor="dimgray", linewidth=0.6, zorder=2)
    ax.set_yticks(range(len(ds)), [f"{d.metric} ({d.unit})" for d in ds])
    ax.set_ylim(len(ds) - 0.5, -0.5)
    ax.axvline(0, color="black", linewidth=0.8, zorder=3)
    ax.set_xlabel(f"change of {this} vs {ref} (%)")
    ax.set_title(f"{this} vs {ref}")
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(True, axis="x", alpha=0.3)
    fig.set_figheight(max(3.0, 0.3 * len(ds) + 1.2))
    handles = [Patch(facecolor=c, hatch=h, edgecolor="dimgray", label=f"{this}: {k}") for k, (c, h) in looks.items()]
    handles.append(Patch(facecolor="tab:blue", alpha=0.18,
                         label=f"A/A noise band ({this}'s and {ref}'s repeated rounds)"))
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.06 - 0.35 / fig.get_figheight()),
              ncol=3, frameon=False)
    return png(plt, fig)


def _verdict_key(d) -> str:
    if d.within_noise is None:
        return "one sample, no noise band"
    if d.within_noise:
        return "within noise"
    return "better" if _better(d) else "worse"


def _better(d) -> bool:
    return d.change_pct >= 0 if d.better == "higher" else d.change_pct <= 0


# -- HTML ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Column:
    """A table column: its name and the unit of its numbers (None: text)."""

    name: str
    unit: str | None = None

    @property
    def header(self) -> str:
        return f"{self.name} ({self.unit})" if self.unit else self.name


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"  # 21004, not 2.1e+04
    return str(v)


def table(columns: list[Column], rows: list[list]) -> str:
    th = "".join(f"<th>{html.escape(c.header)}</th>" for c in columns)
    # Numbers right-aligned, so that their digits line up; text left-aligned.
    align = ["n" if c.unit else "t" for c in columns]
    body = "".join("<tr>" + "".join(f"<td class={a}>{html.escape(_fmt(v))}</td>" for a, v in zip(align, r)) + "</tr>"
                   for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def ms(s) -> float | None:
    return None if s is None else s * 1000


def endpoint_html(e) -> list[str]:
    """An endpoint's heading and its failed requests (its phases' parts follow)."""
    caps = ", ".join(k for k, v in e.capabilities.model_dump().items() if v) or "none"
    failed = sum(e.errors.values())
    parts = [f"<h2>{html.escape(e.label)}: {html.escape(e.url)}</h2><p>model {html.escape(e.model)}; "
             f"server accepts: {html.escape(caps)}; {e.requests} requests, {failed} failed</p>"]
    if e.failures:
        parts.append("<h3>Failed requests, by phase and kind</h3>" + table(
            [Column("phase"), Column("kind"), Column("HTTP status"), Column("failed", "requests"),
             Column("what to change")],
            [[f.phase, f.kind, f.status, f.count, f.advice] for f in e.failures]))
        parts.append("<h4>Samples (the first few of each)</h4>" + table(
            [Column("phase"), Column("kind"), Column("HTTP status"), Column("detail")],
            [[x.phase, x.kind, x.status, x.detail] for x in e.error_samples]))
    parts += server_state_html(e)
    return parts


def server_state_html(e) -> list[str]:
    """What the server's /metrics said during each phase, or why there is nothing."""
    st = e.server_state
    if st is None:
        return []
    if not st.available:
        return [f"<p>Server state: none ({html.escape(st.note or 'no /metrics')}).</p>"]
    gaps = f"; {st.failed_scrapes} scrapes got no answer" if st.failed_scrapes else ""
    notes = [f"<p class=bad>{html.escape(n)}</p>" for p in st.phases for n in p.notes]
    return [f"<h3>Server state, from {html.escape(st.url)}{html.escape(gaps)}</h3>" + table(
        [Column("phase"), Column("scrapes", "count"), Column("running mean", "requests"),
         Column("running max", "requests"), Column("waiting mean", "requests"), Column("waiting max", "requests"),
         Column("KV cache mean", "fraction"), Column("KV cache max", "fraction"), Column("preemptions", "count"),
         Column("prefix cache queries", "tokens"), Column("prefix cache hits", "tokens"),
         Column("prefix cache hit rate", "fraction")],
        [[p.phase, p.samples, p.running_mean, p.running_max, p.waiting_mean, p.waiting_max, p.kv_cache_usage_mean,
          p.kv_cache_usage_max, p.preemptions, p.prefix_cache_queries, p.prefix_cache_hits, p.prefix_cache_hit_rate]
         for p in st.phases]), *notes, *gpu_steps_html(st)]


def gpu_steps_html(st) -> list[str]:
    """GPU time per decode step from the server's CUDA events (patch step-time), beside the client's ITL."""
    from flashnext.serving.bench.server_state import step_label

    rows = [[p.phase, step_label(g), g.steps, ms(g.mean_s), ms(g.p50_s), ms(g.p90_s),
             ms(p.client_itl_s and p.client_itl_s.p50), ms(p.client_itl_s and p.client_itl_s.p90)]
            for p in st.phases for g in p.gpu_steps]
    if not rows:
        return [f"<p>GPU time per step: none ({html.escape(st.gpu_step_note)}).</p>"] if st.gpu_step_note else []
    return ["<h3>GPU time per step (CUDA events around the graph replay)</h3>" + table(
        [Column("phase"), Column("rank and graph"), Column("steps", "count"), Column("GPU mean", "ms"),
         Column("GPU p50", "ms"), Column("GPU p90", "ms"), Column("client ITL p50", "ms"),
         Column("client ITL p90", "ms")], rows)]


def ab_html(report: BenchReport) -> list[str]:
    ab = report.ab
    this, ref = ab.this_run.name, ab.reference.name
    parts = [f"<h2>{html.escape(this)} vs {html.escape(ref)}</h2>" + table(
        [Column("side"), Column("URL"), Column("model"), Column("started")],
        [[s.name, s.url, s.model, s.started_at] for s in (ab.this_run, ab.reference)])]
    if ab.differences:
        parts.append("<p class=bad>Besides what is measured, the sides differ in: "
                     + "; ".join(html.escape(d) for d in ab.differences) + ". Read the numbers with that.</p>")
    rows = [[name, s.by, s.identical, s.answers, s.matching_fraction, s.mean_first_divergence, s.mean_kl_nats,
             s.mean_abs_logprob_diff]
            for name, s in ((f"{this} vs {ref}", ab.agreement), (f"{this} vs {this} (noise floor)",
                                                                    ab.noise_floor)) if s]
    if rows:
        parts.append("<h3>Greedy answers</h3>" + table(
            [Column("compared"), Column("by"), Column("identical", "answers"), Column("compared", "answers"),
             Column("matching", "fraction of positions"), Column("mean first divergence", "positions"),
             Column(f"mean KL({ref} ‖ {this})", "nats"), Column("mean |Δlogprob|", "nats")], rows))
    for unit, title in (("tok/s", "Speed"), ("ms", "Latency")):
        ds = [d for d in ab.deltas if d.unit == unit]
        if ds:
            parts.append(f"<h3>{title}: {html.escape(this)} vs {html.escape(ref)}</h3>" + table(
                [Column("metric"), Column(this, unit), Column(ref, unit), Column("change", "%"),
                 Column("A/A noise band", "%"), Column("samples", "fewer side"), Column("verdict")],
                [[d.metric, d.this_run, d.reference, d.change_pct,
                  f"{d.noise_pct[0]:+.3g} to {d.noise_pct[1]:+.3g}" if d.noise_pct else None, d.samples,
                  _verdict(d)] for d in ds]))
    return parts


def _verdict(d) -> str:
    key = _verdict_key(d)
    return f"{key}: not a finding" if d.within_noise is None else key
