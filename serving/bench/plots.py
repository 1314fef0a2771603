"""The report's pictures (PNG) and the one HTML file that carries them inline."""

from __future__ import annotations

import base64
import html
import io

from flashnext.serving.bench.report import BenchReport

PLOTS = ("ttft.png", "itl.png", "decode.png", "ab.png")
_COLORS = ("tab:blue", "tab:orange")


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here, nor in a container
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(7, 4.2), dpi=110)


def _axes(ax, xlabel: str, ylabel: str, title: str, legend_size: int = 8) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=legend_size)


def _png(plt, fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def ttft_plot(report: BenchReport) -> bytes | None:
    if not any(p.warm_ttft_s or p.cold_ttft_s for e in report.endpoints for p in e.latency):
        return None
    plt, fig, ax = _figure()
    for color, e in zip(_COLORS, report.endpoints):
        for style, c in zip(("-", "--", ":", "-."), sorted({p.concurrency for p in e.latency})):
            pts = [p for p in e.latency if p.concurrency == c]
            warm = [(p.prompt_tokens, p.warm_ttft_s.p50) for p in pts if p.warm_ttft_s]
            cold = [(p.prompt_tokens, p.cold_ttft_s.mean) for p in pts if p.cold_ttft_s]
            if warm:
                ax.plot(*zip(*warm), style, marker="o", color=color, label=f"{e.label} warm p50, {c} concurrent")
            if cold:
                ax.plot(*zip(*cold), style, marker="x", color=color, alpha=0.5,
                        label=f"{e.label} cold mean, {c} concurrent")
    ax.set_xscale("log", base=2)
    _axes(ax, "prompt length (tokens)", "TTFT, client side (s)", "Time to first token", legend_size=7)
    return _png(plt, fig)


def itl_plot(report: BenchReport) -> bytes | None:
    if not any(e.itl_samples_s for e in report.endpoints):
        return None
    plt, fig, ax = _figure()
    for color, e in zip(_COLORS, report.endpoints):
        if e.itl_samples_s:
            ms = [v * 1000 for v in e.itl_samples_s]
            ax.hist(ms, bins=60, alpha=0.55, color=color, label=f"{e.label} ({len(ms)} gaps)")
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("count")
    ax.set_title("ITL distribution (warm latency and decode rounds)")
    ax.legend(fontsize=8)
    return _png(plt, fig)


def decode_plot(report: BenchReport) -> bytes | None:
    if not any(d.aggregate_tok_s for e in report.endpoints for d in e.decode):
        return None
    plt, fig, ax = _figure()
    for color, e in zip(_COLORS, report.endpoints):
        pts = [(d.concurrency, d.aggregate_tok_s.p50) for d in e.decode if d.aggregate_tok_s]
        if pts:
            ax.plot(*zip(*pts), marker="o", color=color, label=f"{e.label} all requests (p50 of rounds)")
        per = [(d.concurrency, d.per_request_tok_s.p50) for d in e.decode if d.per_request_tok_s]
        if per:
            ax.plot(*zip(*per), "--", marker=".", color=color, alpha=0.6, label=f"{e.label} per request (p50)")
    ax.set_xticks(sorted({d.concurrency for e in report.endpoints for d in e.decode}))
    ax.set_ylim(bottom=0)
    _axes(ax, "concurrent requests", "decode tok/s", "Decode speed against concurrency")
    return _png(plt, fig)


def ab_plot(report: BenchReport) -> bytes | None:
    if report.ab is None or not report.ab.deltas:
        return None
    plt, fig, ax = _figure()
    ds = report.ab.deltas
    colors = ["tab:green" if _better(d.metric, d.change_pct) else "tab:red" for d in ds]
    ax.barh([d.metric for d in ds], [d.change_pct for d in ds], color=colors)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel("B against A (%); green is better")
    ax.set_title("A/B deltas")
    ax.tick_params(axis="y", labelsize=7)
    fig.set_figheight(max(3.0, 0.32 * len(ds) + 1.2))
    return _png(plt, fig)


def _better(metric: str, change_pct: float) -> bool:
    return change_pct >= 0 if "tok/s" in metric else change_pct <= 0


def render(report: BenchReport) -> dict[str, bytes]:
    """Every plot the report has data for, by file name."""
    made = {"ttft.png": ttft_plot(report), "itl.png": itl_plot(report), "decode.png": decode_plot(report),
            "ab.png": ab_plot(report)}
    return {name: png for name, png in made.items() if png is not None}


# -- HTML ----------------------------------------------------------------------------------------

def _fmt(v, unit: str = "") -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}{unit}"
    return f"{v}{unit}"


