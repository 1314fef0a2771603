"""Experiment: the bit-plane GEMV with wider loads, as Nsight Compute's L1 profile suggests: the low
plane read 32 bits (eight weights) and the high plane 16 bits per thread at a time, and the
activations as one contiguous vector split into eight strided streams in registers. Side by side
with the library kernel; results in docs/benchmarks.md.

    python -m benchmarks.bitplane_octo_experiment      # on the GPU machine
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from benchmarks.bitplane_kernel import bench, copy_bandwidth
from flashnext.quant.bitplane import codes_to_bitplane
from flashnext.quant.kernels.bitplane_gemv import bitplane_gemv


@triton.jit
def _octo_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                 M_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    OCTS: tl.constexpr = BLOCK_K // 8
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    PER_GROUP: tl.constexpr = GROUP // 8
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    tokens = tl.arange(0, M_PAD)
    t_mask = tokens < M
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    lo_ptr = w_ptr.to(tl.pointer_type(tl.uint32))
    hi_ptr = w_ptr.to(tl.pointer_type(tl.uint16))
    octs = tl.arange(0, OCTS)
    for k0 in range(0, K, BLOCK_K):
        lo = tl.load(lo_ptr + rows[:, None] * (stride_wn // 4) + (k0 // 8 + octs)[None, :],
                     mask=n_mask[:, None], other=0)
        hi = tl.load(hi_ptr + rows[:, None] * (stride_wn // 2) + (K // 4 + k0 // 8 + octs)[None, :],
                     mask=n_mask[:, None], other=0).to(tl.uint32)
        xv = tl.load(x_ptr + tokens[:, None] * stride_xm + k0 + tl.arange(0, BLOCK_K)[None, :],
                     mask=t_mask[:, None], other=0).to(tl.float32)
        c0, c1 = tl.split(tl.reshape(xv, [M_PAD, OCTS, 2, 2, 2]))  # [.., a, b, c]: element 8o + 4a + 2b + c
        b00, b01 = tl.split(c0)
        b10, b11 = tl.split(c1)
        x0, x4 = tl.split(b00)
        x2, x6 = tl.split(b01)
        x1, x5 = tl.split(b10)
        x3, x7 = tl.split(b11)
        prod = tl.zeros([M_PAD, BLOCK_N, OCTS], dtype=tl.float32)
        prod += ((((lo & 15) | ((hi & 3) << 4)).to(tl.int32) - 32).to(tl.float32))[None] * x0[:, None]
        prod += (((((lo >> 4) & 15) | (((hi >> 2) & 3) << 4)).to(tl.int32) - 32).to(tl.float32))[None] * x1[:, None]
        prod += (((((lo >> 8) & 15) | (((hi >> 4) & 3) << 4)).to(tl.int32) - 32).to(tl.float32))[None] * x2[:, None]
        prod += (((((lo >> 12) & 15) | (((hi >> 6) & 3) << 4)).to(tl.int32) - 32).to(tl.float32))[None] * x3[:, None]
        prod += (((((lo >> 16) & 15) | (((hi >> 8) & 3) << 4)).to(tl.int32) - 32).to(tl.float32))[None] * x4[:, None]
        prod += (((((lo >> 20) & 15) | (((hi >> 10) & 3) << 4)).to(tl.int32) - 32).to(tl.float32))[None] * x5[:, None]
        prod += (((((lo >> 24) & 15) | (((hi >> 12) & 3) << 4)).to(tl.int32) - 32).to(tl.float32))[None] * x6[:, None]
        prod += ((((lo >> 28) | ((hi >> 14) << 4)).to(tl.int32) - 32).to(tl.float32))[None] * x7[:, None]
        partial = tl.sum(tl.reshape(prod, [M_PAD, BLOCK_N, GROUPS, PER_GROUP]), axis=3)
        g_cols = k0 // GROUP + tl.arange(0, GROUPS)
        s = tl.load(s_ptr + rows[:, None] * stride_sn + g_cols[None, :], mask=n_mask[:, None], other=0).to(tl.float32)
        acc += tl.sum(partial * s[None, :, :], axis=2)
    mask = (tokens < M)[:, None] & n_mask[None, :]
    tl.store(y_ptr + tokens[:, None] * stride_ym + rows[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def octo_gemv(x, planes, scales, bn, bk, warps):
    M, K = x.shape
    N = planes.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _octo_kernel[(triton.cdiv(N, bn),)](x, planes, scales, y, M, N, K, x.stride(0), planes.stride(0),
                                        scales.stride(0), y.stride(0), M_PAD=triton.next_power_of_2(M),
                                        GROUP=K // scales.shape[1], BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                        num_stages=3)
    return y


def main() -> None:
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    out = {"device": torch.cuda.get_device_name(), "copy_gb_s": round(copy_bw / 1e9, 1), "shapes": []}
    configs = [(4, 1024, 4), (8, 512, 4), (8, 1024, 4), (16, 512, 4), (16, 1024, 4), (32, 512, 4), (16, 512, 8), (4, 512, 4), (8, 256, 4), (8, 128, 4), (4, 128, 4)]
    for n, k, m in ((16384, 16384, 1), (16384, 16384, 4), (1280, 2560, 1), (2560, 640, 1), (1280, 2560, 4)):
        q = torch.randint(-32, 32, (n, k), dtype=torch.int8, device="cuda")
        scales = (torch.randn(n, k // 64, device="cuda") * 0.02).to(torch.bfloat16)
        planes = codes_to_bitplane(q)
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        ref = x.float() @ (q.float() * scales.float().repeat_interleave(64, 1)).T
        nbytes = planes.numel() + scales.numel() * 2
        lib = bench(lambda: bitplane_gemv(x, planes, scales))
        rows = []
        for bn, bk, warps in configs:
            if k % bk:
                continue
            try:
                y = octo_gemv(x, planes, scales, bn, bk, warps)
                err = ((y.float() - ref).abs() / ref.abs().clamp_min(1)).max().item()
                us = bench(lambda: octo_gemv(x, planes, scales, bn, bk, warps))
                rows.append({"bn": bn, "bk": bk, "warps": warps, "us": round(us, 2), "max_rel_err": err,
                             "fraction_of_copy_bw": round(nbytes / (us / 1e6) / copy_bw, 3)})
            except Exception as e:
                rows.append({"bn": bn, "bk": bk, "warps": warps, "error": f"{type(e).__name__}: {e}"[:200]})
        ok = [r for r in rows if "us" in r]
        out["shapes"].append({"n": n, "k": k, "m": m, "library_us": round(lib, 2),
                              "library_fraction_of_copy_bw": round(nbytes / (lib / 1e6) / copy_bw, 3),
                              "best_octo": min(ok, key=lambda r: r["us"]) if ok else None,
                              "errors": [r for r in rows if "error" in r][:2]})
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
