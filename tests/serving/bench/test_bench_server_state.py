"""The server's state during a run, read from vLLM's Prometheus ``/metrics``, and the two phases that
need it most: multiturn (sessions that grow, their running requests) and images.

The ``/metrics`` text is written by vLLM 0.34.0's own ``PrometheusStatLogger`` (its gauges and
counters, exposed by prometheus_client as vLLM's API server exposes them), fed with the number of
requests the stand-in server (tests/support/fault_server.py) has in flight: a vLLM server cannot
run on this machine, its metric classes can. The phases' requests go to that stand-in, which also
decodes every image it receives. The real servers (transformers serve, llama.cpp's) have no
``/metrics``; their tests check that this is noted, not an error.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest
from click.testing import CliRunner

from flashnext.serving.bench import server_state
from flashnext.tools.cli import main
from support import ROOT
from support.fault_server import FaultServer

SCHEMA = json.loads((ROOT / "manifests" / "bench-report.schema.json").read_text())
MULTITURN = ["--phases", "multiturn", "--sessions", "1,3", "--turns", "3", "--first-turn-tokens", "200",
             "--turn-tokens", "30", "--turn-output-tokens", "8", "--no-progress"]


class VllmMetrics:
    """vLLM's PrometheusStatLogger, recording what a scheduler with ``in_flight`` running requests
    reports: KV usage grows with them, and each step that runs requests preempts one and looks up
    100 prefix tokens, 25 of them hits."""

    def __init__(self):
        loggers = pytest.importorskip("vllm.v1.metrics.loggers")
        from vllm.config import ObservabilityConfig
        from vllm.v1.metrics.stats import IterationStats, SchedulerStats

        self.SchedulerStats, self.IterationStats = SchedulerStats, IterationStats
        # What PrometheusStatLogger reads of a VllmConfig (VllmConfig() itself needs a device).
        config = SimpleNamespace(
            observability_config=ObservabilityConfig(), speculative_config=None, kv_transfer_config=None,
            ec_transfer_config=None, lora_config=None, watermark_config=None,
            model_config=SimpleNamespace(served_model_name="m", max_model_len=4096, is_diffusion=False))
        self.logger = loggers.PrometheusStatLogger(config, [0])

    def __call__(self, in_flight: int) -> str:
        import prometheus_client

        stats = self.SchedulerStats(num_running_reqs=in_flight, num_waiting_reqs=0, kv_cache_usage=in_flight / 10)
        iteration = self.IterationStats()
        if in_flight:
            stats.prefix_cache_stats.queries, stats.prefix_cache_stats.hits = 100, 25
            iteration.num_preempted_reqs = 1
        self.logger.record(stats, iteration, None, 0)
        return prometheus_client.generate_latest().decode()


@pytest.fixture(scope="module")
def vllm_metrics():
    return VllmMetrics()


def test_vllm_metric_names_parse(vllm_metrics):
    vllm_metrics(0)
    text = vllm_metrics(3)
    # The names this module reads are the ones vLLM exposes (a counter gains _total).
    for name in server_state.GAUGES.values():
        assert f"\n{name}{{" in text
    for name in server_state.COUNTERS.values():
        assert f"\n{name}_total{{" in text
    got = server_state.parse(text)
    assert got["running"] == 3 and got["waiting"] == 0 and got["kv_cache_usage"] == pytest.approx(0.3)
    assert got["prefix_cache_hits"] / got["prefix_cache_queries"] == pytest.approx(0.25)
    assert got["preemptions"] >= 1


def test_two_engines_sum_and_kv_usage_is_the_fullest():
    text = "".join(f'vllm:num_requests_running{{engine="{i}",model_name="m"}} {r}\n'
                   f'vllm:kv_cache_usage_perc{{engine="{i}",model_name="m"}} {u}\n'
                   f'vllm:num_preemptions_total{{engine="{i}",model_name="m"}} {p}\n'
                   for i, (r, u, p) in enumerate(((2, 0.5, 1), (3, 0.9, 4))))
    assert server_state.parse(text) == {"running": 5, "kv_cache_usage": 0.9, "preemptions": 5}


def test_multiturn_sessions_grow_and_the_server_state_is_in_the_report(vllm_metrics, tmp_path):
    with FaultServer(schedule=("ok",), interval_s=0.02, metrics=vllm_metrics) as server:
        done = CliRunner().invoke(main, ["bench", server.url, "--out", str(tmp_path / "run"), *MULTITURN,
                                         "--metrics-interval", "0.05", "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    jsonschema.validate(report, SCHEMA)
    [e] = report["endpoints"]
    assert e["requests"] == (1 + 3) * 3 and e["errors"] == {}
    assert [p["sessions"] for p in e["multiturn"]] == [1, 3]
    for p in e["multiturn"]:
        assert p["sessions_completed"] == p["sessions"] and p["failed"] == 0
        assert [t["answered"] for t in p["turns"]] == [p["sessions"]] * 3
        # Each turn re-sends the conversation: the answer and the new message come on top.
        prompts = [t["measured_prompt_tokens"] for t in p["turns"]]
        assert prompts[0] >= 190 and prompts[1] > prompts[0] + 30 and prompts[2] > prompts[1] + 30, prompts
        assert p["generated_tokens"] == 8 * 3 * p["sessions"] and p["throughput_tok_s"] > 0
        assert p["per_user_tok_s"]["p50"] > 0 and p["turns"][0]["itl_s"]["count"] > 0
        # Running requests as the server counts them, next to the client's own count.
        assert 0 < p["server"]["running_mean"] <= p["server"]["running_max"] <= p["sessions"]
        assert p["client_in_flight_mean"] == pytest.approx(p["sessions"], rel=0.3)
    assert e["multiturn"][1]["server"]["running_max"] == 3
    [state] = e["server_state"]["phases"]
    assert e["server_state"]["available"] and state["phase"] == "multiturn"
    assert state["preemptions"] >= 2 and state["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert 0 < state["kv_cache_usage_max"] <= 0.3
    summary = json.loads(done.output[done.output.index("{"):])["summary"]["this run"]
    assert summary["server_state"]["multiturn"]["preemptions"] == state["preemptions"]
    assert [m["sessions"] for m in summary["multiturn"]] == [1, 3]
    for name in ("multiturn_pareto.png", "multiturn_ttft.png"):
        assert (tmp_path / "run" / name).read_bytes()[:4] == b"\x89PNG"
    html = (tmp_path / "run" / "report.html").read_text()
    assert "Server state, from" in html and "Multiturn agent sessions" in html


def test_against_alternates_the_sides_point_by_point(tmp_path):
    with FaultServer(schedule=("ok",)) as a, FaultServer(schedule=("ok",)) as b:
        done = CliRunner().invoke(main, ["bench", a.url, "--against", b.url, "--out", str(tmp_path / "ab"),
                                         *MULTITURN])
        # The first token of each answer, in order: the probe's six, then the phase's.
        firsts = sorted([(t[0], "a") for t in a.sent_at[6:]] + [(t[0], "b") for t in b.sent_at[6:]])
    assert done.exit_code == 0, done.output
    order = "".join(side for _, side in firsts)
    assert order == "a" * 3 + "b" * 3 + "a" * 9 + "b" * 9, order
    report = json.loads((tmp_path / "ab" / "report.json").read_text())
    assert [len(e["multiturn"]) for e in report["endpoints"]] == [2, 2]
    # No /metrics on the stand-in: noted, not an error.
    assert all(not e["server_state"]["available"] and "HTTP 404" in e["server_state"]["note"]
               for e in report["endpoints"])
    assert sum("no server state" in n for n in report["notes"]) == 2


def test_a_failed_turn_ends_its_session_and_the_rest_are_reported(tmp_path):
    with FaultServer(schedule=("ok", "ok", "http_500")) as server:
        done = CliRunner().invoke(main, ["bench", server.url, "--out", str(tmp_path / "run"), *MULTITURN,
                                         "--sessions", "1"])
    assert done.exit_code == 0, done.output
    [p] = json.loads((tmp_path / "run" / "report.json").read_text())["endpoints"][0]["multiturn"]
    assert p["sessions_completed"] == 0 and p["failed"] == 1
    assert [(t["answered"], t["failed"]) for t in p["turns"]] == [(1, 0), (1, 0), (0, 1)]


def test_images_are_generated_at_the_size_asked_and_sent_beside_a_long_prompt(tmp_path):
    # The stand-in, not a vision model: no image-capable model can be built here without a download.
    # It decodes each image it receives, so what is checked is that real JPEGs of the size went out.
    with FaultServer(schedule=("ok",), interval_s=0.01) as server:
        done = CliRunner().invoke(main, [
            "bench", server.url, "--out", str(tmp_path / "run"), "--phases", "images", "--images", "6",
            "--image-size", "96x40", "--image-concurrency", "3", "--image-prefill-tokens", "500", "--no-progress"])
    assert done.exit_code == 0, done.output
    assert server.images == [(96, 40)] * 6
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    jsonschema.validate(report, SCHEMA)
    im = report["endpoints"][0]["images"]
    assert (im["images"], im["answered"], im["failed"], im["width"], im["height"]) == (6, 6, 0, 96, 40)
    assert im["prefill_ttft_s"] > 0 and im["prefill_error"] is None and im["ttft_s"]["count"] == 6
    # The stand-in answers in 0.08 s a request: the first wave went out before the long prompt's first token.
    assert im["during_prefill"] >= 3
    assert "images 96x40: answered 6 of 6" in done.output
    assert (tmp_path / "run" / "images.png").is_file()


def test_failed_images_are_reported_not_fatal(tmp_path):
    with FaultServer(schedule=("ok", "http_500")) as server:
        done = CliRunner().invoke(main, ["bench", server.url, "--out", str(tmp_path / "run"), "--phases", "images",
                                         "--images", "3", "--image-size", "32x32", "--image-prefill-tokens", "100",
                                         "--no-progress"])
    assert done.exit_code == 0, done.output
    im = json.loads((tmp_path / "run" / "report.json").read_text())["endpoints"][0]["images"]
    # The schedule alternates: the long prompt ok, then 500, ok, 500 for the images (one at a time).
    assert im["prefill_error"] is None and (im["answered"], im["failed"]) == (1, 2)
    assert [r["error"] is None for r in im["requests"]].count(False) == 2
    assert all("HTTP 500" in r["error"] for r in im["requests"] if r["error"])


@pytest.mark.parametrize("size", ["2048", "2048x", "0x10", "10x99999", "axb"])
def test_a_bad_image_size_is_one_line(size, tmp_path):
    done = CliRunner().invoke(main, ["bench", "http://127.0.0.1:9", "--out", str(tmp_path / "x"), "--image-size", size])
    [line] = [x for x in done.output.splitlines() if x.startswith("Error:")]
    assert done.exit_code == 2 and "--image-size" in line, done.output
    assert "is not WIDTHxHEIGHT" in line or "must lie in [16, 16384]" in line, line


@pytest.mark.parametrize("page, said", [("<html>dashboard</html>", "is not Prometheus text"),
                                        ("process_cpu_seconds_total 1.5\n", "has none of vLLM's scheduler metrics")])
def test_a_metrics_page_without_vllms_metrics_is_noted(page, said, tmp_path):
    with FaultServer(schedule=("ok",), metrics=lambda n: page) as server:
        done = CliRunner().invoke(main, ["bench", server.url, "--out", str(tmp_path / "run"), "--phases", "decode",
                                         "--decode-concurrency", "1", "--repeats", "1", "--no-progress"])
    assert done.exit_code == 0, done.output
    e = json.loads((tmp_path / "run" / "report.json").read_text())["endpoints"][0]
    assert not e["server_state"]["available"] and e["server_state"]["phases"] == []
    assert said in e["server_state"]["note"], e["server_state"]


def test_a_report_from_before_these_fields_still_loads_as_a_baseline(tmp_path):
    from flashnext.serving.bench import load_report

    with FaultServer(schedule=("ok",)) as server:
        done = CliRunner().invoke(main, ["bench", server.url, "--out", str(tmp_path / "run"), "--phases", "decode",
                                         "--decode-concurrency", "1", "--repeats", "1", "--no-progress"])
    assert done.exit_code == 0, done.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    new = {"multiturn_sessions", "multiturn_turns", "multiturn_first_tokens", "multiturn_turn_tokens",
           "multiturn_output_tokens", "images", "image_size", "image_concurrency", "image_prefill_tokens",
           "image_max_tokens", "metrics_interval_s"}
    report["settings"] = {k: v for k, v in report["settings"].items() if k not in new}
    report["endpoints"] = [{k: v for k, v in e.items() if k not in ("multiturn", "images", "server_state")}
                           for e in report["endpoints"]]
    (tmp_path / "old.json").write_text(json.dumps(report))
    old = load_report(tmp_path / "old.json")
    assert old.endpoints[0].multiturn == [] and old.endpoints[0].server_state is None
