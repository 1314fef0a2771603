"""How the host side of a served profile is sized: the headroom left beside the pinned pools, and
what an allocation of pinned host memory really takes.

The preflight checks against these numbers and the exact-size pool (patch host-pool) refuses by
them at start, so both have to be the same numbers, here.
"""

from __future__ import annotations

# Host RAM left free beyond every pinned pool: the engine's own processes, CUDA contexts, the PLE
# table's page cache and the PLE prefetcher's buffers.
HOST_HEADROOM = 4 << 30


def next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def pinned_bytes(nbytes: int, exact_pool: bool) -> int:
    """What pinning ``nbytes`` takes: exactly that with the exact-size pool (``VLLM_EXACT_HOST_POOL``),
    else the power of two PyTorch's caching host allocator rounds it up to."""
    return nbytes if exact_pool else next_power_of_two(nbytes)
