"""Hook of patch decode-03: the previous pipeline rank's hidden states, received when first read.

Patches pp-ple and mem-01 had their hooks here too; vLLM 0.34.0 does what they did (``ABSORBED``
in ``serving/patches/series.py``).
"""

from __future__ import annotations

from flashnext import envs


def deferred_intermediate_tensors(pp_group, tp_group):
    """Patch decode-03: the previous rank's hidden states, received when first read.

    vLLM 0.34.0's worker calls ``irecv_tensor_dict`` first thing in ``execute_model`` and wraps
    what it returns in its ``AsyncIntermediateTensors``, which defers only the wait for the tensor
    transfers to the first read of ``.tensors``; the metadata ``recv_object`` inside
    ``irecv_tensor_dict`` still blocks until the previous rank has launched its forward and sent,
    and only then does this rank prepare inputs and attention metadata (3.2-3.5 ms of Python for
    this model). Deferred, the whole receive waits for that first read, which the model runner makes
    right before the forward, so the preparation overlaps the previous rank's GPU work and the
    device order stays receive, forward, send. Returns None with ``VLLM_PP_DEFER_RECV=0`` (the
    stock path).
    """
    if not envs.VLLM_PP_DEFER_RECV.enabled():
        return None
    return _deferred_class()(lambda: pp_group.irecv_tensor_dict(all_gather_group=tp_group))


_DEFERRED = None


def _deferred_class():
    global _DEFERRED
    if _DEFERRED is not None:
        return _DEFERRED
    from vllm.v1.worker.gpu_worker import AsyncIntermediateTensors

    class DeferredRecvIntermediateTensors(AsyncIntermediateTensors):
        """vLLM's ``AsyncIntermediateTensors`` whose ``irecv_tensor_dict`` itself waits for the
        first read of ``.tensors`` (or ``wait_for_comm()``); vLLM's class then waits for the
        transfers and runs their post-processing, as for the worker's own receive."""

        def __init__(self, receive) -> None:
            super().__init__({})
            self._receive = receive

        def wait_for_comm(self) -> None:
            """Receive now if not yet, then vLLM's wait (both idempotent); the worker calls it after
            every step, so a step whose runner never read ``.tensors`` still matches the send."""
            receive = self._receive
            if receive is not None:
                tensors, self._comm_handles, self._comm_postprocess = receive()
                assert tensors is not None
                self._receive = None
                self.tensors = tensors
            super().wait_for_comm()

    _DEFERRED = DeferredRecvIntermediateTensors
    return _DEFERRED
