"""The PLE table served from the file ``flashnext ple build`` writes (patches ple-mmap, ttft-01 and
decode-06): vLLM's PLE embedding backend over the mapped file, staging each step's rows into a
fixed device buffer, and the model-wide driver the model state calls.

The decisions (whether the patch is on, which file) are the adapter's,
:mod:`flashnext.serving.hooks.ple_file`; the file itself (mapping, advice, gathers) is the library's,
:mod:`flashnext.quant.ple.mapped`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import numpy as np

from flashnext import envs
from flashnext.errors import FlashnextError
from flashnext.quant.ple.hashing import NgramHasher
from flashnext.quant.ple.layout import PleLayout
from flashnext.quant.ple.mapped import PleTableFile
from flashnext.quant.ple.prefetch import PromptPrefetcher

log = logging.getLogger(__name__)


def hasher_of(owner) -> NgramHasher:
    """The numpy twin of ``owner``'s (a ``Qwen4ExpNGramEmbedding``) n-gram hash, from its loaded buffers."""
    sizes = tuple(int(v) for v in owner.ngram_heads_vocab_sizes.tolist())
    layout = PleLayout(
        vocab_size=int(owner.unigram_vocab_size), ngram_size=int(owner.ngram_size),
        heads_per_ngram=int(owner.heads_per_ngram), head_dim=int(owner.head_dim),
        multipliers=tuple(int(v) for v in owner.layer_multipliers.tolist()), head_sizes=sizes,
        head_offsets=tuple(int(v) for v in owner.ngram_heads_offsets.tolist()), rows=sum(sizes),
        padded_rows=int(owner.ngram_embedding.table.num_rows), split_parts=int(owner.split_ngram_parts),
        eos_token_id=int(owner.eos_token_id))
    return NgramHasher(layout)


def staged_rows_shape(max_total_tokens: int, num_ngram_heads: int, embedding_dim: int) -> tuple[int, int, int]:
    """The device buffer a step's PLE rows are staged into (one per PLE layer, built with the
    model); the pinned host staging buffer holds the same rows' bytes. ``flashnext plan``'s ledger
    counts both from here."""
    return max(max_total_tokens, 1), num_ngram_heads, embedding_dim


_EMBEDDING_CLASS = None


