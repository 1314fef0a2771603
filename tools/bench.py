"""``flashnext bench URL``: measure a served endpoint, or A/B two, and write a report with plots."""

from __future__ import annotations

import math
from pathlib import Path

import click

from flashnext.tools._common import emit_json, json_option, user_errors


def _items(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


class _ListOf(click.ParamType):
    """A comma-separated list: ``4096,32768`` (``k`` suffix for thousands: ``8k``, ``262144`` as is)."""

    def __init__(self, kind: type, low: float, high: float | None = None):
        self.kind, self.low, self.high = kind, low, high
        self.name = f"{kind.__name__}[,{kind.__name__}...]"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            out = [self.kind(float(x[:-1]) * 1024) if x.lower().endswith("k") and self.kind is int else self.kind(x)
                   for x in _items(value)]
        except (ValueError, OverflowError):
            self.fail(f"{value!r} is not a comma-separated list of {self.kind.__name__}s", param, ctx)
        if not all(math.isfinite(x) for x in out):  # report.json holds no NaN or Infinity
            self.fail(f"{value!r}: give finite numbers", param, ctx)
        if not out:
            self.fail("give at least one value", param, ctx)
        bad = [x for x in out if x < self.low or (self.high is not None and x > self.high)]
        if bad:
            self.fail(f"{bad[0]} is out of range [{self.low}, {self.high if self.high is not None else '∞'}]", param, ctx)
        return out


class _Seconds(click.FloatRange):
    """Seconds, more than zero and finite (report.json holds no Infinity, and no NaN)."""

    def __init__(self):
        super().__init__(min=0, min_open=True)

    def convert(self, value, param, ctx):
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return seconds


def _phases(value: str) -> list[str]:
    from flashnext.serving.bench import PHASES

    got = _items(value)
    unknown = [p for p in got if p not in PHASES]
    if unknown or not got:
        raise click.BadParameter(f"choose from {', '.join(PHASES)} (comma-separated)", param_hint="--phases")
    return [p for p in PHASES if p in got]


@click.command("bench")
@click.argument("url")
@click.option("--against", "against", default=None, metavar="URL",
              help='A second endpoint ("against"), measured side by side with URL ("this run"), round by round.')
@click.option("--baseline", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="A report.json of an earlier run (e.g. with a patch switch off) to A/B this run against.")
@click.option("--allow-different-settings", is_flag=True,
              help="Compare with a --baseline measured with other settings (the report lists them).")
@click.option("--model", default=None, help="Served model name; default: the first of the server's /v1/models.")
@click.option("--against-model", default=None, help="The --against server's model name, if not the same as --model.")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="Output directory: report.json, PNG plots, report.html.")
@click.option("--force", is_flag=True, help="Replace --out if an earlier flashnext bench made it.")
@click.option("--phases", default="latency,decode,needle,structured", show_default=True,
              help="Which phases to run (comma-separated).")
@click.option("--prompt-tokens", type=_ListOf(int, 1), default="512,4096,32768", show_default=True,
              help="Prompt lengths for TTFT and ITL.")
@click.option("--concurrency", type=_ListOf(int, 1, 1024), default="1,4", show_default=True,
              help="Concurrent requests for TTFT and ITL.")
@click.option("--decode-concurrency", type=_ListOf(int, 1, 1024), default="1,2,4", show_default=True,
              help="Concurrent requests for decode tok/s.")
@click.option("--decode-tokens", type=click.IntRange(2), default=400, show_default=True,
              help="Tokens each decode request generates (ignore_eos where the server accepts it).")
@click.option("--ttft-max-tokens", type=click.IntRange(1), default=16, show_default=True,
              help="Tokens each TTFT request generates (its ITL samples).")
@click.option("--warmup", type=click.IntRange(0), default=1, show_default=True, help="Warm-up rounds per point.")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True, help="Measured rounds per point.")
@click.option("--needle-tokens", type=_ListOf(int, 64), default="32768", show_default=True,
              help="Haystack lengths for needle-in-a-haystack (e.g. 262144).")
@click.option("--needle-depths", type=_ListOf(float, 0.0, 1.0), default="0.1,0.5,0.9", show_default=True,
              help="Where the needle sits in the haystack (0 start, 1 end).")
@click.option("--needle-concurrency", type=click.IntRange(1), default=4, show_default=True,
              help="Needle requests in flight at once.")
@click.option("--needle-max-tokens", type=click.IntRange(1), default=64, show_default=True,
              help="Answer length for a needle (thinking models: raise it, or turn thinking off in --extra-body).")
@click.option("--structured-requests", type=click.IntRange(1), default=8, show_default=True,
              help="JSON-schema requests; every answer must validate.")
@click.option("--structured-concurrency", type=click.IntRange(1), default=4, show_default=True,
              help="JSON-schema requests in flight at once.")
@click.option("--structured-max-tokens", type=click.IntRange(1), default=256, show_default=True,
              help="Answer length for a JSON-schema request.")
@click.option("--structured-format", type=click.Choice(["json_schema", "json_object"]), default="json_schema",
              show_default=True, help="How to ask for the schema: OpenAI's json_schema (vLLM), or json_object "
              "with a schema (llama.cpp's server).")
@click.option("--top-logprobs", type=click.IntRange(0, 20), default=5, show_default=True,
              help="Top-k logprobs per decode token, for A/B agreement and KL (0: none).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed and prompt seed.")
