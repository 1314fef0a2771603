"""Hooks of patches ple-mmap, ttft-01 and decode-06: the PLE table served from the file that
``flashnext ple build`` writes.

vLLM 0.34.0 holds this model's 95 GiB table either on the GPU or in pinned host memory (its
default here, ``engram_config.cpu_offload``), which a 125 GiB host that also pins the QSA K/V
cannot give, or reads each step's rows from the checkpoint's shards (its new
``engram_config.disk_offload``, which this patch overrides: serving/patches/ple-mmap.md). With ``VLLM_PLE_MMAP_PATH=FILE`` (patch ple-mmap) the table is instead a read-only
shared mapping of the file, advised ``MADV_RANDOM`` (readahead multiplies NVMe traffic 23x, seed
000 §1). A step's rows are gathered on the host in the model state's ``prepare_inputs``, outside
any CUDA graph, into a fixed device buffer that the captured forward reads.

- ttft-01 (``VLLM_PLE_PREFETCH``): when a request is admitted, a worker thread advises its
  prompt's pages a window at a time with ``process_madvise`` (``flashnext.quant.ple.prefetch``).
- decode-06 (``VLLM_PLE_DECODE_ADVICE``): before a small step's gather (decode, MTP verify),
  the first and last page of each of its rows in one ``process_madvise``, so the page faults
  are served in parallel instead of one at a time.

>>> serving = attach(model)          # doctest: +SKIP  (Qwen4ExpModelState.__init__)
>>> serving.admitted("req-1", prefill_token_ids)   # add_request
>>> ids = serving.ngram_ids(input_ids, query_start_loc, ngram_context)    # prepare_inputs
>>> serving.advise(ids)
>>> serving.stage(ids)
>>> serving.finished("req-1")        # remove_request
"""

from __future__ import annotations

from pathlib import Path

from flashnext import envs
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
    ple-mmap's ``Qwen4ExpNGramEmbedding.__init__`` builds while the patch is on."""
    return file_backed_embedding_class(table_path)


def attach(model) -> PleFileServing | None:
    """The model's file-backed PLE layers, or None when ple-mmap is off or they live on another rank."""
    if table_path() is None:
        return None
    cls = embedding_class()
    owners = [m for m in model.modules() if isinstance(getattr(m, "ngram_embedding", None), cls)]
    return PleFileServing(owners) if owners else None
