"""Issue 32, items 3 and 4: the bench report says why requests failed, and is easy to read.

Failures are kept by phase and kind (every one counted, a few samples each) with what to change
when the cause is known; a request that failed is a failure, never a wrong answer. Every table
column carries its unit, latencies are milliseconds everywhere, the sides are named "this run",
"against" and "baseline" in report.json, the page and the plots, the A/B deltas carry the A/A noise
band, and a baseline measured with other settings is refused before any request.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

from flashnext.serving.bench import metrics, plots
from flashnext.serving.bench.advice import advice_for
from flashnext.serving.bench.runner import SAMPLES_PER_FAILURE
from flashnext.tools.cli import main
from support import ROOT
from support.fault_server import FaultServer

SCHEMA = json.loads((ROOT / "manifests" / "bench-report.schema.json").read_text())
QUICK = ["--decode-concurrency", "1", "--decode-tokens", "8", "--warmup", "0", "--repeats", "2",
         "--needle-tokens", "256", "--needle-depths", "0.5", "--needle-concurrency", "1", "--structured-requests", "2",
         "--structured-concurrency", "2", "--prompt-tokens", "64", "--concurrency", "1,2", "--top-logprobs", "2",
         "--stall-timeout", "2", "--request-timeout", "20", "--no-progress"]


def bench(url: str, out: Path, *extra: str):
    return CliRunner().invoke(main, ["bench", url, "--out", str(out), *QUICK, *extra])


def report_of(out: Path) -> dict:
    report = json.loads((out / "report.json").read_text())
    jsonschema.validate(report, SCHEMA)
    return report


def one_error_line(done) -> str:
    assert done.exit_code == 1, (done.exit_code, done.output, repr(done.exception))
    lines = [line for line in done.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), done.output
    return lines[0]


class RefusingServer(FaultServer):
    """The stand-in, answering the requests ``refuses`` picks with an HTTP error as a real server
    does: llama.cpp's server a json_schema response_format with 422, vLLM an unknown model with 404.
    The probe (at most two tokens) is always answered."""

    def __init__(self, status: int, message: str, refuses, **kw):
        super().__init__(**kw)
        self.status, self.message, self.refuses = status, message, refuses

    async def _respond(self, method, target, body, w, auth=None):
        if method == "POST" and int(body.get("max_tokens") or 16) > 2 and self.refuses(body):
            payload = json.dumps({"error": {"message": self.message}}).encode()
            w.write(b"HTTP/1.1 %d Refused\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (self.status, len(payload), payload))
            return True
        return await super()._respond(method, target, body, w, auth)


def _json_schema_format(body: dict) -> bool:
    return (body.get("response_format") or {}).get("type") == "json_schema"


# --- item 3: failures by phase and kind, all counted -------------------------------------------------

def test_thirty_failures_of_three_kinds_in_two_phases_are_all_counted_with_samples(tmp_path):
    out = tmp_path / "run"
    # decode 3 concurrent x 3 rounds and 21 structured requests: 30 requests, the schedule's 3 kinds in turn.
    with FaultServer(schedule=("drop", "http_500", "invalid_json")) as server:
        done = bench(server.url, out, "--phases", "decode,structured", "--decode-concurrency", "3", "--repeats", "3",
                     "--structured-requests", "21", "--structured-concurrency", "7")
    assert done.exit_code == 0, done.output
    e = report_of(out)["endpoints"][0]
    got = {(f["phase"], f["kind"], f["status"]): f["count"] for f in e["failures"]}
    assert got == {("decode", "dropped", None): 3, ("decode", "http", 500): 3, ("decode", "invalid_json", None): 3,
                   ("structured", "dropped", None): 7, ("structured", "http", 500): 7,
                   ("structured", "invalid_json", None): 7}
    assert e["errors"] == {"dropped": 10, "http": 10, "invalid_json": 10}
    for phase, kind, status in got:
        samples = [s for s in e["error_samples"] if (s["phase"], s["kind"], s["status"]) == (phase, kind, status)]
        assert 1 <= len(samples) <= SAMPLES_PER_FAILURE and all(s["detail"] for s in samples)
    page = (out / "report.html").read_text()
    assert all(f"<td class=n>{n}</td>" in page for n in (3, 7))


@dataclass(frozen=True)
class Cause:
    id: str
    server: callable          # () -> FaultServer
    args: tuple[str, ...]
    group: tuple              # (phase, kind, status) of the failures
    words: str                # what the advice says to change


CAUSES = [
    Cause("structured-422-from-llama.cpp",
          lambda: RefusingServer(422, "Unrecognized response_format type json_schema", _json_schema_format),
          ("--phases", "structured"), ("structured", "http", 422), "--structured-format json_object"),
    Cause("structured-500-from-llama-cpp-python",
          lambda: RefusingServer(500, "1 validation error: {'loc': ('body', 'response_format', 'type'), 'msg': "
                                 "\"Input should be 'text' or 'json_object'\"}", _json_schema_format),
          ("--phases", "structured"), ("structured", "http", 500), "--structured-format json_object"),
    Cause("structured-400-with-json_object",
          lambda: RefusingServer(400, "response_format json_object is not supported", lambda b: "response_format" in b),
          ("--phases", "structured", "--structured-format", "json_object"), ("structured", "http", 400),
          "--structured-format json_schema"),
    Cause("404-unknown-model", lambda: RefusingServer(404, "The model `x` does not exist.", lambda b: True),
          ("--phases", "decode", "--model", "x"), ("decode", "http", 404), "--model"),
    Cause("prompt-past-the-context",
          lambda: RefusingServer(400, "This model's maximum context length is 128 tokens", lambda b: True),
          ("--phases", "needle"), ("needle", "http", 400), "--needle-tokens"),
    Cause("stall", lambda: FaultServer(schedule=("stall",)), ("--phases", "decode", "--stall-timeout", "0.3"),
          ("decode", "stall", None), "--stall-timeout"),
    Cause("timeout", lambda: FaultServer(schedule=("stall",)),
          ("--phases", "decode", "--stall-timeout", "30", "--request-timeout", "0.5"), ("decode", "timeout", None),
          "--request-timeout"),
    Cause("dropped", lambda: FaultServer(schedule=("drop",)), ("--phases", "decode"), ("decode", "dropped", None),
          "see its log"),
]


@pytest.mark.parametrize("cause", CAUSES, ids=lambda c: c.id)
def test_a_known_cause_says_what_to_change(cause, tmp_path):
    out = tmp_path / "run"
    with cause.server() as server:
        done = bench(server.url, out, *cause.args, "--json")
    assert done.exit_code == 0, done.output
    e = report_of(out)["endpoints"][0]
    groups = {(f["phase"], f["kind"], f["status"]): f for f in e["failures"]}
    assert list(groups) == [cause.group], e["failures"]
    assert cause.words in groups[cause.group]["advice"]
    said = json.loads(done.output[done.output.index("{"):])
    assert len(said["advice"]) == 1 and cause.words in said["advice"][0]
    assert cause.words in (out / "report.html").read_text()


def test_connection_refused_asks_whether_the_server_is_up():
    assert "is the server up" in advice_for("latency", "connect", None, ["All connection attempts failed"],
                                            "json_schema")
    assert advice_for("decode", "invalid_json", None, ["event: not valid JSON"], "json_schema") is None
    # A 500 that does not name response_format is the server's own failure, whatever the phase.
    assert "see its log" in advice_for("structured", "http", 500, ["HTTP 500: CUDA error"], "json_schema")


def test_a_dropped_needle_request_is_a_failure_not_a_miss(tmp_path):
    out = tmp_path / "run"
    with FaultServer(schedule=("drop",)) as server:
        done = bench(server.url, out, "--phases", "needle", "--fail-on-errors")
    e = report_of(out)["endpoints"][0]
    [needle] = e["needle"]
    assert needle["found"] is None and needle["error"].startswith("dropped")
    assert e["failures"] == [{"phase": "needle", "kind": "dropped", "status": None, "count": 1,
                              "advice": advice_for("needle", "dropped", None, [], "json_schema")}]
    assert "needle missed" not in done.output
    assert "Error: 1 problem(s): this run: 1 of 1 requests failed (dropped 1)" in done.output
    assert "found 0 of 0 answered (1 requests failed)" in (out / "report.html").read_text()


def test_an_answered_needle_without_the_key_is_a_miss(tmp_path):
    out = tmp_path / "run"
    with FaultServer(schedule=("ok",)) as server:
        done = bench(server.url, out, "--phases", "needle")
    assert report_of(out)["endpoints"][0]["needle"][0]["found"] is False
    assert "needle missed in 1 of 1 answers" in done.output


# --- item 4: units, one naming of the sides, the noise band ------------------------------------------

class _Tables(HTMLParser):
    """Every <table> of a page: its header cells and its rows of cells."""

    def __init__(self):
        super().__init__()
        self.tables, self._cell, self._row = [], None, None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append({"head": [], "rows": []})
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data

    def handle_endtag(self, tag):
        if tag == "th":
            self.tables[-1]["head"].append(self._cell)
            self._cell = None
        elif tag == "td":
            self._row.append(self._cell)
            self._cell = None
        elif tag == "tr" and self._row:
            self.tables[-1]["rows"].append(self._row)
            self._row = None


_NUMBER = re.compile(r"^[+-]?\d+(\.\d+)?(e[+-]?\d+)?$")
_UNIT = re.compile(r"\([^()]+\)$")
# Numbers that name something rather than measure it.
_IDENTIFIERS = {"HTTP status", "key"}


@pytest.fixture(scope="module")
def ab_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """A run of every phase against a second server, and the legend texts of every plot it drew."""
    out = tmp_path_factory.mktemp("ab") / "run"
    legends: list[str] = []
    original = plots.png

    def keep_legends(plt, fig):
        legends.extend(t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts())
        return original(plt, fig)

    # Every fourth request of this run fails: its failure tables are drawn, its decode rounds (requests 10 and 11) work.
    with pytest.MonkeyPatch.context() as mp, FaultServer(schedule=("ok", "ok", "ok", "http_500")) as a, \
            FaultServer(schedule=("ok",)) as b:
        mp.setattr(plots, "png", keep_legends)
        done = bench(a.url, out, "--against", b.url)
    assert done.exit_code == 0, done.output
    return out, legends


def test_every_table_column_with_numbers_carries_a_unit_and_appears_once(ab_run):
    out, _ = ab_run
    parser = _Tables()
    parser.feed((out / "report.html").read_text())
    assert len(parser.tables) >= 10
    for table in parser.tables:
        head = table["head"]
        assert len(set(head)) == len(head), head
        for i, name in enumerate(head):
            if name not in _IDENTIFIERS and any(_NUMBER.match(row[i].strip()) for row in table["rows"]):
                assert _UNIT.search(name), f"{name!r} of {head} holds numbers and names no unit"


def test_latencies_are_milliseconds_in_every_table(ab_run):
    out, _ = ab_run
    parser = _Tables()
    parser.feed((out / "report.html").read_text())
    for table in parser.tables:
        for name in table["head"]:
            if re.search(r"TTFT|ITL|latency", name):
                assert name.endswith("(ms)"), name
    ab = report_of(out)["ab"]
    assert {d["unit"] for d in ab["deltas"] if "TTFT" in d["metric"] or "ITL" in d["metric"]} == {"ms"}


def test_the_sides_have_one_name_in_report_json_the_page_and_the_plots(ab_run):
    out, legends = ab_run
    report = report_of(out)
    assert [e["label"] for e in report["endpoints"]] == ["this run", "against"]
    ab = report["ab"]
    assert (ab["this_run"]["name"], ab["reference"]["name"]) == ("this run", "against")
    assert ab["this_run"]["url"] == report["endpoints"][0]["url"]
    assert ab["reference"]["url"] == report["endpoints"][1]["url"]
    page = (out / "report.html").read_text()
    for heading in ("this run: http://", "against: http://", "this run vs against"):
        assert heading in page
    assert "<th>this run (tok/s)</th><th>against (tok/s)</th>" in page
    assert "<th>this run (ms)</th><th>against (ms)</th>" in page
    assert legends and all(t.startswith(("this run", "against", "A/A noise band")) for t in legends), legends
    assert {t.split(":")[0] for t in legends if ":" in t} == {"this run", "against"}


def test_ab_deltas_carry_the_noise_band_and_a_single_sample_is_no_finding(ab_run):
    out, _ = ab_run
    deltas = report_of(out)["ab"]["deltas"]
    for d in deltas:
        if d["samples"] < 2:
            assert d["noise_pct"] is None and d["within_noise"] is None
        else:
            lo, hi = d["noise_pct"]
            assert lo <= 0 <= hi and d["within_noise"] == (lo <= d["change_pct"] <= hi)
    # The cold round at 1 concurrent is one request a side: the "+450%" that no band backs.
    assert any(d["samples"] == 1 for d in deltas) and any(d["noise_pct"] for d in deltas)
    assert "one sample, no noise band: not a finding" in (out / "report.html").read_text()


def test_a_few_samples_have_a_band_within_their_range():
    assert metrics.interval([5.0], "p50") is None
    assert metrics.interval([3.0, 1.0, 2.0], "p50") == (1.0, 3.0)
    lo, hi = metrics.interval([float(i) for i in range(1000)], "p50")
    assert 430 < lo < 500 < hi < 570


# --- item 4: a baseline measured with other settings ---------------------------------------------

@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("baseline") / "run"
    with FaultServer(schedule=("ok",)) as server:
        done = bench(server.url, out, "--phases", "decode")
    assert done.exit_code == 0, done.output
    return out / "report.json"


@dataclass(frozen=True)
class Setting:
    id: str
    args: tuple[str, ...]
    difference: str | None  # the refusal names it; None: not a workload setting, compared as it is


SETTINGS = [
    Setting("decode-tokens", ("--decode-tokens", "16"), "decode_tokens: baseline 8, this run 16"),
    Setting("seed", ("--seed", "7"), "seed: baseline 0, this run 7"),
    Setting("top-logprobs", ("--top-logprobs", "5"), "top_logprobs: baseline 2, this run 5"),
    Setting("extra-body", ("--extra-body", '{"chat_template_kwargs": {"enable_thinking": false}}'),
            'extra_body: baseline {}, this run {"chat_template_kwargs": {"enable_thinking": false}}'),
    Setting("decode-concurrency", ("--decode-concurrency", "1,2"), "decode_concurrency: baseline 1, this run 1,2"),
    Setting("repeats", ("--repeats", "3"), "repeats: baseline 2, this run 3"),
    Setting("stall-timeout", ("--stall-timeout", "5"), None),
    Setting("request-timeout", ("--request-timeout", "60"), None),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.id)
def test_a_baseline_with_other_workload_settings_is_refused_before_any_request(setting, baseline, tmp_path):
    out = tmp_path / "run"
    with FaultServer(schedule=("ok",)) as server:
        done = bench(server.url, out, "--phases", "decode", "--baseline", str(baseline), *setting.args)
    if setting.difference is None:
        assert done.exit_code == 0, done.output
        assert report_of(out)["ab"]["differences"] == [f"server: baseline {_url(baseline)}, this run {server.url}"]
        return
    line = one_error_line(done)
    assert setting.difference in line and "--allow-different-settings" in line
    assert server.requests == []
    assert not out.exists()


def _url(report: Path) -> str:
    return json.loads(report.read_text())["endpoints"][0]["url"]


def test_allowed_different_settings_are_listed_in_the_report(baseline, tmp_path):
    out = tmp_path / "run"
    with FaultServer(schedule=("ok",)) as server:
        done = bench(server.url, out, "--phases", "decode", "--baseline", str(baseline), "--decode-tokens", "16",
                     "--allow-different-settings")
    assert done.exit_code == 0, done.output
    differences = report_of(out)["ab"]["differences"]
    assert "setting decode_tokens: baseline 8, this run 16" in differences
    assert "note: the sides differ in setting decode_tokens: baseline 8, this run 16" in done.output
    assert "decode_tokens: baseline 8, this run 16" in (out / "report.html").read_text()


def test_a_baseline_of_another_model_is_compared_and_flagged(baseline, tmp_path):
    doc = json.loads(baseline.read_text())
    doc["endpoints"][0]["model"] = "other-model"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    out = tmp_path / "run"
    with FaultServer(schedule=("ok",)) as server:
        done = bench(server.url, out, "--phases", "decode", "--baseline", str(other))
    assert done.exit_code == 0, done.output
    ab = report_of(out)["ab"]
    assert ab["reference"]["name"] == "baseline" and ab["reference"]["model"] == "other-model"
    assert "model: baseline 'other-model', this run 'fault-model'" in ab["differences"]
    assert "model: baseline &#x27;other-model&#x27;" in (out / "report.html").read_text()


def test_a_baseline_of_the_old_schema_is_one_line(baseline, tmp_path):
    doc = json.loads(baseline.read_text())
    doc["schema_version"] = 1
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    with FaultServer(schedule=("ok",)) as server:
        done = bench(server.url, tmp_path / "run", "--baseline", str(old))
    assert "older flashnext bench (schema 1" in one_error_line(done)
    assert server.requests == []
