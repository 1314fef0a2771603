"""Hooks of patches mtp-01 and mtp-02: the MTP draft head under pipeline parallelism.

Under PP the draft head is not pipelined: it runs whole on the last rank, fed the target's hidden
states there (seed 000 §7).

- mtp-01: vLLM 0.33.0's ``Qwen4ExpMultiTokenPredictor.forward`` takes its embedding branch only on
  the *global* first pipeline rank, so at PP > 1 the draft, on the last rank, goes down the
  intermediate-tensor branch and stops on an assert. The draft owns every stage of itself.
- mtp-02: the draft's ``lm_head`` is replaced by the target's (on the same rank) right after
  loading, so none is built (vLLM 0.33.0 allocates and loads a full copy for that moment); and its
  ``embed_tokens``, which reads a few rows per step, lives in pinned host memory behind a UVA view
  instead of on the GPU.
"""

from __future__ import annotations

import torch

from flashnext import envs


def _pipelined() -> bool:
    from vllm.distributed import get_pp_group

    return get_pp_group().world_size > 1


def draft_takes_embedding_branch() -> bool:
    """mtp-01: whether the draft's forward embeds its input (rather than wait for intermediates)."""
    from vllm.distributed import get_pp_group

    return envs.VLLM_MTP_PP.enabled() or get_pp_group().is_first_rank


def _slim() -> bool:
    return envs.VLLM_MTP_SLIM_DRAFT.enabled() and _pipelined()


def draft_lm_head(make):
    """mtp-02: no lm_head of the draft's own under PP; the loader puts the target's in its place."""
    from vllm.model_executor.models.utils import PPMissingLayer

    return PPMissingLayer() if _slim() else make()


def draft_embedding(make):
    """mtp-02: build the draft's embedding in host memory (pinned and viewed after loading)."""
    if not (_slim() and torch.cuda.is_available()):
        return make()
    with torch.device("cpu"):
        return make()


def finish_draft_embedding(module) -> None:
    """mtp-02, after loading: move the embedding's rows to exact-size pinned memory and give the
    module a UVA view of them, so the GPU gathers its few rows per step over PCIe."""
    from flashnext.serving.hooks.host_pool import pinned_empty, uva_view

    weight = getattr(module, "weight", None)
    if weight is None or weight.device.type != "cpu" or not torch.cuda.is_available():
        return
    host = pinned_empty(tuple(weight.shape), weight.dtype)
    host.copy_(weight.data)
    module.host_weight = host  # the view does not keep its pages alive by itself
    weight.data = uva_view(host)
