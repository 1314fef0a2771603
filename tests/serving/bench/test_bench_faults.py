"""``flashnext bench`` against a server that misbehaves: every failure is reported, none ends the run.

The stand-in (tests/support/fault_server.py) exists only for what a real server will not do on
demand: stall, drop a stream, send a chunk that is not JSON, fail with a 500 or mid-stream.
"""

import json

import jsonschema
from click.testing import CliRunner

from flashnext.serving.bench.advice import advice_for
from flashnext.tools.cli import main
from support import ROOT
from support.fault_server import BEHAVIOURS, FaultServer

SMALL = ["--prompt-tokens", "64", "--concurrency", "1,2", "--decode-concurrency", "1,3", "--decode-tokens", "8",
         "--repeats", "2", "--needle-tokens", "256", "--needle-depths", "0.2,0.8", "--structured-requests", "4",
         "--structured-concurrency", "2", "--stall-timeout", "1", "--no-progress"]


def _bench(url, out, *extra):
    return CliRunner().invoke(main, ["bench", url, "--out", str(out), *SMALL, *extra])


def test_every_fault_is_counted_and_the_report_is_written(tmp_path):
    with FaultServer() as server:
        done = _bench(server.url, tmp_path / "run")
    assert done.exit_code == 0, done.output
    assert set(server.served) == set(BEHAVIOURS), server.served
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    jsonschema.validate(report, json.loads((ROOT / "manifests" / "bench-report.schema.json").read_text()))
    e = report["endpoints"][0]
    # stall -> stall; drop and no_finish -> dropped; invalid chunk -> invalid_json; 500 and an error event -> http
    assert set(e["errors"]) == {"stall", "dropped", "invalid_json", "http"}
    served = server.served
    assert e["errors"]["stall"] == served["stall"]
    assert e["errors"]["dropped"] == served["drop"] + served["no_finish"]
    assert e["errors"]["http"] == served["http_500"] + served["error_event"]
    assert e["requests"] == sum(served.values()) - 6  # the probe's six are not counted
    assert {s["kind"] for s in e["error_samples"]} == set(e["errors"])
    # The requests that did answer were measured.
    assert any(p["cold_ttft_s"] or p["warm_ttft_s"] for p in e["latency"])
    assert any(d["aggregate_tok_s"] for d in e["decode"])
    assert e["capabilities"] == {"ignore_eos": True, "logprobs": True, "usage": True}
    failed_needles = [n for n in e["needle"] if n["error"]]
    assert failed_needles and not any(n["found"] for n in failed_needles)
    assert "problem: this run:" in done.output and "requests failed" in done.output
    html = (tmp_path / "run" / "report.html").read_text()
    assert "Failed requests" in html and "injected" in html


def test_fail_on_errors_exits_1_after_writing_the_report(tmp_path):
    with FaultServer(schedule=("ok", "ok", "drop")) as server:
        done = _bench(server.url, tmp_path / "run", "--phases", "decode", "--fail-on-errors")
    assert done.exit_code == 1
    assert done.output.strip().splitlines()[-1].startswith("Error: ")
    assert (tmp_path / "run" / "report.json").is_file()


def test_a_stream_that_only_stalls_is_a_stall_not_a_hang(tmp_path):
    with FaultServer(schedule=("stall",)) as server:
        done = _bench(server.url, tmp_path / "run", "--phases", "decode", "--decode-concurrency", "2", "--json")
    assert done.exit_code == 0, done.output
    result = json.loads(done.output[done.output.index("{"):])
    assert result["problems"] == ["this run: 6 of 6 requests failed (stall 6)"]
    assert result["advice"] == ["this run, decode: 6 stall: " + advice_for("decode", "stall", None, [], "json_schema")]
