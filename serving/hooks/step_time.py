"""GPU time per decode step, for ``flashnext bench`` (patch step-time).

vLLM 0.34.0 replays a FULL cudagraph in one line, ``self.graphs[desc].replay()`` in
``CudaGraphManager.run_fullgraph`` (Model Runner V2: the qwen4_exp profiles' decode steps under
``FULL_DECODE_ONLY``, and the MTP draft's), with nothing around it to hook. The patch replays
through :func:`replay`, which times it with CUDA events when ``VLLM_GPU_STEP_TIME=1``
(:mod:`flashnext.serving.runtime.step_time`), and registers :func:`register_collector` in the
registry vLLM's API server serves ``/metrics`` from. Off (the default), :func:`replay` is the
stock replay after one global lookup.
"""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import Any

from flashnext import envs
from flashnext.serving.runtime.step_time import (
    SnapshotCollector, SnapshotWriter, StepTimeRecorder, cuda_event, snapshot_path,
)

# The model's own graphs; every other CudaGraphManager that replays a FULL graph in 0.34.0 is a
# speculator's (SpeculatorCudaGraphManager, which MTP and multi_module_mtp use, and
# DFlashCudaGraphManager); DeepSeek-V4.1's DecoderReplayCudaGraphManager captures PIECEWISE only.
_MODEL_MANAGERS = frozenset({"ModelCudaGraphManager"})

_UNSET = object()
_recorder: Any = _UNSET  # this process's StepTimeRecorder, None when off; made at the first replay
_writer: SnapshotWriter | None = None
_registered: set[int] = set()


def enabled() -> bool:
    return envs.VLLM_GPU_STEP_TIME.enabled()


def directory() -> Path:
    return Path(envs.VLLM_GPU_STEP_TIME_DIR.get())


def replay(manager: Any, desc: Any) -> None:
    """What the patched ``CudaGraphManager.run_fullgraph`` calls instead of
    ``self.graphs[desc].replay()``."""
    recorder = _recorder if _recorder is not _UNSET else _start()
    graph = manager.graphs[desc]
    if recorder is None:
        graph.replay()
        return
    kind = "model" if type(manager).__name__ in _MODEL_MANAGERS else "draft"
    recorder.replay(graph, (kind, int(desc.num_tokens)))


def ranks() -> dict[str, int]:
    """This worker's data-, pipeline- and tensor-parallel ranks, from vLLM's groups (0 where a
    group is not initialised: a single-GPU engine)."""
    from vllm.distributed import parallel_state as ps

    out = {}
    for label, group in (("dp_rank", "_DP"), ("pp_rank", "_PP"), ("tp_rank", "_TP")):
        g = getattr(ps, group, None)
        out[label] = g.rank_in_group if g is not None else 0
    return out


def _start() -> StepTimeRecorder | None:
    global _recorder, _writer
    if not enabled():
        _recorder = None
        return None
    recorder = StepTimeRecorder(cuda_event)
    rank = ranks()
    _writer = SnapshotWriter(recorder, snapshot_path(directory(), rank), rank)
    _writer.start()
    atexit.register(_writer.stop)  # the last steps of a clean shutdown are written too
    _recorder = recorder
    return recorder


def register_collector(registry: Any) -> bool:
    """Called by the patched ``attach_router`` with the registry ``/metrics`` serves: adds the
    workers' step times to it when the switch is on. Whether it did."""
    if not enabled() or id(registry) in _registered:
        return False
    registry.register(SnapshotCollector(directory()))
    _registered.add(id(registry))
    return True
