"""Patch host-pool: vLLM's pinned host buffers (the PLE table, the QSA K/V rows, the draft's
embedding) allocated at exactly their size.

The patch's call sites ask this module for :func:`pinned_empty`; the pool itself, the free-RAM
check under the ranks' shared lock and the CUDA views of pinned memory are engine-side mechanisms
other patches use too, so they live in :mod:`flashnext.serving.runtime.host_pool`.
"""

from __future__ import annotations

from flashnext.serving.runtime.host_pool import pinned_empty

# Still read from here by tests/serving/test_preflight.py (PinnedHostPool),
# tests/quant/kernels/test_qsa_row_cache.py and benchmarks/qsa_offload.py (uva_view),
# tests/serving/patches/test_draft_embedding_uva.py and benchmarks/host_pool.py (_POOLS, the same
# list object); remove these once they import flashnext.serving.runtime.host_pool (issue 27).
from flashnext.serving.runtime.host_pool import _POOLS, PinnedHostPool, uva_view

__all__ = ["pinned_empty", "PinnedHostPool", "uva_view", "_POOLS"]
