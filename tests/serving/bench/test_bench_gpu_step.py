"""GPU time per decode step in `flashnext bench`'s report, beside the client's ITL (patch step-time).

The stand-in server (tests/support/fault_server.py) serves a ``/metrics`` whose step-time histogram
is what the patched API server serves: flashnext's own ``SnapshotCollector`` over snapshot files that
a ``StepTimeRecorder`` wrote for two pipeline ranks, their steps timed by stand-in events (no CUDA
here; tests/serving/hooks/test_step_time.py). vLLM's scheduler gauges sit beside it, as on a vLLM
server. Each scrape of a busy server adds steps: 4 ms on rank 0, 6 ms on rank 1.
"""

from __future__ import annotations

import json
import re
import statistics

import jsonschema
import pytest
from click.testing import CliRunner

from flashnext.serving.bench import load_report
from flashnext.serving.bench.summary import summary_lines
from flashnext.serving.runtime.step_time import SnapshotCollector, StepTimeRecorder, snapshot_path, write_snapshot
from flashnext.tools.cli import main
from support import ROOT
from support.fault_server import FaultServer

SCHEMA = json.loads((ROOT / "manifests" / "bench-report.schema.json").read_text())
DECODE = ["--phases", "decode", "--decode-concurrency", "1", "--repeats", "2", "--no-progress",
          "--metrics-interval", "0.05", "--json"]


class DoneEvent:
    """A stand-in timing event the device has already passed: the recorder reads it at once."""

    def __init__(self, clock):
        self.clock = clock

    def record(self):
        self.at = self.clock[0]

    def query(self):
        return True

    def elapsed_time(self, end):
        return end.at - self.at


class BusyRanks:
    """Two pipeline ranks' recorders and files, and the /metrics text a patched vLLM would serve."""

    def __init__(self, directory):
        prometheus_client = pytest.importorskip("prometheus_client")
        self.directory = directory
        directory.mkdir()
        self.clock = [0.0]
        self.ranks = {pp: StepTimeRecorder(lambda: DoneEvent(self.clock)) for pp in (0, 1)}
        self.registry = prometheus_client.CollectorRegistry()
        self.registry.register(SnapshotCollector(directory))
        self.generate = prometheus_client.generate_latest
        self.write()

    def write(self):
        for pp, rec in self.ranks.items():
            ranks = {"dp_rank": 0, "pp_rank": pp, "tp_rank": 0}
            write_snapshot(snapshot_path(self.directory, ranks), rec.snapshot(ranks))

    def step(self, pp: int, ms: float):
        clock = self.clock

        class Graph:
            def replay(self):
                clock[0] += ms

        self.ranks[pp].replay(Graph(), ("model", 1))

    def __call__(self, in_flight: int) -> str:
        if in_flight:
            for _ in range(5):
                self.step(0, 4.0)
                self.step(1, 6.0)
            self.write()
        return (f'vllm:num_requests_running{{engine="0",model_name="m"}} {in_flight}\n'
                + self.generate(self.registry).decode())


def test_gpu_time_per_step_is_reported_beside_the_itl(tmp_path):
    ranks = BusyRanks(tmp_path / "steps")
    with FaultServer(schedule=("ok",), tokens=30, interval_s=0.01, metrics=ranks) as server:
        done = CliRunner().invoke(main, ["bench", server.url, "--out", str(tmp_path / "run"), *DECODE])
    assert done.exit_code == 0, done.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    jsonschema.validate(report, SCHEMA)
    state = report["endpoints"][0]["server_state"]
    assert state["available"] and state["gpu_step_note"] is None
    [phase] = state["phases"]
    assert [(g["pp_rank"], g["graph"]) for g in phase["gpu_steps"]] == [(0, "model"), (1, "model")]
    for g, ms in zip(phase["gpu_steps"], (4.0, 6.0)):
        assert g["steps"] > 0 and g["steps"] % 5 == 0
        assert g["mean_s"] == pytest.approx(ms / 1000)
        assert g["p50_s"] == pytest.approx(ms / 1000, rel=0.05) and g["p90_s"] == pytest.approx(ms / 1000, rel=0.05)
    # Beside them, the client's ITL over the same phase: its own samples. Their values are wall time
    # (the stand-in paces 10 ms, but its tokens arrive together while another test has the CPU), so
    # they are checked against the samples the report keeps, not against the pacing.
    samples = report["endpoints"][0]["itl_samples_s"]
    itl = phase["client_itl_s"]
    assert itl["count"] == len(samples) > 0 and itl["p50"] == statistics.median(samples)
    assert (itl["min"], itl["max"]) == (min(samples), max(samples))
    # The lines the command prints without --json
    lines = summary_lines(load_report(tmp_path / "run" / "report.json"))
    [line] = [x for x in lines if "GPU per step (CUDA events)" in x]
    said = {rank: float(ms) for rank, ms in re.findall(r"(pp\d model) p50 ([\d.]+) / p90", line)}
    assert said == {"pp0 model": pytest.approx(4.0, rel=0.05), "pp1 model": pytest.approx(6.0, rel=0.05)}
    assert "client ITL p50" in line
    summary = json.loads(done.output[done.output.index("{"):])["summary"]["this run"]
    assert summary["server_state"]["decode"]["gpu_step_p50_ms"]["pp1 model"] == pytest.approx(6.0, rel=0.05)
    html = (tmp_path / "run" / "report.html").read_text()
    assert "GPU time per step (CUDA events around the graph replay)" in html


def test_a_server_without_step_time_is_noted_not_an_error(tmp_path):
    with FaultServer(schedule=("ok",), metrics=lambda n: f'vllm:num_requests_running{{engine="0"}} {n}\n') as server:
        done = CliRunner().invoke(main, ["bench", server.url, "--out", str(tmp_path / "run"), *DECODE])
    assert done.exit_code == 0, done.output
    state = json.loads((tmp_path / "run" / "report.json").read_text())["endpoints"][0]["server_state"]
    assert state["available"] and all(p["gpu_steps"] == [] for p in state["phases"])
    assert "VLLM_GPU_STEP_TIME=1" in state["gpu_step_note"]
    assert any("note: no flashnext:gpu_step_seconds" in x
               for x in summary_lines(load_report(tmp_path / "run" / "report.json")))
    assert "GPU time per step: none" in (tmp_path / "run" / "report.html").read_text()
