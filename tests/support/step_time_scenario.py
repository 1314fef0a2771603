"""Patch step-time on two gloo pipeline ranks, on the CPU, through vLLM's own replay and /metrics.

Each rank replays "decode steps" through vLLM 0.34.0's own ``ModelCudaGraphManager.run_fullgraph``
(whose base, ``CudaGraphManager.run_fullgraph``, the patch changes), rank 1 also its MTP draft's
through a ``SpeculatorCudaGraphManager`` (the MTP speculator's, which 0.34.0 moved from
``spec_decode/target_dependent_ar`` to ``spec_decode/autoregressive``). No CUDA exists here, so two stand-ins, named so:

- ``StandInGraph``: a captured graph whose ``replay()`` runs for a set time on ``GPU``, a stand-in
  device with one stream and a clock;
- ``StandInEvent`` (in place of ``torch.cuda.Event``): stamped with that clock when recorded,
  completed (``query()``) only once a later replay has been launched, so the device runs a step
  behind the host, as it does; ``synchronize()`` raises, so a sync on the step path fails the run.

Then rank 0 mounts vLLM's own ``attach_router`` on a FastAPI app (the API server's /metrics) and
fetches ``/metrics``, which holds both ranks' histograms (rank 1's from its own process, through
its file). ``python step_time_scenario.py RANK PORT`` prints the rank's result as JSON.
"""

import json
import sys
import time
from pathlib import Path

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.distributed import get_pp_group, init_distributed_environment, initialize_model_parallel
from vllm.sequence import IntermediateTensors
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor, ModelCudaGraphManager
from vllm.v1.worker.gpu.spec_decode.autoregressive.cudagraph_utils import SpeculatorCudaGraphManager

from flashnext import envs


class GPU:
    clock_ms = 0.0
    launches = 0


class StandInEvent:
    def __init__(self, enable_timing=False, **kwargs):
        assert enable_timing, "an event without timing cannot give elapsed_time"
        self.launch = None

    def record(self, stream=None):
        self.at, self.launch = GPU.clock_ms, GPU.launches

    def query(self):
        return self.launch is not None and GPU.launches > self.launch

    def elapsed_time(self, end):
        assert self.query() and end.query(), "elapsed_time on an event the device has not passed"
        return end.at - self.at

    def synchronize(self):
        raise AssertionError("synchronize() on the step path")


class StandInGraph:
    def __init__(self, ms):
        self.ms, self.replays = ms, 0

    def replay(self):
        self.replays += 1
        GPU.launches += 1
        GPU.clock_ms += self.ms


torch.cuda.Event = StandInEvent
# Rank 0's decode step takes 4 ms on the GPU, rank 1's 6 ms; rank 1's draft 1.5 ms. 10 steps each.
STEP_MS = {0: 4.0, 1: 6.0}
DRAFT_MS, STEPS = 1.5, 10

rank, port = int(sys.argv[1]), sys.argv[2]
directory = Path(envs.VLLM_GPU_STEP_TIME_DIR.get())
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(world_size=2, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=rank, backend="gloo")
    initialize_model_parallel(1, 2)
    pp = get_pp_group()
    desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=1, num_reqs=1, uniform_token_count=1)
    model = ModelCudaGraphManager.__new__(ModelCudaGraphManager)  # its __init__ needs a CUDA VllmConfig
    graph = StandInGraph(STEP_MS[rank])
    model.graphs = {desc: graph}
    model.is_last_pp_rank = pp.is_last_rank
    model.hidden_states = torch.zeros(4, 8)
    model.intermediate_tensors = IntermediateTensors({"hidden_states": torch.zeros(4, 8)})
    model.use_aux_hidden_state_outputs = False
    draft = SpeculatorCudaGraphManager.__new__(SpeculatorCudaGraphManager)
    draft_graph = StandInGraph(DRAFT_MS)
    draft.graphs = {desc: draft_graph}
    shapes = []
    for _ in range(STEPS):
        out = model.run_fullgraph(desc)
        shapes.append(list((out if isinstance(out, torch.Tensor) else out["hidden_states"]).shape))
        if pp.is_last_rank:
            draft.run_fullgraph(desc)
    GPU.launches += 1  # the device finishes the last step; no later step comes to read it
    from flashnext.serving.hooks import step_time

    if step_time.enabled():  # the writer thread, not a step, writes the last ones
        deadline = time.monotonic() + 30
        while step_time._recorder.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        step_time._writer.stop()
    torch.distributed.barrier(group=pp.cpu_group)  # both ranks' files are written
    result = {"rank": rank, "replays": graph.replays, "draft_replays": draft_graph.replays, "shape": shapes[-1],
              "files": sorted(p.name for p in directory.glob("gpu-step-time-*.json")) if directory.is_dir() else []}
    if rank == 0:
        from fastapi import FastAPI
        from starlette.testclient import TestClient
        from vllm.entrypoints.serve.instrumentator.metrics import attach_router

        app = FastAPI()
        attach_router(app)
        with TestClient(app) as client:
            response = client.get("/metrics")
        result |= {"status": response.status_code, "metrics": response.text}
    torch.distributed.barrier(group=pp.cpu_group)  # rank 1 lives (its file counts) until rank 0 scraped
    print(json.dumps(result))