@click.option("--request-timeout", type=_Seconds(), default=1800.0, show_default=True,
              help="Seconds a request may take in all.")
@click.option("--stall-timeout", type=_Seconds(), default=120.0, show_default=True,
              help="Seconds a stream may stay silent before it counts as stalled.")
@click.option("--extra-body", default="{}", show_default=True,
              help='JSON merged into every request, e.g. \'{"chat_template_kwargs": {"enable_thinking": false}}\'.')
@click.option("--fail-on-errors", is_flag=True,
              help="Exit 1 when any request failed, an answer missed its needle or a structured answer is invalid.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar on stderr.")
@json_option
@user_errors
def main(url, against, baseline, allow_different_settings, model, against_model, out, force, phases, prompt_tokens,
         concurrency, decode_concurrency, decode_tokens, ttft_max_tokens, warmup, repeats, needle_tokens, needle_depths, needle_concurrency,
         needle_max_tokens, structured_requests, structured_concurrency, structured_max_tokens, structured_format,
         top_logprobs, seed, request_timeout, stall_timeout, extra_body, fail_on_errors, progress, as_json):
    """Measure the OpenAI-compatible server at URL as seed 000 does, and write OUT/report.json,
    PNG plots and one self-contained OUT/report.html.

    \b
    Phases (--phases):
      latency     TTFT as the client sees it (cold: text nobody sent before; warm: fixed prompts after
                  --warmup rounds) and ITL p50/p90/p99, per prompt length and concurrency
      decode      tok/s with 1..N requests generating at once
      needle      a pass key hidden in a haystack; the answer must name it
      structured  JSON-schema answers under concurrency; every one must validate
    A/B: --against URL2 runs both side by side, round by round; --baseline compares with a saved run
    (for a patch switch: run with it on, restart with it off, run with --baseline). Both give
    token agreement and, where the servers return logprobs, mean KL divergence.

    \b
    Example (the seed's figures on the 3x3090 rig):
      flashnext bench http://127.0.0.1:8000 --out bench/run1 --decode-concurrency 1,2,4 \\
          --needle-tokens 262144 --needle-depths 0.5 --needle-concurrency 4
    """
    import importlib.util

    from flashnext.errors import FlashnextError, UsageError

    # Checked before a run, not when the plots are drawn after an hour of measuring.
    missing = [m for m in ("httpx", "matplotlib", "jsonschema") if importlib.util.find_spec(m) is None]
    if missing:
        raise FlashnextError(f"flashnext bench needs {', '.join(missing)}: pip install 'flashnext[bench]'")
    from flashnext.serving.bench import Bench, Settings, load_report, write_outputs
    from flashnext.serving.bench.client import Malformed, parse_strict

    try:
        extra = parse_strict(extra_body, "--extra-body")
    except Malformed as e:
        raise FlashnextError(f"--extra-body is not JSON a request can carry ({str(e).removeprefix('--extra-body: ')})") from None
    if not isinstance(extra, dict):
        raise FlashnextError("--extra-body must be a JSON object")
    if against and baseline:
        raise UsageError("give --against or --baseline, not both")
    base = load_report(baseline) if baseline else None
    settings = Settings(
        prompt_tokens=prompt_tokens, concurrency=concurrency, decode_concurrency=decode_concurrency,
        decode_tokens=decode_tokens, ttft_max_tokens=ttft_max_tokens, warmup=warmup, repeats=repeats,
        needle_tokens=needle_tokens, needle_depths=needle_depths, needle_concurrency=needle_concurrency,
        needle_max_tokens=needle_max_tokens, structured_requests=structured_requests,
        structured_concurrency=structured_concurrency, structured_max_tokens=structured_max_tokens,
        structured_format=structured_format, top_logprobs=top_logprobs, seed=seed,
        request_timeout_s=request_timeout, stall_timeout_s=stall_timeout,
        phases=_phases(phases), extra_body=extra)
    if against_model and not against:
        raise UsageError("--against-model needs --against URL")
    bench = Bench(settings, [url, against] if against else [url], models=[model, against_model or model],
                  baseline=base, allow_different_settings=allow_different_settings)
    _check_out(out, force)
    if progress:
        from tqdm import tqdm

        with tqdm(total=bench.planned_requests(), unit="req", desc="bench", dynamic_ncols=True) as bar:
            bench.progress = bar.update
            report = bench.run()
    else:
        report = bench.run()
    files = write_outputs(report, out, force=force)
    from flashnext.serving.bench import summary

    problems, advice = summary.problems(report), summary.advice(report)
    if as_json:
        emit_json({"out": str(out), "files": files, "summary": summary.summary(report), "problems": problems,
                   "advice": advice})
    else:
        for line in summary.summary_lines(report):
            click.echo(line)
        for line in problems:
            click.echo(f"problem: {line}")
        for line in advice:
            click.echo(f"what to change: {line}")
        click.echo(f"wrote {out}/report.html ({', '.join(files)})")
    if fail_on_errors and problems:
        raise FlashnextError(f"{len(problems)} problem(s): {problems[0]}")


def _check_out(out: Path, force: bool) -> None:
    """Refuse a taken --out before the run, not after an hour of measuring."""
    from flashnext.errors import FlashnextError
    from flashnext.quant.checkpoint.fsutil import require_flashnext_output

    if out.exists() or out.is_symlink():
        if not force:
            raise FlashnextError(f"{out} already exists: choose another --out or pass --force")
        require_flashnext_output(out)
