"""Experiment: the bit-plane GEMV with its tiles loaded 3-D ([rows, groups, quads]) so the per-group
sum is a plain reduction over the last axis, with no ``tl.reshape`` in the loop (which may cost a
layout conversion through shared memory), optionally with the float magic-number decode. Compared
side by side with the library kernel at the real and large shapes; results in docs/benchmarks.md.

    python -m benchmarks.bitplane_v4_experiment      # on the GPU machine
"""

from __future__ import annotations

import itertools
import json

import torch
import triton
import triton.language as tl

from benchmarks.bitplane_kernel import side_by_side


@triton.jit
def _v4_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
               M_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS_PER_ITER: tl.constexpr,
               MAGIC: tl.constexpr):
    PER: tl.constexpr = GROUP // 4
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    tokens = tl.arange(0, M_PAD)
    t_mask = tokens < M
    g = tl.arange(0, GROUPS_PER_ITER)
    q = tl.arange(0, PER)
    lo_ptr = w_ptr.to(tl.pointer_type(tl.uint16))
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    hi_base = K // 2
    for k0 in range(0, K, GROUPS_PER_ITER * GROUP):
        quad = k0 // 4 + g[:, None] * PER + q[None, :]  # [G, PER]
        lo = tl.load(lo_ptr + rows[:, None, None] * (stride_wn // 2) + quad[None], mask=n_mask[:, None, None],
                     other=0).to(tl.int32)
        hi = tl.load(w_ptr + rows[:, None, None] * stride_wn + hi_base + quad[None], mask=n_mask[:, None, None],
                     other=0).to(tl.int32)
        if MAGIC:
            u0 = ((lo & 15) | ((hi & 3) << 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0
            u1 = (((lo >> 4) & 15) | (((hi >> 2) & 3) << 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0
            u2 = (((lo >> 8) & 15) | (((hi >> 4) & 3) << 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0
            u3 = (((lo >> 12) & 15) | ((hi >> 6) << 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0
        else:
            u0 = (((lo & 15) | ((hi & 3) << 4)) - 32).to(tl.float32)
            u1 = ((((lo >> 4) & 15) | (((hi >> 2) & 3) << 4)) - 32).to(tl.float32)
            u2 = ((((lo >> 8) & 15) | (((hi >> 4) & 3) << 4)) - 32).to(tl.float32)
            u3 = ((((lo >> 12) & 15) | ((hi >> 6) << 4)) - 32).to(tl.float32)
        xb = x_ptr + tokens[:, None, None] * stride_xm + 4 * quad[None]
        x0 = tl.load(xb, mask=t_mask[:, None, None], other=0).to(tl.float32)
        x1 = tl.load(xb + 1, mask=t_mask[:, None, None], other=0).to(tl.float32)
        x2 = tl.load(xb + 2, mask=t_mask[:, None, None], other=0).to(tl.float32)
        x3 = tl.load(xb + 3, mask=t_mask[:, None, None], other=0).to(tl.float32)
        prod = u0[None] * x0[:, None] + u1[None] * x1[:, None] + u2[None] * x2[:, None] + u3[None] * x3[:, None]
        part = tl.sum(prod, axis=3)  # [M_PAD, BN, G]
        s = tl.load(s_ptr + rows[:, None] * stride_sn + (k0 // GROUP + g)[None, :], mask=n_mask[:, None],
                    other=0).to(tl.float32)
        acc += tl.sum(part * s[None], axis=2)
    mask = t_mask[:, None] & n_mask[None, :]
    tl.store(y_ptr + tokens[:, None] * stride_ym + rows[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def v4_gemv(x, planes, scales, bn, gpi, warps, stages, magic):
    M, K = x.shape
    N = planes.shape[0]
    group = K // scales.shape[1]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _v4_kernel[(triton.cdiv(N, bn),)](x, planes, scales, y, M, N, K, x.stride(0), planes.stride(0), scales.stride(0),
                                      y.stride(0), M_PAD=triton.next_power_of_2(M), GROUP=group, BLOCK_N=bn,
                                      GROUPS_PER_ITER=gpi, MAGIC=magic, num_warps=warps, num_stages=stages)
    return y


def main() -> None:
    configs = [{"bn": bn, "gpi": gpi, "warps": w, "stages": 3, "magic": magic}
               for bn, gpi, w, magic in itertools.product((4, 8, 16, 32), (2, 4, 8), (4, 8), (False, True))]
    print(json.dumps(side_by_side(v4_gemv, configs, lambda c, k: k % (c["gpi"] * 64) == 0), indent=2))


if __name__ == "__main__":
    main()
