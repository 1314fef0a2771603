"""The decode phase: tok/s with 1..N requests generating at once, and the greedy answers an A/B compares.

A round's tok/s is every request's tokens after its first over the time from the first first-token
to the last token, so that a server that runs the requests one after another gets no credit for
concurrency. The requests run to ``--decode-tokens`` where the server takes ``ignore_eos``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashnext.serving.bench import plots
from flashnext.serving.bench.phases.base import Int, Ints, Option, PhaseDefaults, summary_of
from flashnext.serving.bench.plots import Column, ms, table

if TYPE_CHECKING:
    from flashnext.serving.bench.client import Completion
    from flashnext.serving.bench.report import DecodePoint, GreedyAnswer


def greedy_answer(key: str, round_: int, c: Completion) -> GreedyAnswer:
    from flashnext.serving.bench.report import GreedyAnswer

    lp = c.logprobs
    return GreedyAnswer(key=key, round=round_, text=c.text, tokens=[t.token for t in lp] if lp else None,
                        logprobs=[t.logprob for t in lp] if lp else None,
                        top_logprobs=[t.top for t in lp] if lp else None)


class Decode(PhaseDefaults):
    name = "decode"
    help = "tok/s with 1..N requests generating at once"
    report_field = "decode"
    options = (
        Option("--decode-concurrency", "decode_concurrency", Ints(1, 1024), "1,2,4",
               "Concurrent requests for decode tok/s."),
        Option("--decode-tokens", "decode_tokens", Int(2), 400,
               "Tokens each decode request generates (ignore_eos where the server accepts it)."),
        Option("--top-logprobs", "top_logprobs", Int(0, 20), 5,
               "Top-k logprobs per decode token, for A/B agreement and KL (0: none)."),
    )

    def empty_result(self) -> list[DecodePoint]:
        return []

    def planned_requests(self, s) -> int:
        return sum(c * (s.warmup + s.repeats) for c in s.decode_concurrency)

    async def run(self, bench) -> None:
        from flashnext.serving.bench import workloads
        from flashnext.serving.bench.report import DecodePoint

        s = bench.settings
        for c in s.decode_concurrency:
            acc = {ep.label: {"rounds": [], "per": [], "itl": [], "failed": 0} for ep in bench.endpoints}
            for i in range(s.warmup + s.repeats):
                measured = i - s.warmup
                for ep in bench.endpoints:
                    bodies = [bench.body(ep, workloads.decode_prompt(slot), s.decode_tokens, run_to_length=True,
                                         logprobs=True) for slot in range(c)]
                    done = await bench.send(ep, self.name, bodies)
                    if measured < 0:
                        continue
                    a = acc[ep.label]
                    good = [r for r in done if r.ok and r.ttft_s is not None]
                    a["failed"] += len(done) - len(good)
                    for slot, r in enumerate(done):
                        if r.ok:
                            ep.greedy.append(greedy_answer(f"decode/c{c}/slot{slot}", measured, r))
                    if not good:
                        continue
                    first = min(r.sent_at + r.ttft_s for r in good)
                    last = max(r.sent_at + r.token_times_s[-1] for r in good)
                    tokens = sum(max(r.n_tokens - 1, 0) for r in good)
                    if last > first:
                        a["rounds"].append(tokens / (last - first))
                    a["per"].extend(t for r in good if (t := r.decode_tok_s) is not None)
                    for r in good:
                        a["itl"].extend(r.itl_s)
            for ep in bench.endpoints:
                a = acc[ep.label]
                ep.itl_samples.extend(a["itl"])
                ep.results[self.report_field].append(DecodePoint(
                    concurrency=c, aggregate_tok_s=summary_of(a["rounds"]), per_request_tok_s=summary_of(a["per"]),
                    itl_s=summary_of(a["itl"]), round_tok_s=a["rounds"], failed=a["failed"]))

    def summary_lines(self, e) -> list[str]:
        lines = []
        for d in e.decode:
            if d.aggregate_tok_s:
                per = f" (per request p50 {d.per_request_tok_s.p50:.1f} tok/s)" if d.per_request_tok_s else ""
                lines.append(f"  decode x{d.concurrency}: {d.aggregate_tok_s.p50:.1f} tok/s in all{per}")
        return lines

    def html(self, e) -> list[str]:
        if not e.decode:
            return []
        return ["<h3>Decode</h3>" + table(
            [Column("concurrent", "requests"), Column("all requests, p50 of rounds", "tok/s"),
             Column("all requests, mean of rounds", "tok/s"), Column("per request p50", "tok/s"),
             Column("ITL p50", "ms"), Column("ITL p90", "ms"), Column("ITL p99", "ms"), Column("failed", "requests")],
            [[d.concurrency, d.aggregate_tok_s and d.aggregate_tok_s.p50, d.aggregate_tok_s and d.aggregate_tok_s.mean,
              d.per_request_tok_s and d.per_request_tok_s.p50, ms(d.itl_s and d.itl_s.p50),
              ms(d.itl_s and d.itl_s.p90), ms(d.itl_s and d.itl_s.p99), d.failed] for d in e.decode])]

    def plots(self, report) -> dict[str, bytes | None]:
        return {"decode.png": decode_plot(report)}


def decode_plot(report) -> bytes | None:
    if not any(d.aggregate_tok_s for e in report.endpoints for d in e.decode):
        return None
    plt, fig, ax = plots.figure()
    for color, e in zip(plots.COLORS, report.endpoints):
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
    plots.finish_axes(ax, "concurrent requests", "decode speed (tok/s)", "Decode speed against concurrency")
    return plots.png(plt, fig)


PHASE = Decode()
