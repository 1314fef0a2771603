"""The structured phase: JSON-schema answers under concurrency; every one must validate.

This is the request that hit mtp-03's HTTP 500 (seed section 8). A failed request counts in
``failed``, an answer that does not validate in ``invalid`` with why.
"""

from __future__ import annotations

import html as _html

from flashnext.serving.bench.phases.base import Choice, Int, Option, PhaseDefaults

# How a server is asked for a schema: OpenAI's (vLLM's) ``json_schema``, or llama.cpp's server's
# ``json_object`` with a ``schema`` beside it (workloads.structured_response_format builds each).
FORMATS = ("json_schema", "json_object")


class Structured(PhaseDefaults):
    name = "structured"
    help = "JSON-schema answers under concurrency; every one must validate"
    report_field = "structured"
    server_text = frozenset({"invalid"})
    options = (
        Option("--structured-requests", "structured_requests", Int(1), 8,
               "JSON-schema requests; every answer must validate."),
        Option("--structured-concurrency", "structured_concurrency", Int(1), 4, "JSON-schema requests in flight at once."),
        Option("--structured-max-tokens", "structured_max_tokens", Int(1), 256,
               "Answer length for a JSON-schema request."),
        Option("--structured-format", "structured_format", Choice(FORMATS), "json_schema",
               "How to ask for the schema: OpenAI's json_schema (vLLM), or json_object with a schema (llama.cpp's "
               "server)."),
    )

    def planned_requests(self, s) -> int:
        return s.structured_requests

    async def run(self, bench) -> None:
        from flashnext.serving.bench import workloads
        from flashnext.serving.bench.report import StructuredResult

        s = bench.settings
        acc = {ep.label: ([], 0) for ep in bench.endpoints}
        fmt = workloads.structured_response_format(s.structured_format)
        for start in range(0, s.structured_requests, s.structured_concurrency):
            slots = range(start, min(start + s.structured_concurrency, s.structured_requests))
            for ep in bench.endpoints:
                done = await bench.send(ep, self.name, [
                    bench.body(ep, workloads.structured_prompt(i), s.structured_max_tokens, response_format=fmt)
                    for i in slots])
                invalid, failed = acc[ep.label]
                for i, r in zip(slots, done):
                    if not r.ok:
                        failed += 1
                    elif (why := workloads.validate_structured(r.text)) is not None:
                        invalid.append(f"request {i}: {why}")
                acc[ep.label] = (invalid, failed)
        for ep in bench.endpoints:
            invalid, failed = acc[ep.label]
            ep.results[self.report_field] = StructuredResult(
                requests=s.structured_requests, concurrency=s.structured_concurrency,
                valid=s.structured_requests - len(invalid) - failed, invalid=invalid, failed=failed)

    def problems(self, e) -> list[str]:
        st = e.structured
        if not (st and st.invalid):
            return []
        return [f"{e.label}: {len(st.invalid)} of {st.requests} structured answers do not validate ({st.invalid[0]})"]

    def summary(self, e) -> dict:
        return {"structured_valid": e.structured.valid if e.structured else None}

    def summary_lines(self, e) -> list[str]:
        return [f"  structured: {e.structured.valid} of {e.structured.requests} valid"] if e.structured else []

    def html(self, e) -> list[str]:
        st = e.structured
        if not st:
            return []
        return [f"<h3>Structured output: {st.valid} of {st.requests} valid at {st.concurrency} concurrent"
                f" ({st.failed} requests failed)</h3>"
                + "".join(f"<p class=bad>{_html.escape(r)}</p>" for r in st.invalid[:20])]


PHASE = Structured()
