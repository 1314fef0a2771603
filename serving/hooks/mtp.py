"""Hooks of patches mtp-01 and mtp-02: the MTP draft head's embedding and LM head.

vLLM 0.34.0 builds the draft (``Qwen4ExpMTP``) on the last pipeline rank only and, right after
loading it, its drafter (``load_eagle_model``: ``maybe_share_target_embed`` and
``share_target_lm_head``) replaces the draft's ``lm_head`` by the target's always (the class
declares no ``has_own_lm_head``) and its ``embed_tokens`` by the target's at PP=1 only. At PP > 1
the target's embedding is on the first rank (a ``PPMissingLayer`` elsewhere), so the draft keeps
and uses its own (seed 000 §7).

- mtp-01: the draft's ``embed_tokens`` and ``lm_head`` are built with the checkpoint's INT8 method
  where the release stores them as INT8 (patch int8-modules' :class:`Int8EmbeddingMethod`, the same
  one the target's are built with, under int8-modules' switch); vLLM 0.34.0 builds them without
  one, and its loader stops at ``embed_tokens.weight_packed`` (at PP=1 at ``lm_head.weight_packed``
  too). (The seed's other mtp-01 item, the draft's forward branching on the global first rank, is
  fixed in 0.34.0: it branches on whether it was handed intermediate tensors.)
- mtp-02: what the drafter replaces right after loading is never built (a ``PPMissingLayer``, which
  vLLM's loader skips, holds the place): the ``lm_head`` always, the ``embed_tokens`` at PP=1. At
  PP > 1 the draft's embedding, which reads a few rows per step, is built and loaded in host memory
  and then moved to exact-size pinned memory behind UVA views (the INT8 words and their scales), so
  the GPU gathers its rows over PCIe and holds none of it.
"""

from __future__ import annotations

from flashnext import envs

# The checkpoint's names of the tensors the draft loads as its embed_tokens and lm_head
# (``_remap_mtp_weight_name`` maps them to ``model.embed_tokens.*`` and ``lm_head.*``). The quant
# config is asked about these names, not the draft module's ``mtp.*`` prefix, which the release's
# ``ignore`` keeps in BF16.
CHECKPOINT_EMBED = "model.language_model.embed_tokens"
CHECKPOINT_LM_HEAD = "lm_head"

# vLLM's VocabParallelEmbedding pads the vocabulary to a multiple of this (DEFAULT_VOCAB_PADDING_SIZE).
VOCAB_PADDING = 64


def _pp_group():
    from vllm.distributed import get_pp_group

    return get_pp_group()


def _pipelined() -> bool:
    return _pp_group().world_size > 1


def draft_quant_config(vllm_config):
    """The draft's quantization config as vLLM resolves it (``get_draft_quant_config``: the draft
    model config's own, the same checkpoint's for MTP)."""
    if vllm_config.speculative_config is None or vllm_config.speculative_config.draft_model_config is None:
        return vllm_config.quant_config
    from vllm.model_executor.models.utils import get_draft_quant_config

    return get_draft_quant_config(vllm_config)


def draft_embedding_method(vllm_config, checkpoint_name: str):
    """mtp-01: the quantization method of the draft's ``embed_tokens`` (``CHECKPOINT_EMBED``) or
    ``lm_head`` (``CHECKPOINT_LM_HEAD``): int8-modules' INT8 method where the checkpoint stores that
    tensor as INT8 by groups, else None (vLLM's unquantized layer). Both int8-modules' switch
    (``VLLM_INT8_MODULES``), as for the target's, and mtp-01's own (``VLLM_MTP_PP``, which governed
    the draft's branch until vLLM 0.34.0 fixed that) turn it off.

    The names are resolved as vLLM maps the draft's config: by the draft model class's mapper
    (Qwen4ExpMTP has none), not the target's, which would move ``lm_head`` to
    ``language_model.lm_head`` and leave the draft's copy unquantized."""
    from flashnext.serving.hooks import int8_modules

    if not envs.VLLM_MTP_PP.enabled():
        return None
    speculative = vllm_config.speculative_config
    draft_model = speculative.draft_model_config if speculative is not None else None
    return int8_modules.embedding_method(draft_quant_config(vllm_config), checkpoint_name,
                                         draft_model or vllm_config.model_config)


