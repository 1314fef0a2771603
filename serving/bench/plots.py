"""The report's pictures (PNG) and the one HTML file that carries them inline."""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass

from flashnext.serving.bench.report import BenchReport

PLOTS = ("ttft.png", "itl.png", "decode.png", "ab.png")
_COLORS = ("tab:blue", "tab:orange")


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here, nor in a container
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(8, 4.5), dpi=110)


def _axes(ax, xlabel: str, ylabel: str, title: str, legend_size: int = 8) -> None:
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


def _png(plt, fig) -> bytes:
    buf = io.BytesIO()
    # "tight" grows the picture to hold the legend below the axes.
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _side_names(report: BenchReport) -> tuple[str, str]:
    ab = report.ab
    return ab.this_run.name, ab.reference.name


def ttft_plot(report: BenchReport) -> bytes | None:
    if not any(p.warm_ttft_s or p.cold_ttft_s for e in report.endpoints for p in e.latency):
        return None
    plt, fig, ax = _figure()
    for color, e in zip(_COLORS, report.endpoints):
        for style, c in zip(("-", "--", ":", "-."), sorted({p.concurrency for p in e.latency})):
            pts = [p for p in e.latency if p.concurrency == c]
            warm = [(p.prompt_tokens, p.warm_ttft_s.p50 * 1000) for p in pts if p.warm_ttft_s]
            cold = [(p.prompt_tokens, p.cold_ttft_s.mean * 1000) for p in pts if p.cold_ttft_s]
            if warm:
                ax.plot(*zip(*warm), style, marker="o", color=color, label=f"{e.label}: warm p50, {c} concurrent")
            if cold:
                ax.plot(*zip(*cold), style, marker="x", color=color, alpha=0.5,
                        label=f"{e.label}: cold mean, {c} concurrent")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({p.prompt_tokens for e in report.endpoints for p in e.latency}))
    ax.xaxis.set_major_formatter("{x:.0f}")
    ax.set_ylim(bottom=0)
    _axes(ax, "prompt length (tokens)", "TTFT, client side (ms)", "Time to first token", legend_size=7)
    return _png(plt, fig)


def itl_plot(report: BenchReport) -> bytes | None:
    if not any(e.itl_samples_s for e in report.endpoints):
        return None
    from flashnext.serving.bench.metrics import percentile

    plt, fig, ax = _figure()
    every = [v * 1000 for e in report.endpoints for v in e.itl_samples_s]
    # A few stalls would stretch the axis until every other gap sits in the first bin: the axis ends
    # at the pooled p99, and the legend counts what lies past it.
    low, high = min(every), percentile(every, 99)
    if high <= low:
        high = max(every) if max(every) > low else low + 1e-3
    bins = [low + (high - low) * i / 60 for i in range(61)]  # one set for both sides: comparable bars
    for color, e in zip(_COLORS, report.endpoints):
        if e.itl_samples_s:
            ms = [v * 1000 for v in e.itl_samples_s]
            past = sum(v > high for v in ms)
            ax.hist([v for v in ms if v <= high], bins=bins, alpha=0.55, color=color,
                    label=f"{e.label} ({len(ms)} gaps" + (f", {past} past {high:.3g} ms not drawn)" if past else ")"))
    _axes(ax, "inter-token latency (ms)", "gaps (count)", "ITL distribution (warm latency and decode rounds)")
    return _png(plt, fig)


def decode_plot(report: BenchReport) -> bytes | None:
    if not any(d.aggregate_tok_s for e in report.endpoints for d in e.decode):
        return None
    plt, fig, ax = _figure()
    for color, e in zip(_COLORS, report.endpoints):
        pts = [(d.concurrency, d.aggregate_tok_s.p50) for d in e.decode if d.aggregate_tok_s]
        if pts:
            ax.plot(*zip(*pts), marker="o", color=color, label=f"{e.label}: all requests (p50 of rounds)")
            # The rounds' min..max: how far one round moves against another.
            lows = [d.aggregate_tok_s.min for d in e.decode if d.aggregate_tok_s]
            highs = [d.aggregate_tok_s.max for d in e.decode if d.aggregate_tok_s]
            ax.fill_between([x for x, _ in pts], lows, highs, color=color, alpha=0.15,
                            label=f"{e.label}: rounds min..max")
        per = [(d.concurrency, d.per_request_tok_s.p50) for d in e.decode if d.per_request_tok_s]
        if per:
            ax.plot(*zip(*per), "--", marker=".", color=color, alpha=0.6, label=f"{e.label}: per request (p50)")
        # A point where every round failed would end the line silently: it is drawn, at 0.
        lost = [d.concurrency for d in e.decode if not d.aggregate_tok_s]
        if lost:
            ax.plot(lost, [0] * len(lost), "X", color=color, markersize=10, clip_on=False,
                    label=f"{e.label}: every round failed")
    ax.set_xticks(sorted({d.concurrency for e in report.endpoints for d in e.decode}))
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.05)
    ax.margins(x=0.05)
    _axes(ax, "concurrent requests", "decode speed (tok/s)", "Decode speed against concurrency")
    return _png(plt, fig)