def file_backed_embedding_class(table_path: Callable[[], Path | None]):
    """The vLLM PLE embedding backend over the table file (a ``Qwen4ExpPLEEmbedding`` subclass, made
    once, when vLLM is importable); ``table_path`` says where the file is when a layer allocates."""
    global _EMBEDDING_CLASS
    if _EMBEDDING_CLASS is not None:
        return _EMBEDDING_CLASS
    import torch
    from vllm.models.qwen4_exp.common.ngram_embedding import (
        Qwen4ExpPLEEmbedding,
        Qwen4ExpPLEUnquantizedEmbeddingMethod,
    )

    class FileBackedPLEEmbedding(Qwen4ExpPLEEmbedding):
        """PLE rows from the table file, staged by the host into a fixed device buffer."""

        supports_prefetch = False

        def __init__(self, num_embeddings: int, embedding_dim: int, *, num_ngram_heads: int = 1,
                     max_total_tokens: int = 0, **kwargs) -> None:
            super().__init__(num_embeddings, embedding_dim, num_ngram_heads=num_ngram_heads,
                             max_total_tokens=max_total_tokens, **kwargs)
            if not isinstance(self.embedding_method, Qwen4ExpPLEUnquantizedEmbeddingMethod):
                raise FlashnextError(f"VLLM_PLE_MMAP_PATH serves BF16 PLE tables; this checkpoint's is "
                                     f"{type(self.embedding_method).__name__}")
            if self.tp_size != 1:
                raise FlashnextError("VLLM_PLE_MMAP_PATH needs the PLE table unsharded (engram TP size 1)")
            # the checkpoint's shards are already in the file: spot-check them instead of copying
            self.weight.weight_loader = self._check_shard
            # a fixed address, so CUDA graphs captured over the forward read each step's rows
            self.staged_rows = torch.zeros(staged_rows_shape(max_total_tokens, num_ngram_heads, embedding_dim),
                                           dtype=self.weight.dtype)
            self.staged_tokens = -1
            self._staging = None
            self._copied = None

        def allocate_embedding_weight(self, num_embeddings: int, embedding_dim: int, dtype) -> torch.Tensor:
            row_bytes = embedding_dim * torch.empty((), dtype=dtype).element_size()
            self.table = PleTableFile(table_path(), num_embeddings, row_bytes)
            log.info("PLE table served from %s (%d rows of %d B, MADV_RANDOM)", self.table.path,
                     num_embeddings, row_bytes)
            return self.table.as_tensor(dtype)

        def _check_shard(self, param, loaded_weight: torch.Tensor, checkpoint_start: int = 0) -> None:
            n = loaded_weight.shape[0]
            for r in sorted({0, n - 1}) if n else []:
                if not torch.equal(param.data[checkpoint_start + r], loaded_weight[r].to(param.dtype)):
                    raise FlashnextError(f"{self.table.path} differs from the checkpoint at row "
                                         f"{checkpoint_start + r}: rebuild it with `flashnext ple build`")

        def stage(self, ids: np.ndarray) -> None:
            """Gather the rows of ``ids [T, heads]`` (host int64) into ``staged_rows[:T]``."""
            tokens = ids.shape[0]
            if tokens > self.staged_rows.shape[0]:
                raise ValueError(f"{tokens} tokens exceed the PLE staging buffer ({self.staged_rows.shape[0]})")
            on_gpu = self.staged_rows.is_cuda
            if self._staging is None:
                self._staging = torch.empty((self.staged_rows.shape[0] * self.staged_rows.shape[1],
                                             self.table.row_bytes), dtype=torch.uint8, pin_memory=on_gpu)
            if self._copied is not None:
                self._copied.synchronize()  # the previous step's copy has left the staging buffer
            self.table.gather(ids, out=self._staging.numpy())
            rows = self._staging[: ids.size].view(self.staged_rows.dtype).view(tokens, *self.staged_rows.shape[1:])
            self.staged_rows[:tokens].copy_(rows, non_blocking=on_gpu)
            if on_gpu:
                self._copied = torch.cuda.Event()
                self._copied.record()
            self.staged_tokens = tokens

        def start_prefetch(self, ngram_ids: torch.Tensor) -> None:
            return None

        def finalize_prefetch(self, total_tokens: int) -> torch.Tensor:
            raise RuntimeError("the file-backed PLE embedding stages rows in prepare_inputs, not by prefetch")

        def forward(self, ngram_ids: torch.Tensor) -> torch.Tensor:
            tokens = ngram_ids.shape[0]
            capturing = self.staged_rows.is_cuda and torch.cuda.is_current_stream_capturing()
            if not capturing and self.staged_tokens != tokens:
                # a forward that prepare_inputs did not stage for (a dummy or profiling run)
                self.stage(ngram_ids.to("cpu", torch.int64).numpy())
            self.staged_tokens = -1
            return self.staged_rows[:tokens]

    _EMBEDDING_CLASS = FileBackedPLEEmbedding
    return FileBackedPLEEmbedding