def _slim() -> bool:
    return envs.VLLM_MTP_SLIM_DRAFT.enabled()


def draft_lm_head(make):
    """mtp-02: no lm_head of the draft's own; vLLM's drafter puts the target's in its place."""
    from vllm.model_executor.models.utils import PPMissingLayer

    return PPMissingLayer() if _slim() else make()


def draft_embedding(make):
    """mtp-02: at PP=1 none (the drafter shares the target's); at PP > 1 built in host memory,
    pinned and viewed from the GPU after loading (:func:`finish_draft_embedding`)."""
    import torch

    if not _slim():
        return make()
    if not _pipelined():
        from vllm.model_executor.models.utils import PPMissingLayer

        return PPMissingLayer()
    if not torch.cuda.is_available():
        return make()  # the host is the device already
    with torch.device("cpu"):
        return make()


def host_resident_parameters(module) -> dict:
    """The parameters of a draft embedding that live in pinned host memory: the INT8 words and
    their scales (``weight_shape``, 16 bytes, goes to the device), or a bf16 ``weight``."""
    names = ("weight_packed", "weight_scale") if hasattr(module, "weight_packed") else ("weight",)
    return {name: getattr(module, name) for name in names if getattr(module, name, None) is not None}


def draft_embedding_pinned_bytes(vocab_size: int, hidden_size: int, int8_group_size: int | None,
                                 scale_bytes: int = 2, tp_size: int = 1) -> int:
    """Pinned host bytes of the draft's embedding on the last rank at PP > 1 (mtp-02), exactly what
    :func:`finish_draft_embedding` pins: the padded vocabulary's rows of one rank's partition, one
    byte a weight plus a bf16 scale per group for INT8 (the release: 248,320 x 2,560 at group 128,
    645,632,000 B = 0.601 GiB), two bytes a weight for bf16. Torch-free, for ``flashnext plan``."""
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    rows = -(-padded // tp_size)
    if int8_group_size:
        return rows * hidden_size + rows * (hidden_size // int8_group_size) * scale_bytes
    return rows * hidden_size * 2


# Where each host-resident tensor starts in the embedding's pool: a multiple of this (no padding in
# practice: the words of a padded vocabulary are a multiple of 256 bytes).
HOST_ALIGNMENT = 256


def finish_draft_embedding(module) -> None:
    """mtp-02, after loading: move the embedding's loaded words and scales (or bf16 rows) into one
    exact-size pinned pool, back to back, and point each parameter at a UVA view of its part, so
    the GPU gathers its few rows per step over PCIe. One pool, so that with ``VLLM_EXACT_HOST_POOL=0``
    it is rounded once, as the preflight counts it. Without CUDA (the CPU backend) nothing moves."""
    import torch

    params = host_resident_parameters(module)
    if not params or not torch.cuda.is_available():
        return
    if any(p.device.type != "cpu" for p in params.values()):
        return  # built on the device (the switch off)
    from flashnext.serving.runtime.host_pool import pinned_empty, uva_view

    spans, end = [], 0
    for name, param in params.items():
        start = -(-end // HOST_ALIGNMENT) * HOST_ALIGNMENT
        end = start + param.numel() * param.element_size()
        spans.append((name, param, start, end))
    pool = pinned_empty((end,), torch.uint8)
    module.host_tensors = {}  # the views do not keep their pages alive by themselves
    for name, param, start, stop in spans:
        host = pool[start:stop].view(param.dtype).view(param.shape)
        host.copy_(param.data)
        module.host_tensors[name] = host
        param.data = uva_view(host)
    for name, param in module.named_parameters(recurse=False):
        if name not in params and param.device.type == "cpu":
            param.data = param.data.to("cuda")