def ab_plot(report: BenchReport) -> bytes | None:
    if report.ab is None or not report.ab.deltas:
        return None
    from matplotlib.patches import Patch

    plt, fig, ax = _figure()
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
    return _png(plt, fig)


def _verdict_key(d) -> str:
    if d.within_noise is None:
        return "one sample, no noise band"
    if d.within_noise:
        return "within noise"
    return "better" if _better(d) else "worse"


def _better(d) -> bool:
    return d.change_pct >= 0 if d.better == "higher" else d.change_pct <= 0


def render(report: BenchReport) -> dict[str, bytes]:
    """Every plot the report has data for, by file name."""
    made = {"ttft.png": ttft_plot(report), "itl.png": itl_plot(report), "decode.png": decode_plot(report),
            "ab.png": ab_plot(report)}
    return {name: png for name, png in made.items() if png is not None}


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


def _table(columns: list[Column], rows: list[list]) -> str:
    th = "".join(f"<th>{html.escape(c.header)}</th>" for c in columns)
    # Numbers right-aligned, so that their digits line up; text left-aligned.
    align = ["n" if c.unit else "t" for c in columns]
    body = "".join("<tr>" + "".join(f"<td class={a}>{html.escape(_fmt(v))}</td>" for a, v in zip(align, r)) + "</tr>"
                   for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _ms(s) -> float | None:
    return None if s is None else s * 1000


def _endpoint_html(e) -> list[str]:
    caps = ", ".join(k for k, v in e.capabilities.model_dump().items() if v) or "none"
    failed = sum(e.errors.values())
    parts = [f"<h2>{html.escape(e.label)}: {html.escape(e.url)}</h2><p>model {html.escape(e.model)}; "
             f"server accepts: {html.escape(caps)}; {e.requests} requests, {failed} failed</p>"]
    if e.failures:
        parts.append("<h3>Failed requests, by phase and kind</h3>" + _table(
            [Column("phase"), Column("kind"), Column("HTTP status"), Column("failed", "requests"),
             Column("what to change")],
            [[f.phase, f.kind, f.status, f.count, f.advice] for f in e.failures]))
        parts.append("<h4>Samples (the first few of each)</h4>" + _table(
            [Column("phase"), Column("kind"), Column("HTTP status"), Column("detail")],
            [[x.phase, x.kind, x.status, x.detail] for x in e.error_samples]))
    if e.latency:
        parts.append("<h3>TTFT and ITL</h3>" + _table(
            [Column("prompt", "tokens"), Column("measured prompt", "tokens"), Column("concurrent", "requests"),
             Column("cold TTFT mean", "ms"), Column("warm TTFT p50", "ms"), Column("warm TTFT p90", "ms"),
             Column("warm TTFT p99", "ms"), Column("ITL p50", "ms"), Column("ITL p90", "ms"),
             Column("ITL p99", "ms"), Column("failed", "requests")],
            [[p.prompt_tokens, p.measured_prompt_tokens, p.concurrency, _ms(p.cold_ttft_s and p.cold_ttft_s.mean),
              _ms(p.warm_ttft_s and p.warm_ttft_s.p50), _ms(p.warm_ttft_s and p.warm_ttft_s.p90),
              _ms(p.warm_ttft_s and p.warm_ttft_s.p99), _ms(p.itl_s and p.itl_s.p50), _ms(p.itl_s and p.itl_s.p90),
              _ms(p.itl_s and p.itl_s.p99), p.failed] for p in e.latency]))
    if e.decode:
        parts.append("<h3>Decode</h3>" + _table(
            [Column("concurrent", "requests"), Column("all requests, p50 of rounds", "tok/s"),
             Column("all requests, mean of rounds", "tok/s"), Column("per request p50", "tok/s"),
             Column("ITL p50", "ms"), Column("ITL p90", "ms"), Column("ITL p99", "ms"), Column("failed", "requests")],
            [[d.concurrency, d.aggregate_tok_s and d.aggregate_tok_s.p50, d.aggregate_tok_s and d.aggregate_tok_s.mean,
              d.per_request_tok_s and d.per_request_tok_s.p50, _ms(d.itl_s and d.itl_s.p50),
              _ms(d.itl_s and d.itl_s.p90), _ms(d.itl_s and d.itl_s.p99), d.failed] for d in e.decode]))
    if e.needle:
        answered = [n for n in e.needle if n.found is not None]
        found = sum(bool(n.found) for n in answered)
        failed_needles = len(e.needle) - len(answered)
        parts.append(f"<h3>Needle in a haystack: found {found} of {len(answered)} answered"
                     + (f" ({failed_needles} requests failed)" if failed_needles else "") + "</h3>" + _table(
            [Column("context", "tokens"), Column("measured prompt", "tokens"), Column("depth", "fraction of context"),
             Column("key"), Column("found"), Column("TTFT", "ms"), Column("answer"), Column("failure")],
            [[n.context_tokens, n.measured_prompt_tokens, n.depth, n.key, n.found, _ms(n.ttft_s), n.answer[:80],
              n.error] for n in e.needle]))
    if e.structured:
        st = e.structured
        parts.append(f"<h3>Structured output: {st.valid} of {st.requests} valid at {st.concurrency} concurrent"
                     f" ({st.failed} requests failed)</h3>"
                     + "".join(f"<p class=bad>{html.escape(r)}</p>" for r in st.invalid[:20]))
    return parts


def _ab_html(report: BenchReport) -> list[str]:
    ab = report.ab
    this, ref = ab.this_run.name, ab.reference.name
    parts = [f"<h2>{html.escape(this)} vs {html.escape(ref)}</h2>" + _table(
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
        parts.append("<h3>Greedy answers</h3>" + _table(
            [Column("compared"), Column("by"), Column("identical", "answers"), Column("compared", "answers"),
             Column("matching", "fraction of positions"), Column("mean first divergence", "positions"),
             Column(f"mean KL({ref} ‖ {this})", "nats"), Column("mean |Δlogprob|", "nats")], rows))
    for unit, title in (("tok/s", "Speed"), ("ms", "Latency")):
        ds = [d for d in ab.deltas if d.unit == unit]
        if ds:
            parts.append(f"<h3>{title}: {html.escape(this)} vs {html.escape(ref)}</h3>" + _table(
                [Column("metric"), Column(this, unit), Column(ref, unit), Column("change", "%"),
                 Column("A/A noise band", "%"), Column("samples", "fewer side"), Column("verdict")],
                [[d.metric, d.this_run, d.reference, d.change_pct,
                  f"{d.noise_pct[0]:+.3g} to {d.noise_pct[1]:+.3g}" if d.noise_pct else None, d.samples,
                  _verdict(d)] for d in ds]))
    return parts


def _verdict(d) -> str:
    key = _verdict_key(d)
    return f"{key}: not a finding" if d.within_noise is None else key


def html_page(report: BenchReport, pngs: dict[str, bytes]) -> str:
    """One page, images inline: it can be mailed or attached to an issue as it is."""
    parts = [f"<h1>flashnext bench</h1><p>flashnext {html.escape(report.flashnext_version)}, "
             f"{html.escape(report.started_at)} to {html.escape(report.finished_at)}</p>"]
    for e in report.endpoints:
        parts += _endpoint_html(e)
    if report.ab:
        parts += _ab_html(report)
    for name in PLOTS:
        if name in pngs:
            data = base64.b64encode(pngs[name]).decode()
            parts.append(f'<figure><img alt="{name}" src="data:image/png;base64,{data}"></figure>')
    if report.notes:
        parts.append("<h2>Notes</h2>" + "".join(f"<p>{html.escape(n)}</p>" for n in report.notes))
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse;"
             "margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}th{background:#f4f4f4}"
             "td.n{text-align:right}td.t{text-align:left}.bad{color:#a00}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset=utf-8><title>flashnext bench</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")
