"""Pinned host memory for a QSA K/V layer pool or the PLE table: PyTorch's caching host allocator
(power-of-two blocks) against flashnext's exact-size pool (patch host-pool), side by side.

For each size: the bytes each one pins, the time to allocate and pin, and host-to-device copy
bandwidth out of it. Needs a CUDA GPU.

    python benchmarks/host_pool.py [--gib 4.24 1.5] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from flashnext.serving.runtime import host_pool


def _h2d_gbps(host: torch.Tensor, nbytes: int = 1 << 30, repeat: int = 5) -> float:
    src = host.view(torch.uint8)[:nbytes]
    dst = torch.empty(src.numel(), dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return repeat * src.numel() / (time.perf_counter() - start) / 1e9


def measure(gib: float) -> dict:
    nbytes = int(gib * 2**30)
    torch.empty(1, pin_memory=True)  # the allocator's statistics start with its first block
    stats = torch.cuda.host_memory_stats
    before = stats().get("allocated_bytes.current", 0)
    t0 = time.perf_counter()
    rounded = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    torch_s = time.perf_counter() - t0
    torch_bytes = stats().get("allocated_bytes.current", 0) - before
    torch_bw = _h2d_gbps(rounded)
    del rounded
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()

    t0 = time.perf_counter()
    exact = host_pool.pinned_empty((nbytes,), torch.uint8)
    exact_s = time.perf_counter() - t0
    exact_bw = _h2d_gbps(exact)
    exact_bytes = host_pool._POOLS[-1].nbytes
    del exact
    host_pool._POOLS.pop().close()
    return {"requested_bytes": nbytes, "torch_pinned_bytes": torch_bytes, "exact_pinned_bytes": exact_bytes,
            "torch_alloc_s": round(torch_s, 3), "exact_alloc_s": round(exact_s, 3),
            "torch_h2d_gbps": round(torch_bw, 1), "exact_h2d_gbps": round(exact_bw, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, nargs="+", default=[4.24, 1.5])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [measure(g) for g in args.gib]
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))
        return
    print(f"device: {torch.cuda.get_device_name()}")
    for r in rows:
        print(f"{r['requested_bytes'] / 2**30:6.2f} GiB asked: PyTorch pins {r['torch_pinned_bytes'] / 2**30:6.2f} GiB "
              f"in {r['torch_alloc_s']:.2f} s ({r['torch_h2d_gbps']} GB/s H2D); exact pool "
              f"{r['exact_pinned_bytes'] / 2**30:6.2f} GiB in {r['exact_alloc_s']:.2f} s ({r['exact_h2d_gbps']} GB/s H2D)")


if __name__ == "__main__":
    main()
