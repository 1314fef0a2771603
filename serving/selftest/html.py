"""``report.html``: the selftest report as one self-contained page to attach to a bug report."""

from __future__ import annotations

import html
from pathlib import Path

from flashnext.serving.selftest.report import SelftestReport, headline

_MARK = {"passed": "passed", "agree": "agree", "failed": "FAILED", "disagree": "DISAGREES",
         "could_not_run": "could not run"}


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def _table(head: list[str], rows: list[list], raw: set[int] = frozenset()) -> str:
    """``raw``: the columns whose cells are markup already."""
    out = ["<table><tr>", *(f"<th>{html.escape(h)}</th>" for h in head), "</tr>"]
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{v if i in raw else _cell(v)}</td>" for i, v in enumerate(row)) + "</tr>")
    return "".join(out) + "</table>"


def _status(s: str) -> str:
    cls = "bad" if s in ("failed", "disagree") else ("skip" if s == "could_not_run" else "ok")
    return f'<span class="{cls}">{html.escape(_MARK.get(s, s))}</span>'


def _choices(r: SelftestReport) -> list[str]:
    c = r.kernel_choices
    if c is None:
        return []
    return [f"<p>kernel choices on {_cell(c.device)}: {_status(c.status)} {html.escape(c.detail)}</p>",
            _table(["decision", "shape", "tokens", "table picks", "fastest here", "times (us)"],
                   [[p.decision, p.shape, p.tokens, p.table_picks, p.fastest if p.agrees else f"{p.fastest} (!)",
                     ", ".join(f"{k} {v:.1f}" for k, v in p.timings_us.items())] for p in c.points])]


def _ple_formats(r: SelftestReport) -> list[str]:
    f = r.ple_formats
    return [f"<p>PLE formats: {_status(f.status)} {html.escape(f.detail)}<br>stand-in: {html.escape(f.stand_in)}</p>",
            _table(["format", "ple_embedding_dtype", "check", "vLLM method", "backend", "rows read",
                    "rows differing from flashnext's decoder", "relative squared error against BF16",
                    "bound on the demo", "vLLM allocates (B)", "preflight counts (B)", "detail"],
                   [[c.format, c.ple_embedding_dtype, _status(c.status), c.vllm_method, c.vllm_backend, c.rows,
                     c.rows_differing, c.relative_mse, c.error_bound, ", ".join(map(str, c.allocated_bytes)),
                     ", ".join(map(str, c.preflight_bytes)), c.detail] for c in f.formats], raw={2}),
            "<p>These are the demo table's numbers, not the real model's: what a format does to the real model's "
            "answers is measured only by serving it (docs/ple.md's A/B).</p>"]


def _ple_format_ab(r: SelftestReport) -> str:
    ab = r.ple_format_ab
    floor = {"agree": "within the A/A floor", "disagree": "beyond the A/A floor"}.get(ab.against_floor, "-")
    numbers = ""
    if ab.agreement is not None:
        a = ab.agreement
        numbers = (f"<br>{a.identical}/{a.answers} identical, {a.matching_fraction:.4f} of {a.by} match, mean KL "
                   f"{_cell(a.mean_kl_nats)} nats, decode change {_cell(ab.decode_change_pct)} %")
    return (f"<h2>The PLE table as NVFP4 against BF16: {_status(ab.status)}</h2><p>{html.escape(ab.detail)}"
            f"<br>against the A/A floor: {floor} (informational: the format changes the numbers by design){numbers}"
            "<br>On the demo checkpoint: its numbers are not the real model's, and the format's effect on the real "
            "model is not measured by this selftest.</p>")


def write_html(r: SelftestReport, path: Path) -> None:
    m = r.machine
    parts = [
        f"<h1>flashnext selftest: {html.escape(headline(r.summary))}</h1>",
        f"<p>flashnext {html.escape(r.flashnext_version)}, profile {html.escape(r.profile)}, "
        f"{html.escape(r.started_at)} to {html.escape(r.finished_at)}<br>vLLM {_cell(m.vllm_version)}"
        f" (patched: {_cell(m.vllm_patched)}), {m.cuda_gpus} CUDA GPU(s) {html.escape(', '.join(m.gpu_names))}</p>",
        f"<p>{r.summary.passed} passed, {r.summary.failed} failed, {r.summary.could_not_run} could not run here</p>",
        "".join(f"<p>{html.escape(line)}</p>" for line in r.summary.lines),
        "<h2>CPU part</h2>",
        f"<p>patch series: {_status(r.series.status)} {html.escape(r.series.detail)}</p>",
        f"<p>kernel fit: {_status(r.kernel_fit.status)} {html.escape(r.kernel_fit.detail)}<br>"
        f"stand-in: {html.escape(r.kernel_fit.stand_in)}</p>",
        _table(["layer", "kind", "type", "group", "K", "N", "capability", "vLLM picks", "Marlin", "Humming", "problem"],
               [[k.layer, k.kind, k.weight_type, k.group_size, k.k, k.n, k.capability / 10, k.kernel, k.marlin,
                 k.humming, "; ".join(k.reasons)] for k in r.kernel_fit.layers]),
        *_ple_formats(r),
        f"<h2>GPU part: {_status(r.gpu_part)}</h2><p>{html.escape(r.gpu_detail)}</p>",
        *_choices(r),
        f"<p><code>{html.escape(' '.join(r.vllm_command))}</code></p>",
    ]
    if r.runs:
        parts.append(_table(["run", "switches", "started", "decode tok/s (1 concurrent)", "ITL p50 ms", "error",
                             "bench report"],
                            [[x.name, " ".join(f"{k}={v}" for k, v in x.env.items()), x.started, x.decode_tok_s,
                              x.itl_p50_s and x.itl_p50_s * 1000, x.error, x.bench_report] for x in r.runs]))
    if r.noise_floor:
        f = r.noise_floor
        parts.append(f"<p>A/A noise floor: {f.identical}/{f.answers} identical, {f.matching_fraction:.4f} of "
                     f"{f.by} match, mean KL {_cell(f.mean_kl_nats)} nats</p>")
    t = r.thresholds
    parts.append(f"<h2>Patches</h2><p>A patch agrees when its token agreement is at least the A/A floor's minus "
                 f"{t.matching_slack} and its mean KL at most {t.kl_factor}x the floor's (or {t.kl_abs_nats} nats)</p>")
    parts.append("<table><tr><th>patch</th><th>off switch</th><th>probe</th><th>kernel fit</th><th>A/B</th>"
                 "<th>decode change off %</th><th>detail</th></tr>" + "".join(
                     f"<tr><td>{_cell(p.id)}</td><td><code>{_cell(p.env_switch)}</code></td><td>{_status(p.probe)}</td>"
                     f"<td>{_status(p.kernel_fit) if p.kernel_fit else '-'}</td><td>{_status(p.ab)}</td>"
                     f"<td>{_cell(p.decode_change_pct)}</td><td>{_cell(p.ab_detail)}</td></tr>" for p in r.patches)
                 + "</table>")
    parts.append(_ple_format_ab(r))
    style = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto}table{border-collapse:collapse;"
             "margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}.bad{color:#a00;"
             "font-weight:bold}.skip{color:#777}.ok{color:#070}code{font-size:12px}")
    path.write_text(f"<!doctype html><html><head><meta charset=utf-8><title>flashnext selftest</title>"
                    f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")
