"""Patch host-pool: vLLM's pinned host buffers (the PLE table, the QSA K/V rows, the draft's
embedding) allocated at exactly their size.

The patch's call sites ask this module for :func:`pinned_empty`; the pool itself, the free-RAM
check under the ranks' shared lock and the CUDA views of pinned memory are engine-side mechanisms
other patches use too, so they live in :mod:`flashnext.serving.runtime.host_pool`.
"""

from __future__ import annotations

from flashnext.serving.runtime.host_pool import pinned_empty


__all__ = ["pinned_empty"]
