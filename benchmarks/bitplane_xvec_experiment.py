"""Experiment: the library's bit-plane GEMV with the activations read as one contiguous vector per
step and split into the four strided streams in registers (``tl.split``), instead of four strided
2-byte loads. Nsight Compute put the library kernel at 78.8% of L1/TEX throughput against 20% of
DRAM at 16384² (docs/benchmarks.md): too many small loads. Side by side with the library kernel.

    python -m benchmarks.bitplane_xvec_experiment      # on the GPU machine
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from benchmarks.bitplane_kernel import side_by_side


@triton.jit
def _xvec_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                 M_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    QUADS: tl.constexpr = BLOCK_K // 4
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    PER_GROUP: tl.constexpr = GROUP // 4
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    tokens = tl.arange(0, M_PAD)
    t_mask = tokens < M
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    lo_ptr = w_ptr.to(tl.pointer_type(tl.uint16))
    half_words = K // 4
    quad = tl.arange(0, QUADS)
    for k0 in range(0, K, BLOCK_K):
        lo = tl.load(lo_ptr + rows[:, None] * (stride_wn // 2) + (k0 // 4 + quad)[None, :],
                     mask=n_mask[:, None], other=0).to(tl.int32)
        hi = tl.load(w_ptr + rows[:, None] * stride_wn + (2 * half_words + k0 // 4 + quad)[None, :],
                     mask=n_mask[:, None], other=0).to(tl.int32)
        u0 = (((lo & 15) | ((hi & 3) << 4)) - 32).to(tl.float32)
        u1 = ((((lo >> 4) & 15) | (((hi >> 2) & 3) << 4)) - 32).to(tl.float32)
        u2 = ((((lo >> 8) & 15) | (((hi >> 4) & 3) << 4)) - 32).to(tl.float32)
        u3 = ((((lo >> 12) & 15) | ((hi >> 6) << 4)) - 32).to(tl.float32)
        xv = tl.load(x_ptr + tokens[:, None] * stride_xm + k0 + tl.arange(0, BLOCK_K)[None, :],
                     mask=t_mask[:, None], other=0).to(tl.float32)
        even, odd = tl.split(tl.reshape(xv, [M_PAD, QUADS, 2, 2]))  # [.., i, j]: element 4q + 2i + j
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        prod = (u0[None, :, :] * x0[:, None, :] + u1[None, :, :] * x1[:, None, :]
                + u2[None, :, :] * x2[:, None, :] + u3[None, :, :] * x3[:, None, :])
        partial = tl.sum(tl.reshape(prod, [M_PAD, BLOCK_N, GROUPS, PER_GROUP]), axis=3)
        g_cols = k0 // GROUP + tl.arange(0, GROUPS)
        s = tl.load(s_ptr + rows[:, None] * stride_sn + g_cols[None, :], mask=n_mask[:, None], other=0).to(tl.float32)
        acc += tl.sum(partial * s[None, :, :], axis=2)
    mask = (tokens < M)[:, None] & n_mask[None, :]
    tl.store(y_ptr + tokens[:, None] * stride_ym + rows[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def xvec_gemv(x, planes, scales, bn, bk, warps):
    M, K = x.shape
    N = planes.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _xvec_kernel[(triton.cdiv(N, bn),)](x, planes, scales, y, M, N, K, x.stride(0), planes.stride(0),
                                        scales.stride(0), y.stride(0), M_PAD=triton.next_power_of_2(M),
                                        GROUP=K // scales.shape[1], BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                        num_stages=3)
    return y


def main() -> None:
    configs = [{"bn": bn, "bk": bk, "warps": w} for bn, bk, w in
               ((4, 1024, 4), (8, 512, 4), (16, 512, 4), (16, 1024, 4), (32, 512, 4), (16, 512, 8), (32, 512, 8))]
    print(json.dumps(side_by_side(xvec_gemv, configs, lambda c, k: k % c["bk"] == 0), indent=2))


if __name__ == "__main__":
    main()
