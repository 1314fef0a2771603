"""Issue 26, class 5: ``flashnext bench`` always writes its report.

The real ``flashnext bench`` command runs against the misbehaving stand-in server
(tests/support/fault_server.py), whose URL carries credentials (``user:pass@`` and
``?api_key=``). A hostile answer is one counted failure with its reason, and report.json is still
written, strict JSON; what cannot be measured at all (a served model id that is not a name, a bad
``--baseline``, a value JSON cannot carry) is refused in one line with exit 1 (2 for a bad option
value) before a single request is sent. No secret of the URL appears in any file written, nor in
the output.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jsonschema
import pytest
from click.testing import CliRunner

from flashnext.tools.cli import main as cli
from support import ROOT
from support.fault_server import HOSTILE, FaultServer

USER, PASSWORD, TOKEN = "benchuser", "s3cret-pass-771", "sk-query-token-9c1"
SECRETS = (USER, PASSWORD, TOKEN)

# Two decode rounds (A/B noise floor and all) and one needle: three measured requests.
ARGS = ["--phases", "decode,needle", "--decode-concurrency", "1", "--decode-tokens", "8", "--warmup", "0",
        "--repeats", "2", "--needle-tokens", "256", "--needle-depths", "0.5", "--needle-concurrency", "1",
        "--top-logprobs", "2", "--stall-timeout", "2", "--request-timeout", "20", "--no-progress"]
MEASURED = 3
SCHEMA = json.loads((ROOT / "manifests" / "bench-report.schema.json").read_text())


def secret_url(server: FaultServer) -> str:
    return f"http://{USER}:{PASSWORD}@127.0.0.1:{server.port}/v1?api_key={TOKEN}"


def bench(url: str, out: Path, *extra: str):
    return CliRunner().invoke(cli, ["bench", url, "--out", str(out), *ARGS, *extra])


def _no_constant(name: str):
    raise AssertionError(f"report.json holds {name}")


def strict_report(out: Path) -> dict:
    report = json.loads((out / "report.json").read_text(encoding="utf-8"), parse_constant=_no_constant)
    jsonschema.validate(report, SCHEMA)
    return report


def assert_no_secret(done, out: Path | None = None) -> None:
    said = done.output + (done.stderr or "")
    for secret in SECRETS:
        assert secret not in said, said
    if out is not None and out.exists():
        for path in out.rglob("*"):
            data = path.read_bytes()
            for secret in SECRETS:
                assert secret.encode() not in data, f"{secret} in {path.name}"


def one_error_line(done, code: int = 1) -> str:
    assert done.exit_code == code, (done.exit_code, done.output, repr(done.exception))
    lines = [line for line in done.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), done.output
    return lines[0]


# --- server answers: each one a counted failure, the report written ---------------------------------

@dataclass(frozen=True)
class Fault:
    id: str
    behaviour: str   # fault_server.HOSTILE
    reason: str      # the report's errors key (client.ERROR_KINDS)


FAULTS = [
    Fault("lone-surrogate-in-text", "lone_surrogate", "invalid_json"),
    Fault("nan-logprob", "nan_logprob", "invalid_json"),
    Fault("infinity-logprob", "inf_logprob", "invalid_json"),
    Fault("logprob-overflows-to-infinity", "overflow_logprob", "invalid_json"),
    Fault("positive-logprob", "positive_logprob", "invalid_chunk"),
    Fault("token-not-a-string", "token_not_string", "invalid_chunk"),
    Fault("choices-an-object", "choices_object", "invalid_chunk"),
    Fault("choice-not-an-object", "choice_not_object", "invalid_chunk"),
    Fault("content-not-a-string", "content_not_string", "invalid_chunk"),
    Fault("json-nested-100000-deep", "deep_json", "invalid_json"),
    Fault("usage-strings", "usage_wrong_type", "invalid_chunk"),
    Fault("usage-an-array", "usage_not_object", "invalid_chunk"),
    Fault("usage-10e33-tokens", "usage_absurd", "absurd_usage"),
    Fault("usage-negative", "usage_negative", "absurd_usage"),
    Fault("line-that-never-ends", "endless_line", "too_large"),
    Fault("answer-that-never-ends", "endless_answer", "too_large"),
    Fault("error-page-echoes-credentials", "echo_secret", "http"),
]
assert {f.behaviour for f in FAULTS} == set(HOSTILE)


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.id)
def test_a_hostile_answer_is_a_counted_failure_and_the_report_is_written(fault, tmp_path):
    out = tmp_path / "run"
    with FaultServer(schedule=(fault.behaviour,)) as server:
        done = bench(secret_url(server), out)
    assert done.exit_code == 0, (done.output, repr(done.exception))
    assert server.served[fault.behaviour] == MEASURED
    report = strict_report(out)
    e = report["endpoints"][0]
    assert e["errors"] == {fault.reason: MEASURED}
    assert [s["kind"] for s in e["error_samples"]] == [fault.reason] * MEASURED
    assert all(s["detail"] for s in e["error_samples"])
    assert f"{MEASURED} of {MEASURED} requests failed ({fault.reason} {MEASURED})" in done.output
    (out / "report.html").read_text(encoding="utf-8")
    # Shown redacted, and still sent: every request carried the credentials.
    assert e["url"] == f"http://***@127.0.0.1:{server.port}/v1?api_key=***"
    assert all(f"api_key={TOKEN}" in target and auth for _, target, auth in server.requests)
    assert_no_secret(done, out)


def test_absurd_counts_among_good_answers_are_flagged_not_measured(tmp_path):
    out = tmp_path / "run"
    with FaultServer(schedule=("ok", "usage_absurd")) as server:
        done = bench(secret_url(server), out, "--repeats", "4")
    assert done.exit_code == 0, done.output
    e = strict_report(out)["endpoints"][0]
    assert e["errors"] == {"absurd_usage": server.served["usage_absurd"]}
    rates = [r for d in e["decode"] for r in d["round_tok_s"]]
    assert rates and max(rates) < 1e6, rates  # the stand-in writes a token every 2 ms
    assert_no_secret(done, out)


# --- /v1/models: a served model id that is not a name is refused before the run -------------------

@pytest.mark.parametrize("models, words", [
    ("int_id", "data[0].id is an integer, not a model name"),
    ("surrogate_id", "a lone surrogate"),
    ("deep", "nested more than"),
    ("endless", "answered more than"),
], ids=lambda v: v if v in ("int_id", "surrogate_id", "deep", "endless") else "")
def test_a_models_answer_that_names_no_model_is_one_line(models, words, tmp_path):
    with FaultServer(models=models) as server:
        done = bench(secret_url(server), tmp_path / "run")
    line = one_error_line(done)
    assert words in line and "--model" in line
    assert not (tmp_path / "run").exists()
    assert [r[0] for r in server.requests] == ["GET"]  # /v1/models only: no completion was sent
    assert_no_secret(done)


# --- --baseline: checked before the run ---------------------------------------------------------------

@pytest.fixture(scope="module")
def good_report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("baseline") / "run"
    with FaultServer(schedule=("ok",)) as server:
        done = bench(server.url, out)
    assert done.exit_code == 0, done.output
    return strict_report(out)


def _edited(edit: Callable[[dict], None]) -> Callable[[dict], bytes]:
    def make(good: dict) -> bytes:
        doc = json.loads(json.dumps(good))
        edit(doc)
        return json.dumps(doc).encode()  # allow_nan: NaN is written as it is
    return make


def _greedy(doc: dict) -> dict:
    return doc["endpoints"][0]["greedy_answers"][0]


def _replace_a_float(good: dict, text: str) -> bytes:
    doc = json.loads(json.dumps(good))
    doc["endpoints"][0]["decode"][0]["aggregate_tok_s"]["p50"] = 123456.5
    return json.dumps(doc).replace("123456.5", text).encode()


def _nested(good: dict) -> bytes:
    return b'{"schema_version": 1, "notes": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"


@dataclass(frozen=True)
class Baseline:
    id: str
    content: Callable[[dict], bytes] | None  # None: no file; "fifo": a FIFO
    message: str
    fifo: bool = False


BASELINES = [
    Baseline("missing", None, "no such report"),
    Baseline("empty", lambda g: b"", "empty"),
    Baseline("not-json", lambda g: b'{"schema_version": 1,', "not valid JSON"),
    Baseline("not-utf8", lambda g: b'{"notes": ["\xff\xfe"]}', "not UTF-8"),
    Baseline("wrong-shape", lambda g: b"[1, 2, 3]", "not a flashnext bench report"),
    Baseline("no-endpoints", _edited(lambda d: d.update(endpoints=[])), "no endpoint to compare with"),
    Baseline("nan", lambda g: _replace_a_float(g, "NaN"), "NaN is not JSON"),
    Baseline("infinity", lambda g: _replace_a_float(g, "Infinity"), "Infinity is not JSON"),
    Baseline("number-overflows", lambda g: _replace_a_float(g, "1e999"), "out of range"),
    Baseline("lone-surrogate", _edited(lambda d: d.update(started_at="\ud800")), "a lone surrogate"),
    Baseline("nested-50000-deep", _nested, "nested more than"),
    Baseline("tokens-without-logprobs", _edited(lambda d: _greedy(d).update(logprobs=None)), "given together"),
    Baseline("fewer-logprobs-than-tokens", _edited(lambda d: _greedy(d)["logprobs"].pop()), "one entry per token"),
    Baseline("positive-logprob", _edited(lambda d: _greedy(d)["logprobs"].__setitem__(0, 800.0)), "above 0"),
    Baseline("fifo", None, "is a FIFO, not a regular file", fifo=True),
]


@pytest.mark.parametrize("case", BASELINES, ids=lambda c: c.id)
def test_a_bad_baseline_is_one_line_before_any_request(case, good_report, tmp_path):
    path = tmp_path / "baseline.json"
    if case.fifo:
        os.mkfifo(path)
    elif case.content is not None:
        path.write_bytes(case.content(good_report))
    with FaultServer(schedule=("ok",)) as server:
        done = bench(secret_url(server), tmp_path / "run", "--baseline", str(path))
    line = one_error_line(done)
    assert case.message in line, line
    assert server.requests == []
    assert not (tmp_path / "run").exists()
    assert_no_secret(done)


def test_a_baseline_made_with_credentials_shows_them_redacted(good_report, tmp_path):
    old = json.loads(json.dumps(good_report))
    old["endpoints"][0]["url"] = f"http://{USER}:{PASSWORD}@gpu-box:8000/v1?api_key={TOKEN}"
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(old))
    out = tmp_path / "run"
    with FaultServer(schedule=("ok",)) as server:
        done = bench(server.url, out, "--baseline", str(path))
    assert done.exit_code == 0, done.output
    ab = strict_report(out)["ab"]
    assert ab["reference"]["name"] == "baseline" and ab["reference"]["url"] == "http://***@gpu-box:8000/v1?api_key=***"
    assert ab["agreement"]["answers"] > 0
    assert_no_secret(done, out)


# --- values that report.json could not carry, and URLs that cannot be used ----------------------------

@pytest.mark.parametrize("args, code, words", [
    (["--needle-depths", "nan"], 2, "finite"),
    (["--request-timeout", "nan"], 2, "finite"),
    (["--stall-timeout", "inf"], 2, "finite"),
    (["--prompt-tokens", "1e400k"], 2, "is not a comma-separated list"),
    (["--extra-body", '{"x": NaN}'], 1, "NaN is not JSON"),
    (["--extra-body", '{"x": 1e999}'], 1, "out of range"),
    (["--extra-body", '{"x": "\\ud800"}'], 1, "a lone surrogate"),
    (["--extra-body", "[" * 5000 + "]" * 5000], 1, "nested more than"),
], ids=["depth-nan", "timeout-nan", "stall-inf", "tokens-overflow", "extra-nan", "extra-overflow",
        "extra-surrogate", "extra-deep"])
def test_a_value_report_json_cannot_carry_is_refused_before_any_request(args, code, words, tmp_path):
    with FaultServer(schedule=("ok",)) as server:
        done = bench(secret_url(server), tmp_path / "run", *args)
    assert done.exit_code == code, (done.output, repr(done.exception))
    assert words in done.output
    assert server.requests == []
    assert not (tmp_path / "run").exists()
    assert_no_secret(done)


@pytest.mark.parametrize("url, words", [
    (f"http://{USER}:{PASSWORD}@[::1/v1?api_key={TOKEN}", "not a valid URL"),
    (f"ftp://{USER}:{PASSWORD}@127.0.0.1/v1?api_key={TOKEN}", "give an http:// or https:// URL"),
], ids=["unparseable", "not-http"])
def test_an_unusable_url_is_one_line_without_its_credentials(url, words, tmp_path):
    done = bench(url, tmp_path / "run")
    assert words in one_error_line(done)
    assert not (tmp_path / "run").exists()
    assert_no_secret(done)


def test_a_query_value_that_is_also_a_word_of_the_report_leaves_its_fields_valid(good_report, tmp_path):
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(good_report))
    out = tmp_path / "run"
    with FaultServer(schedule=("ok",)) as server:
        url = f"{secret_url(server)}&mode=tokens&format=json_schema"
        done = bench(url, out, "--baseline", str(path))
    assert done.exit_code == 0, (done.output, repr(done.exception))
    report = strict_report(out)
    assert report["ab"]["agreement"]["by"] == "tokens"
    assert report["settings"]["structured_format"] == "json_schema"
    assert_no_secret(done, out)


def _huge_metrics(n: int) -> str:
    """A /metrics page of values each a float, whose sums are not: two engines at 1e308 for every
    gauge and counter vLLM names, and a GPU-step histogram of 1e308 steps on two graphs."""
    from flashnext.serving.bench.server_state import COUNTERS, GAUGES, GPU_STEP

    lines = [f'{name}{{engine="{e}"}} 1e308' for name in GAUGES.values() for e in (0, 1)]
    lines += [f'{name}_total{{engine="{e}"}} 1e308' for name in COUNTERS.values() for e in (0, 1)]
    for graph in ("FULL", "PIECEWISE"):
        labels = f'dp_rank="0",pp_rank="0",tp_rank="0",graph="{graph}",tokens="1"'
        lines += [f'{GPU_STEP}_bucket{{{labels},le="0.01"}} 1e308', f'{GPU_STEP}_bucket{{{labels},le="+Inf"}} 1e308',
                  f'{GPU_STEP}_count{{{labels}}} 1e308', f'{GPU_STEP}_sum{{{labels}}} 1e308']
    return "\n".join(lines) + "\n"


def test_metrics_past_the_largest_float_leave_the_report_whole(tmp_path):
    """Issue 42, item 5: a server whose /metrics sums past the largest float (1e308 + 1e308) cost bench
    its whole run (exit 70, a ValidationError in ServerWindow). Now those numbers are left out and the
    report is written, strict JSON."""
    out = tmp_path / "run"
    with FaultServer(schedule=("ok",), interval_s=0.01, metrics=_huge_metrics) as server:
        done = CliRunner().invoke(cli, ["bench", server.url, "--out", str(out), "--phases", "decode",
                                        "--decode-concurrency", "1", "--repeats", "1", "--warmup", "0",
                                        "--metrics-interval", "0.05", "--no-progress"])
    assert done.exit_code == 0, done.output
    [e] = strict_report(out)["endpoints"]
    for phase in e["server_state"]["phases"]:
        assert phase["running_mean"] is None  # two engines' 1e308 sum to no number
        assert phase["kv_cache_usage_mean"] == phase["kv_cache_usage_max"] == 1e308  # the fullest engine's
        assert phase["preemptions"] is None and phase["prefix_cache_hit_rate"] is None
