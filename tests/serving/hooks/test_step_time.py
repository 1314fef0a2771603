"""The step-time recorder (patch step-time): CUDA events around a graph replay, read only once the
device has passed them, written per rank and served as a Prometheus histogram.

On the CPU the device is ``StandInDevice``: one stream whose work completes only when the test says
so, and ``StandInEvent`` / ``StandInGraph`` on it (``synchronize()`` raises: the recorder must never
wait). The ``gpu`` test times a real CUDA graph with real events on the H200 (no vLLM needed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flashnext.serving.bench import server_state
from flashnext.serving.runtime import step_time
from flashnext.serving.runtime.step_time import (
    BUCKETS_S, SnapshotCollector, SnapshotWriter, StepTimeRecorder, read_snapshots, snapshot_path,
)

RANKS = {"dp_rank": 0, "pp_rank": 1, "tp_rank": 0}


class StandInDevice:
    """One stream: launched work has a clock; ``done`` is how many launches the device has finished."""

    def __init__(self):
        self.clock_ms, self.launched, self.done = 0.0, 0, 0
        self.events: list[StandInEvent] = []

    def event(self) -> StandInEvent:
        e = StandInEvent(self)
        self.events.append(e)
        return e


class StandInEvent:
    def __init__(self, device: StandInDevice):
        self.device, self.position, self.queries = device, None, 0

    def record(self):
        self.at, self.position = self.device.clock_ms, self.device.launched

    def query(self):
        self.queries += 1
        return self.position is not None and self.device.done >= self.position

    def elapsed_time(self, end):
        assert self.query() and end.query(), "elapsed_time before the device passed the events would block"
        return end.at - self.at

    def synchronize(self):
        raise AssertionError("the recorder synchronized")


class StandInGraph:
    def __init__(self, device: StandInDevice, ms: float):
        self.device, self.ms = device, ms

    def replay(self):
        self.device.launched += 1
        self.device.clock_ms += self.ms


def test_a_pair_is_read_only_after_the_device_passed_it():
    device = StandInDevice()
    rec = StepTimeRecorder(device.event)
    graph = StandInGraph(device, 10.66)
    rec.replay(graph, ("model", 1))
    # The device has not finished the step: nothing read, nothing waited for.
    assert rec.pending == 1 and rec.histograms == {}
    device.done = 1
    rec.replay(graph, ("model", 1))   # the next step reads the previous one
    assert rec.pending == 1 and rec.histograms[("model", 1)].count == 1
    assert rec.histograms[("model", 1)].sum_s == pytest.approx(0.01066)
    device.done = 2
    assert rec.collect() == 1 and rec.histograms[("model", 1)].count == 2


def test_pairs_are_reused_and_a_full_pool_replays_untimed_without_waiting():
    device = StandInDevice()
    rec = StepTimeRecorder(device.event, pairs=3)
    graph = StandInGraph(device, 5.0)
    for _ in range(5):   # the device finishes nothing: 3 pairs in flight, then 2 steps untimed
        rec.replay(graph, ("model", 1))
    assert device.launched == 5 and rec.pending == 3 and rec.untimed == 2 and len(device.events) == 6
    device.done = device.launched
    for _ in range(10):
        rec.replay(graph, ("model", 2))
        device.done = device.launched
    rec.collect()
    assert len(device.events) == 6 and rec.untimed == 2   # no event made past the pool
    assert rec.histograms[("model", 1)].count == 3 and rec.histograms[("model", 2)].count == 10


def test_a_step_lands_in_the_bucket_of_its_time():
    h = step_time.Histogram()
    for seconds in (0.01066, 0.01066, 0.02, 10.0):
        h.observe(seconds)
    cum = h.cumulative()
    i = next(i for i, b in enumerate(BUCKETS_S) if b >= 0.01066)
    assert cum[i - 1] == 0 and cum[i] == 2 and cum[-1] == 4 and cum[-2] == 3   # 10 s: the +inf slot
    # 5% apart: a quantile read by interpolation is within 2.5% of the step's time
    assert all(b / a == pytest.approx(1.05, rel=1e-4) for a, b in zip(BUCKETS_S[1:-1], BUCKETS_S[2:]))


def test_the_writer_writes_the_last_steps_and_the_collector_serves_them(tmp_path):
    prometheus_client = pytest.importorskip("prometheus_client")
    device = StandInDevice()
    rec = StepTimeRecorder(device.event)
    path = snapshot_path(tmp_path, RANKS)
    writer = SnapshotWriter(rec, path, RANKS, interval_s=0.02)
    writer.start()
    assert json.loads(path.read_text())["series"] == []   # a previous run's file of this rank is replaced at once
    for ms in (4.0, 4.0, 6.0):
        rec.replay(StandInGraph(device, ms), ("model", 1))
    rec.replay(StandInGraph(device, 1.5), ("draft", 1))
    device.done = device.launched   # the burst ends; no step comes to read the last pair
    writer.stop()
    registry = prometheus_client.CollectorRegistry()
    registry.register(SnapshotCollector(tmp_path))
    text = prometheus_client.generate_latest(registry).decode()
    steps = server_state.parse_gpu_steps(text)
    model = steps[server_state.StepKey(0, 1, 0, "model")]
    assert model.count == 3 and model.sum_s == pytest.approx(0.014)
    assert server_state.histogram_quantile(model, 0.5) == pytest.approx(0.004, rel=0.05)
    assert steps[server_state.StepKey(0, 1, 0, "draft")].count == 1
    assert server_state.GPU_STEP == step_time.METRIC


def test_files_of_dead_processes_and_broken_files_are_skipped(tmp_path):
    rec = StepTimeRecorder(StandInDevice().event)
    snap = rec.snapshot(RANKS)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "gpu-step-time-dp_rank0-pp_rank0-tp_rank0.json").write_text(
        json.dumps({**snap, "pid": int(dead.stdout)}))
    (tmp_path / "gpu-step-time-dp_rank0-pp_rank2-tp_rank0.json").write_text('{"format": 1, "pid"')
    (tmp_path / "gpu-step-time-dp_rank0-pp_rank3-tp_rank0.json").write_text(json.dumps({**snap, "format": 99}))
    step_time.write_snapshot(snapshot_path(tmp_path, RANKS), snap)
    assert [s["ranks"] for s in read_snapshots(tmp_path)] == [RANKS]
    assert read_snapshots(tmp_path / "missing") == []


def test_the_hook_is_the_stock_replay_when_off(monkeypatch):
    from flashnext.serving.hooks import step_time as hook

    monkeypatch.setattr(hook, "_recorder", hook._UNSET)
    monkeypatch.setenv("VLLM_GPU_STEP_TIME", "0")
    device = StandInDevice()

    class Manager:
        graphs = {"desc": StandInGraph(device, 1.0)}

    hook.replay(Manager(), "desc")
    assert device.launched == 1 and hook._recorder is None and device.events == []
    assert hook.register_collector(object()) is False


# --- the H200: a real CUDA graph and real events --------------------------------------------------

GPU_SCRIPT = r'''
import json, time, torch
from flashnext.serving.runtime.step_time import StepTimeRecorder, cuda_event

x = torch.randn(4096, 4096, device="cuda")
stream = torch.cuda.Stream()
with torch.cuda.stream(stream):
    for _ in range(3):
        y = x @ x
torch.cuda.current_stream().wait_stream(stream)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    for _ in range(20):
        y = x @ x
# Reference: the graph alone, timed by the same events around a synchronized replay.
ref = []
for _ in range(10):
    s, e = cuda_event(), cuda_event()
    s.record(); graph.replay(); e.record(); e.synchronize()
    ref.append(s.elapsed_time(e))
calls = {"synchronize": 0}
real_sync = torch.cuda.Event.synchronize
def counting(self, *a, **k):
    calls["synchronize"] += 1
    return real_sync(self, *a, **k)
torch.cuda.Event.synchronize = counting
rec = StepTimeRecorder()
launch = []
for _ in range(50):
    t = time.perf_counter()
    rec.replay(graph, ("model", 1))
    launch.append(time.perf_counter() - t)
read_during = rec.histograms[("model", 1)].count if ("model", 1) in rec.histograms else 0
torch.cuda.synchronize()   # the test's own wait, after the steps
rec.collect()
h = rec.histograms[("model", 1)]
ref.sort()
print(json.dumps({"count": h.count, "mean_ms": h.sum_s / h.count * 1e3, "ref_ms": ref[len(ref) // 2],
                  "read_during": read_during, "synchronize": calls["synchronize"],
                  "launch_max_ms": max(launch[1:]) * 1e3}))
'''


@pytest.mark.gpu
def test_a_real_cuda_graph_is_timed_without_a_sync():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    out = subprocess.run([sys.executable, "-c", GPU_SCRIPT], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["count"] == 50 and got["synchronize"] == 0
    assert got["read_during"] < 50   # pairs were read while the device was still behind the host
    assert got["mean_ms"] == pytest.approx(got["ref_ms"], rel=0.1)
    # The host returns from a step long before the device finishes it: nothing waited.
    assert got["launch_max_ms"] < got["ref_ms"]
