"""Hooks of patches ple-mmap, ttft-01 and decode-06: the PLE table served from the file that
``flashnext ple build`` writes.

vLLM 0.34.0 holds this model's 95 GiB table either on the GPU or in pinned host memory (its
default here, ``engram_config.cpu_offload``), which a 125 GiB host that also pins the QSA K/V
cannot give, or reads each step's rows from the checkpoint's shards (its new
``engram_config.disk_offload``, which this patch overrides: serving/patches/ple-mmap.patch). With
``VLLM_PLE_MMAP_PATH=FILE`` (patch ple-mmap) the table is instead a read-only shared mapping of the
file, advised ``MADV_RANDOM`` (readahead multiplies NVMe traffic 23x, seed 000 §1). A step's rows
are gathered on the host in the model state's ``prepare_inputs``, outside any CUDA graph, into a
fixed device buffer that the captured forward reads. The model state is flashnext's subclass of
vLLM's (:mod:`flashnext.serving.models.qwen4_exp`, registered by flashnext's vLLM plugin).

- ttft-01 (``VLLM_PLE_PREFETCH``): when a request is admitted, a worker thread advises the pages of
  the tokens it will prefill (those a prefix-cache hit computed are skipped) a window at a time
  with ``process_madvise`` (``flashnext.quant.ple.prefetch``).
- decode-06 (``VLLM_PLE_DECODE_ADVICE``): before a small step's gather (decode, MTP verify),
  the first and last page of each of its rows in one ``process_madvise``, so the page faults
  are served in parallel instead of one at a time.

>>> serving = attach(model)          # doctest: +SKIP  (the model state's __init__)
>>> serving.add_request("req-1", prefill_token_ids, num_computed_tokens)   # add_request: ttft-01
>>> ids = serving.step_ids(input_batch, query_start_loc, ngram_context)    # prepare_inputs
>>> serving.advise(ids)              # decode-06
>>> serving.stage(ids)
>>> serving.remove_request("req-1")  # remove_request
"""

from __future__ import annotations

from pathlib import Path

from flashnext import envs
from flashnext.errors import FlashnextError
from flashnext.quant.ple.mapped import DECODE_ADVICE_MAX_ROWS, PleTableFile
from flashnext.serving.runtime.ple_file import PleFileServing, file_backed_embedding_class, hasher_of

__all__ = ["DECODE_ADVICE_MAX_ROWS", "PleTableFile", "PleFileServing", "table_path", "hasher_of", "embedding_class",
           "attach"]


def table_path() -> Path | None:
    """The table file patch ple-mmap serves from, or None when the patch is off."""
    value = envs.VLLM_PLE_MMAP_PATH.get().strip()
    return Path(value) if value else None


def embedding_class():
    """The vLLM PLE embedding backend over the table file (a ``Qwen4ExpPLEEmbedding``), which patch
    ple-mmap's ``Qwen4ExpNGramEmbedding.__init__`` builds while the patch is on.

    Refused unless flashnext's model is the one vLLM builds in this process: its model state stages
    each step's rows, and a forward captured in a CUDA graph would otherwise read rows no step
    staged (vLLM's ``VLLM_PLUGINS`` allow-list can leave flashnext's plugin out)."""
    from flashnext.serving.models import qwen4_exp

    if not qwen4_exp.registered():
        raise FlashnextError(f"{envs.VLLM_PLE_MMAP_PATH.name} needs flashnext's vLLM plugin, whose model state "
                             "stages the PLE rows, and it did not register qwen4_exp in this process: "
                             "add flashnext to VLLM_PLUGINS or unset the variable")
    return file_backed_embedding_class(table_path)


def attach(model) -> PleFileServing | None:
    """The model's file-backed PLE layers, or None when ple-mmap is off or they live on another rank."""
    if table_path() is None:
        return None
    cls = embedding_class()
    owners = [m for m in model.modules() if isinstance(getattr(m, "ngram_embedding", None), cls)]
    return PleFileServing(owners) if owners else None
