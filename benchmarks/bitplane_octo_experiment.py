"""The bit-plane GEMV's two decode paths, side by side: four weights per load (16-bit low-plane,
8-bit high-plane reads) and eight (32-bit and 16-bit reads, activations read contiguously), each
at several launch configurations, forced onto every matrix size. Nsight Compute put the four-weight
kernel at 78.8% of L1/TEX throughput against 20% of DRAM at 16384²; this is the experiment that
made the eight-weight path the large matrices' default (docs/benchmarks.md).

    python -m benchmarks.bitplane_octo_experiment      # on the GPU machine
"""

from __future__ import annotations

import json

from benchmarks.bitplane_kernel import side_by_side
from flashnext.quant.kernels import bitplane_gemv as kernels


def forced_gemv(x, planes, scales, wide, bn, bk, warps):
    """The library's GEMV with one launch configuration for every size class."""
    saved = {size: dict(cfg) for size, cfg in kernels._LAUNCH.items()}
    try:
        for size in saved:
            kernels.set_launch_config(size, wide=wide, block_n=bn, block_k=bk, num_warps=warps, num_stages=3)
        return kernels.bitplane_gemv(x, planes, scales)
    finally:
        kernels._LAUNCH.update(saved)


def main() -> None:
    configs = [{"wide": wide, "bn": bn, "bk": bk, "warps": w}
               for wide in (False, True)
               for bn, bk, w in ((4, 1024, 4), (8, 512, 4), (8, 1024, 4), (16, 512, 4), (16, 1024, 4), (32, 512, 4),
                                 (16, 512, 8), (4, 512, 4), (8, 256, 4), (8, 128, 4), (4, 128, 4))]
    print(json.dumps(side_by_side(forced_gemv, configs, lambda c, k: k % c["bk"] == 0), indent=2))


if __name__ == "__main__":
    main()
