"""Patch decode-03 on two gloo ranks with vLLM's own pipeline send and receive, on the CPU.

Rank 0 "computes" for SEND_AFTER seconds, then sends its hidden states as the worker does
(``isend_tensor_dict``). Rank 1 takes its intermediate tensors as the worker does, either vLLM
0.34.0's way (``irecv_tensor_dict`` first thing, its result in vLLM's ``AsyncIntermediateTensors``)
or through the decode-03 hook, then "prepares inputs" for PREP seconds and reads ``.tensors`` as the
model runner does right before the forward.
``python pp_recv_scenario.py RANK PORT`` prints rank 1's timings as JSON.
"""

import json
import sys
import time

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import get_pp_group, get_tp_group, init_distributed_environment, initialize_model_parallel
from vllm.v1.worker.gpu_worker import AsyncIntermediateTensors

from flashnext.serving.hooks.pipeline import deferred_intermediate_tensors

SEND_AFTER, PREP = 1.0, 0.6
rank, port = int(sys.argv[1]), sys.argv[2]
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(world_size=2, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=rank, backend="gloo")
    initialize_model_parallel(1, 2)
    hidden = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    torch.distributed.barrier(group=get_pp_group().cpu_group)
    start = time.monotonic()
    if rank == 0:
        time.sleep(SEND_AFTER)
        for handle in get_pp_group().isend_tensor_dict({"hidden_states": hidden}):
            handle.wait()
        print(json.dumps({"rank": 0}))
    else:
        intermediate = deferred_intermediate_tensors(get_pp_group(), get_tp_group())
        deferred = intermediate is not None
        if not deferred:  # vLLM 0.34.0's worker
            tensors, handles, postprocess = get_pp_group().irecv_tensor_dict(all_gather_group=get_tp_group())
            intermediate = AsyncIntermediateTensors(tensors, comm_handles=handles, comm_postprocess=postprocess)
        taken = time.monotonic() - start
        time.sleep(PREP)  # prepare inputs and attention metadata
        received = intermediate.tensors
        ready = time.monotonic() - start
        if deferred:
            intermediate.wait_for_comm()  # idempotent, as the patched worker calls it after every step
        print(json.dumps({"rank": 1, "deferred": deferred, "returned_after_s": round(taken, 2),
                          "forward_ready_after_s": round(ready, 2),
                          "vllms_async_tensors": isinstance(intermediate, AsyncIntermediateTensors),
                          "equal": torch.equal(received["hidden_states"], hidden)}))
