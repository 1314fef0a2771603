"""The needle phase: a pass key hidden in a haystack at a chosen depth; the answer must name it.

A request that failed is a failure of its kind, never a miss: its result has ``found: null``, and
only answered needles are scored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashnext.serving.bench.phases.base import Floats, Int, Ints, Option, PhaseDefaults
from flashnext.serving.bench.plots import Column, ms, table

if TYPE_CHECKING:
    from flashnext.serving.bench.report import NeedleResult


class Needle(PhaseDefaults):
    name = "needle"
    help = "a pass key hidden in a haystack; the answer must name it"
    report_field = "needle"
    server_text = frozenset({"answer", "error"})
    options = (
        Option("--needle-tokens", "needle_tokens", Ints(64), "32768",
               "Haystack lengths for needle-in-a-haystack (e.g. 262144)."),
        Option("--needle-depths", "needle_depths", Floats(0.0, 1.0), "0.1,0.5,0.9",
               "Where the needle sits in the haystack (0 start, 1 end)."),
        Option("--needle-concurrency", "needle_concurrency", Int(1), 4, "Needle requests in flight at once."),
        Option("--needle-max-tokens", "needle_max_tokens", Int(1), 64,
               "Answer length for a needle (thinking models: raise it, or turn thinking off in --extra-body)."),
    )

    def empty_result(self) -> list[NeedleResult]:
        return []

    def planned_requests(self, s) -> int:
        return len(s.needle_tokens) * len(s.needle_depths)

    async def run(self, bench) -> None:
        from flashnext.serving.bench import workloads
        from flashnext.serving.bench.report import NeedleResult

        s = bench.settings
        cases = [(t, d) for t in s.needle_tokens for d in s.needle_depths]
        for start in range(0, len(cases), s.needle_concurrency):
            batch = cases[start:start + s.needle_concurrency]
            for ep in bench.endpoints:
                needles = [workloads.needle_prompt(t, d, ep.text_scale, s.seed) for t, d in batch]
                done = await bench.send(ep, self.name, [bench.body(ep, n.prompt, s.needle_max_tokens) for n in needles])
                for n, r in zip(needles, done):
                    ep.results[self.report_field].append(NeedleResult(
                        context_tokens=n.context_tokens, depth=n.depth, measured_prompt_tokens=r.prompt_tokens,
                        key=n.key, found=n.score(r.text) if r.ok else None, answer=r.text[:200], ttft_s=r.ttft_s,
                        error=None if r.ok else f"{r.error}: {r.error_detail}"))

    def problems(self, e) -> list[str]:
        answered = [n for n in e.needle if n.found is not None]
        missed = [n for n in answered if not n.found]
        return [f"{e.label}: needle missed in {len(missed)} of {len(answered)} answers"] if missed else []

    def summary(self, e) -> dict:
        return {"needle_found": sum(bool(n.found) for n in e.needle),
                "needle_answered": sum(n.found is not None for n in e.needle), "needle_total": len(e.needle)}

    def summary_lines(self, e) -> list[str]:
        if not e.needle:
            return []
        answered = sum(n.found is not None for n in e.needle)
        failed = f" ({len(e.needle) - answered} requests failed)" if answered < len(e.needle) else ""
        return [f"  needle: found {sum(bool(n.found) for n in e.needle)} of {answered} answered{failed}"]

    def html(self, e) -> list[str]:
        if not e.needle:
            return []
        answered = [n for n in e.needle if n.found is not None]
        found = sum(bool(n.found) for n in answered)
        failed = len(e.needle) - len(answered)
        return [f"<h3>Needle in a haystack: found {found} of {len(answered)} answered"
                + (f" ({failed} requests failed)" if failed else "") + "</h3>" + table(
            [Column("context", "tokens"), Column("measured prompt", "tokens"), Column("depth", "fraction of context"),
             Column("key"), Column("found"), Column("TTFT", "ms"), Column("answer"), Column("failure")],
            [[n.context_tokens, n.measured_prompt_tokens, n.depth, n.key, n.found, ms(n.ttft_s), n.answer[:80],
              n.error] for n in e.needle])]


PHASE = Needle()
