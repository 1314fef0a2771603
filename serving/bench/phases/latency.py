"""The latency phase: TTFT as the client sees it, cold and warm, and ITL, per prompt length and concurrency.

Each point starts with one cold round of text nobody sent before (per side of an A/B: each needs
its own unread text), because a new conversation pays the page-cache misses a fixed prompt hides;
the warm-ups follow, then the measured rounds of fixed prompts. Only the measured rounds give ITL.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flashnext.serving.bench import plots
from flashnext.serving.bench.phases.base import Int, Ints, Option, PhaseDefaults, summary_of
from flashnext.serving.bench.plots import Column, ms, table

if TYPE_CHECKING:
    from flashnext.serving.bench.client import Completion
    from flashnext.serving.bench.report import LatencyPoint


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


class Latency(PhaseDefaults):
    name = "latency"
    help = ("TTFT as the client sees it (cold: text nobody sent before; warm: fixed prompts after\n"
            "--warmup rounds) and ITL p50/p90/p99, per prompt length and concurrency")
    report_field = "latency"
    options = (
        Option("--prompt-tokens", "prompt_tokens", Ints(1), "512,4096,32768", "Prompt lengths for TTFT and ITL."),
        Option("--concurrency", "concurrency", Ints(1, 1024), "1,4", "Concurrent requests for TTFT and ITL."),
        Option("--ttft-max-tokens", "ttft_max_tokens", Int(1), 16, "Tokens each TTFT request generates (its ITL samples)."),
    )

    def empty_result(self) -> list[LatencyPoint]:
        return []

    def planned_requests(self, s) -> int:
        return len(s.prompt_tokens) * sum(c * (1 + s.warmup + s.repeats) for c in s.concurrency)

    async def run(self, bench) -> None:
        from flashnext.serving.bench import workloads
        from flashnext.serving.bench.report import LatencyPoint

        s = bench.settings
        kinds = ["cold"] + ["warmup"] * s.warmup + ["measure"] * s.repeats
        for tokens in s.prompt_tokens:
            for c in s.concurrency:
                acc = {ep.label: _Samples() for ep in bench.endpoints}
                for kind in kinds:
                    for ep in bench.endpoints:
                        seed = None if kind == "cold" else s.seed
                        bodies = [bench.body(ep, workloads.latency_prompt(tokens, ep.text_scale, slot, seed),
                                             s.ttft_max_tokens) for slot in range(c)]
                        done = await bench.send(ep, self.name, bodies)
                        if kind != "warmup":
                            acc[ep.label].add(done, ttft_into="cold" if kind == "cold" else "warm",
                                              itl=kind == "measure")
                for ep in bench.endpoints:
                    a = acc[ep.label]
                    ep.itl_samples.extend(a.itl)
                    ep.results[self.report_field].append(LatencyPoint(
                        prompt_tokens=tokens, concurrency=c,
                        measured_prompt_tokens=int(statistics.median(a.prompt)) if a.prompt else None,
                        cold_ttft_s=summary_of(a.cold), warm_ttft_s=summary_of(a.warm), itl_s=summary_of(a.itl),
                        cold_ttft_samples_s=a.cold, warm_ttft_samples_s=a.warm, failed=a.failed))

    def summary_lines(self, e) -> list[str]:
        lines = []
        for p in e.latency:
            warm = f"warm p50 {p.warm_ttft_s.p50 * 1000:.1f} ms" if p.warm_ttft_s else "warm -"
            cold = f"cold {p.cold_ttft_s.mean * 1000:.1f} ms" if p.cold_ttft_s else "cold -"
            itl = (f", ITL p50/p90/p99 {p.itl_s.p50 * 1000:.2f}/{p.itl_s.p90 * 1000:.2f}/{p.itl_s.p99 * 1000:.2f} ms"
                   if p.itl_s else "")
            lines.append(f"  TTFT {p.prompt_tokens:>7} tokens x{p.concurrency}: {cold}, {warm}{itl}")
        return lines

    def html(self, e) -> list[str]:
        if not e.latency:
            return []
        return ["<h3>TTFT and ITL</h3>" + table(
            [Column("prompt", "tokens"), Column("measured prompt", "tokens"), Column("concurrent", "requests"),
             Column("cold TTFT mean", "ms"), Column("warm TTFT p50", "ms"), Column("warm TTFT p90", "ms"),
             Column("warm TTFT p99", "ms"), Column("ITL p50", "ms"), Column("ITL p90", "ms"),
             Column("ITL p99", "ms"), Column("failed", "requests")],
            [[p.prompt_tokens, p.measured_prompt_tokens, p.concurrency, ms(p.cold_ttft_s and p.cold_ttft_s.mean),
              ms(p.warm_ttft_s and p.warm_ttft_s.p50), ms(p.warm_ttft_s and p.warm_ttft_s.p90),
              ms(p.warm_ttft_s and p.warm_ttft_s.p99), ms(p.itl_s and p.itl_s.p50), ms(p.itl_s and p.itl_s.p90),
              ms(p.itl_s and p.itl_s.p99), p.failed] for p in e.latency])]

    def plots(self, report) -> dict[str, bytes | None]:
        # The ITL histogram pools the decode rounds' gaps too; it is drawn here, after TTFT, whenever
        # any endpoint has gaps (a decode-only run included), because the page shows it in that place.
        return {"ttft.png": ttft_plot(report), "itl.png": plots.itl_plot(report)}


def ttft_plot(report) -> bytes | None:
    if not any(p.warm_ttft_s or p.cold_ttft_s for e in report.endpoints for p in e.latency):
        return None
    plt, fig, ax = plots.figure()
    for color, e in zip(plots.COLORS, report.endpoints):
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
    plots.finish_axes(ax, "prompt length (tokens)", "TTFT, client side (ms)", "Time to first token", legend_size=7)
    return plots.png(plt, fig)


PHASE = Latency()