def _table(head: list[str], rows: list[list]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _ms(s) -> float | None:
    return None if s is None else s * 1000


def html_page(report: BenchReport, pngs: dict[str, bytes]) -> str:
    """One page, images inline: it can be mailed or attached to an issue as it is."""
    parts = [f"<h1>flashnext bench</h1><p>flashnext {html.escape(report.flashnext_version)}, "
             f"{html.escape(report.started_at)} to {html.escape(report.finished_at)}</p>"]
    for e in report.endpoints:
        caps = ", ".join(k for k, v in e.capabilities.model_dump().items() if v) or "none"
        errors = ", ".join(f"{k}: {v}" for k, v in e.errors.items()) or "none"
        parts.append(f"<h2>{html.escape(e.label)}: {html.escape(e.url)}</h2><p>model {html.escape(e.model)}; "
                     f"server accepts: {html.escape(caps)}; {e.requests} requests, failed: {html.escape(errors)}</p>")
        if e.latency:
            parts.append("<h3>TTFT and ITL</h3>" + _table(
                ["prompt tokens", "measured", "concurrent", "cold TTFT mean s", "warm TTFT p50 s", "p90", "p99",
                 "ITL p50 ms", "p90", "p99", "failed"],
                [[p.prompt_tokens, p.measured_prompt_tokens, p.concurrency, p.cold_ttft_s and p.cold_ttft_s.mean,
                  p.warm_ttft_s and p.warm_ttft_s.p50, p.warm_ttft_s and p.warm_ttft_s.p90,
                  p.warm_ttft_s and p.warm_ttft_s.p99, _ms(p.itl_s and p.itl_s.p50), _ms(p.itl_s and p.itl_s.p90),
                  _ms(p.itl_s and p.itl_s.p99), p.failed] for p in e.latency]))
        if e.decode:
            parts.append("<h3>Decode</h3>" + _table(
                ["concurrent", "tok/s all (p50 of rounds)", "mean", "per request p50", "ITL p50 ms", "p90", "p99",
                 "failed"],
                [[d.concurrency, d.aggregate_tok_s and d.aggregate_tok_s.p50, d.aggregate_tok_s and d.aggregate_tok_s.mean,
                  d.per_request_tok_s and d.per_request_tok_s.p50, _ms(d.itl_s and d.itl_s.p50),
                  _ms(d.itl_s and d.itl_s.p90), _ms(d.itl_s and d.itl_s.p99), d.failed] for d in e.decode]))
        if e.needle:
            found = sum(n.found for n in e.needle)
            parts.append(f"<h3>Needle in a haystack: {found}/{len(e.needle)}</h3>" + _table(
                ["context tokens", "measured", "depth", "key", "found", "answer", "error"],
                [[n.context_tokens, n.measured_prompt_tokens, n.depth, n.key, "yes" if n.found else "no",
                  n.answer[:80], n.error] for n in e.needle]))
        if e.structured:
            st = e.structured
            parts.append(f"<h3>Structured output: {st.valid}/{st.requests} valid at {st.concurrency} concurrent"
                         f" ({st.failed} failed)</h3>"
                         + "".join(f"<p class=bad>{html.escape(r)}</p>" for r in st.invalid[:20]))
        if e.error_samples:
            parts.append("<h3>Failed requests (first few)</h3>" + _table(
                ["phase", "kind", "detail"], [[x.phase, x.kind, x.detail] for x in e.error_samples]))
    if report.ab:
        ab = report.ab
        parts.append(f"<h2>A/B</h2><p>A: {html.escape(ab.a)}<br>B: {html.escape(ab.b)}</p>")
        rows = []
        for name, s in (("A against B", ab.agreement), ("A against A (noise floor)", ab.noise_floor)):
            if s:
                rows.append([name, s.by, f"{s.identical}/{s.answers}", s.matching_fraction,
                             s.mean_first_divergence, s.mean_kl_nats, s.mean_abs_logprob_diff])
        if rows:
            parts.append(_table(["", "by", "identical answers", "matching fraction", "mean first divergence",
                                 "mean KL nats", "mean |Δlogprob|"], rows))
        if ab.deltas:
            parts.append(_table(["metric", "A", "B", "change %"],
                                [[d.metric, d.a, d.b, d.change_pct] for d in ab.deltas]))
    for name in PLOTS:
        if name in pngs:
            data = base64.b64encode(pngs[name]).decode()
            parts.append(f'<figure><img alt="{name}" src="data:image/png;base64,{data}"></figure>')
    if report.notes:
        parts.append("<h2>Notes</h2>" + "".join(f"<p>{html.escape(n)}</p>" for n in report.notes))
    style = ("body{font-family:sans-serif;max-width:1000px;margin:2em auto}table{border-collapse:collapse;"
             "margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}.bad{color:#a00}"
             "img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset=utf-8><title>flashnext bench</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")
