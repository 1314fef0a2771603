"""Patch step-time: GPU time per decode step, timed around vLLM's own graph replay and served on
vLLM's own ``/metrics``, where ``flashnext bench`` reads it (tests/support/step_time_scenario.py
says what stands in for CUDA)."""

import os

import pytest

from support import SUPPORT_DIR, two_ranks

from flashnext.serving.bench import server_state
from flashnext.serving.runtime.step_time import METRIC

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")


def run(patched_tree, tmp_path, **env) -> list[dict]:
    return two_ranks({"PYTHONPATH": os.pathsep.join([str(patched_tree), str(SUPPORT_DIR.parent)]),
                      "VLLM_GPU_STEP_TIME_DIR": str(tmp_path / "step-time"), **env}, "step_time_scenario.py")


def test_vllms_replay_is_timed_per_pipeline_rank_and_served_on_metrics(patched_tree, tmp_path):
    first, last = run(patched_tree, tmp_path, VLLM_GPU_STEP_TIME="1")
    # vLLM's run_fullgraph still replays each graph once a step and returns its outputs.
    assert (first["replays"], last["replays"], last["draft_replays"]) == (10, 10, 10)
    assert first["shape"] == last["shape"] == [1, 8]
    assert first["files"] == ["gpu-step-time-dp_rank0-pp_rank0-tp_rank0.json",
                              "gpu-step-time-dp_rank0-pp_rank1-tp_rank0.json"]
    assert first["status"] == 200
    text = first["metrics"]
    # What flashnext bench reads of it: per rank and graph, every step of the stand-in's set time.
    steps = server_state.parse_gpu_steps(text)
    by = {(k.pp_rank, k.graph): h for k, h in steps.items()}
    assert set(by) == {(0, "model"), (1, "model"), (1, "draft")}
    for (pp, graph), ms in (((0, "model"), 4.0), ((1, "model"), 6.0), ((1, "draft"), 1.5)):
        h = by[pp, graph]
        assert h.count == 10 and h.sum_s == pytest.approx(10 * ms / 1000)
        assert server_state.histogram_quantile(h, 0.5) == pytest.approx(ms / 1000, rel=0.05)
    assert f'{METRIC}_count{{dp_rank="0",graph="model",pp_rank="1",tokens="1",tp_rank="0"}} 10.0' in text
    assert 'flashnext:gpu_steps_untimed_total{dp_rank="0",pp_rank="0",tp_rank="0"} 0.0' in text


def test_the_switch_off_replays_as_stock_and_serves_nothing(patched_tree, tmp_path):
    first, last = run(patched_tree, tmp_path, VLLM_GPU_STEP_TIME="0")
    assert (first["replays"], last["replays"], last["draft_replays"]) == (10, 10, 10)
    assert first["shape"] == last["shape"] == [1, 8]
    assert first["files"] == [] and first["status"] == 200
    assert METRIC not in first["metrics"] and server_state.parse_gpu_steps(first["metrics"]) == {}