class PleFileServing:
    """The file-backed PLE layers of one model, driven by its model state
    (:mod:`flashnext.serving.models.qwen4_exp`)."""

    def __init__(self, owners: list):
        self.owners = owners
        self._prefill_tokens: dict[str, np.ndarray] = {}  # request id -> the tokens it prefills
        self._hashers: list[NgramHasher] | None = None
        self._prefetchers: list[PromptPrefetcher] | None = None

    def _layer_hashers(self) -> list[NgramHasher]:
        if self._hashers is None:  # after weight loading, when the hash buffers hold their values
            self._hashers = [hasher_of(o) for o in self.owners]
        return self._hashers

    def _prompt_prefetchers(self) -> list[PromptPrefetcher]:
        if self._prefetchers is None:
            self._prefetchers = [PromptPrefetcher(o.ngram_embedding.table.mapping, h)
                                 for o, h in zip(self.owners, self._layer_hashers())]
        return self._prefetchers

    def add_request(self, request_id: str, prefill_token_ids, num_computed_tokens: int) -> None:
        """A request admitted to the runner (``NewRequestData``): its prefill tokens are kept, so
        that its prefill chunks' rows are hashed on the host, and its pages are read ahead."""
        tokens = np.asarray(prefill_token_ids, dtype=np.int64)
        self._prefill_tokens[request_id] = tokens
        self.admitted(request_id, tokens, num_computed_tokens)

    def remove_request(self, request_id: str) -> None:
        self._prefill_tokens.pop(request_id, None)
        self.finished(request_id)

    def admitted(self, request_id: str, token_ids, num_computed_tokens: int = 0) -> None:
        """ttft-01: advise the pages of the tokens a request will prefill (vLLM 0.34.0's
        ``NewRequestData.prefill_token_ids``: the prompt, and on a resume the tokens generated
        before it) while it waits for its prefill. The first ``num_computed_tokens`` (a prefix-cache
        hit, whose K/V is cached) are not prefilled: only their last ``ngram_size - 1`` are read, as
        the first prefilled token's n-gram context."""
        if not envs.VLLM_PLE_PREFETCH.enabled() or len(token_ids) <= num_computed_tokens:
            return
        tokens = np.asarray(token_ids, dtype=np.int64)
        for prefetcher in self._prompt_prefetchers():
            context = _context_before(tokens, num_computed_tokens, prefetcher.hasher)
            prefetcher.submit(request_id, tokens[num_computed_tokens:], context)

    def finished(self, request_id: str) -> None:
        if self._prefetchers is not None:
            for prefetcher in self._prefetchers:
                prefetcher.cancel(request_id)

    def step_ids(self, input_batch, query_start_loc, ngram_context) -> list[np.ndarray]:
        """ple-mmap: each PLE layer's row ids for this step (``[tokens after padding, heads]``),
        on the host: hashed there when the host holds every token the step's rows need
        (:meth:`host_ids`), else from vLLM's kernel (:meth:`ngram_ids`)."""
        host = self.host_ids(input_batch)
        return host if host is not None else self.ngram_ids(input_batch.input_ids, query_start_loc, ngram_context)

    def host_ids(self, input_batch) -> list[np.ndarray] | None:
        """The step's row ids hashed on the host by the kernel's numpy twin, with no device copy,
        when every token of the step is one of its request's prefill tokens (a prefill chunk's
        tokens and the ``ngram_size - 1`` before them: the prompt, or on a resume what was generated
        before it); None when one is not, which a decode or MTP verify row never is (its token was
        sampled or drafted on the device, and at PP > 1 reached this rank by an NCCL broadcast), and
        for a step padded to a captured graph's size (the profiles capture decode steps only)."""
        if input_batch.num_draft_tokens or input_batch.num_tokens_after_padding != input_batch.num_tokens:
            return None
        num_reqs = input_batch.num_reqs
        starts = input_batch.num_computed_tokens_np[:num_reqs].tolist()
        counts = input_batch.num_scheduled_tokens[:num_reqs].tolist()
        prefills = [self._prefill_tokens.get(r) for r in input_batch.req_ids[:num_reqs]]
        if any(p is None or s + c > len(p) for p, s, c in zip(prefills, starts, counts)):
            return None
        hashers = self._layer_hashers()
        tokens = np.concatenate([p[s:s + c] for p, s, c in zip(prefills, starts, counts)])
        context = np.stack([_context_before(p, s, hashers[0]) for p, s in zip(prefills, starts)])
        return [h.ids(tokens, input_batch.query_start_loc_np[:num_reqs + 1], context) for h in hashers]

    def ngram_ids(self, input_ids, query_start_loc, ngram_context) -> list[np.ndarray]:
        """Each PLE layer's row ids from vLLM's own hash kernel, copied to the host.

        The copy waits for the device: a decode step's newest token (and MTP's drafts) exists only
        there, received from the last pipeline rank, so the host cannot hash it earlier; a pinned
        non-blocking copy waits just as long (docs/serving.md, benchmarks/ple_ids_sync.py)."""
        import torch

        return [o.compute_ngram_ids(input_ids, query_start_loc, ngram_context).to("cpu", torch.int64).numpy()
                for o in self.owners]

    def advise(self, step_ids: list[np.ndarray]) -> int:
        """decode-06: a small step's pages, asked for together right before the gather; returns
        how many layers were advised (none for a prefill-sized step, whose prompt ttft-01 covers)."""
        return sum(owner.ngram_embedding.table.advise_step(ids) for owner, ids in zip(self.owners, step_ids))

    def stage(self, step_ids: list[np.ndarray]) -> None:
        """ple-mmap: gather each layer's rows into its device buffer for the forward to read."""
        for owner, ids in zip(self.owners, step_ids):
            owner.ngram_embedding.stage(ids)


def _context_before(tokens: np.ndarray, start: int, hasher: NgramHasher) -> np.ndarray:
    """The ``ngram_size - 1`` tokens before ``tokens[start]``, oldest first, EOS before the first
    (what vLLM's ``Qwen4ExpModelState._prepare_ngram_context`` gives the kernel)."""
    context = np.full(hasher.context_len, hasher.eos, dtype=np.int64)
    before = tokens[max(start - hasher.context_len, 0):start]
    context[len(context) - len(before):] = before
    return context
