"""Experiment: the bit-plane GEMV with tl.dot on tensor cores (x padded to 16 rows, bf16 activations).

Not in the library unless it wins; see docs/benchmarks.md."""

import triton
import triton.language as tl


@triton.jit
def _dot_rows_tc(x_ptr, w_ptr, s_ptr, rows, n_mask, M, K, stride_xm, stride_wn, stride_sn,
                 GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """[16, BLOCK_N] fp32 dot products on tensor cores: one group of weights per step, decoded
    into four 16-wide bf16 streams (elements 4i+j), each multiplied with the matching strided
    activations by tl.dot."""
    Q: tl.constexpr = GROUP // 4
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    lo_ptr = w_ptr.to(tl.pointer_type(tl.uint16))
    half_words = K // 4
    tokens = tl.arange(0, 16)
    t_mask = tokens < M
    quad = tl.arange(0, Q)
    for k0 in range(0, K, GROUP):
        lo = tl.load(lo_ptr + rows[None, :] * (stride_wn // 2) + (k0 // 4 + quad)[:, None],
                     mask=n_mask[None, :], other=0).to(tl.int32)          # [Q, BLOCK_N]
        hi = tl.load(w_ptr + rows[None, :] * stride_wn + (2 * half_words + k0 // 4 + quad)[:, None],
                     mask=n_mask[None, :], other=0).to(tl.int32)
        xb = x_ptr + tokens[:, None] * stride_xm + k0 + 4 * quad[None, :]  # [16, Q]
        part = tl.dot(tl.load(xb, mask=t_mask[:, None], other=0).to(tl.float16),
                      (((lo & 15) | ((hi & 3) << 4)) - 32).to(tl.float16))
        part += tl.dot(tl.load(xb + 1, mask=t_mask[:, None], other=0).to(tl.float16),
                       ((((lo >> 4) & 15) | (((hi >> 2) & 3) << 4)) - 32).to(tl.float16))
        part += tl.dot(tl.load(xb + 2, mask=t_mask[:, None], other=0).to(tl.float16),
                       ((((lo >> 8) & 15) | (((hi >> 4) & 3) << 4)) - 32).to(tl.float16))
        part += tl.dot(tl.load(xb + 3, mask=t_mask[:, None], other=0).to(tl.float16),
                       ((((lo >> 12) & 15) | ((hi >> 6) << 4)) - 32).to(tl.float16))
        s = tl.load(s_ptr + rows * stride_sn + k0 // GROUP, mask=n_mask, other=0).to(tl.float32)
        acc += part * s[None, :]
    return acc


@triton.jit
def _gemv_tc_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                    GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    tokens = tl.arange(0, 16)
    acc = _dot_rows_tc(x_ptr, w_ptr, s_ptr, rows, n_mask, M, K, stride_xm, stride_wn, stride_sn, GROUP, BLOCK_N)
    mask = (tokens < M)[:, None] & n_mask[None, :]
    tl.store(y_ptr + tokens[:, None] * stride_ym + rows[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def gemv_tc(x, planes, scales, block_n=64, num_warps=4, num_stages=3):
    import torch
    M, K = x.shape
    N = planes.shape[0]
    group = K // scales.shape[1]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _gemv_tc_kernel[(triton.cdiv(N, block_n),)](x, planes, scales, y, M, N, K, x.stride(0), planes.stride(0),
                                               scales.stride(0), y.stride(0), GROUP=group, BLOCK_N=block_n,
                                               num_warps=num_warps, num_stages=num_stages)
    return y


def main():
    import json
    import torch
    from flashnext.quant.formats.bitplane import codes_to_bitplane
    from flashnext.quant.kernels.bitplane_gemv import bitplane_gemv
    out = {}
    for n, k in ((1280, 2560), (2560, 640), (16384, 16384)):
        q = torch.randint(-32, 32, (n, k), dtype=torch.int8, device="cuda")
        s = (torch.randn(n, k // 64, device="cuda") * 0.02).to(torch.bfloat16)
        planes = codes_to_bitplane(q)
        w = q.float() * s.float().repeat_interleave(64, 1)
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = x.float() @ w.T
            best = None
            for bn in (16, 32, 64, 128):
                for warps in (4, 8):
                    try:
                        y = gemv_tc(x, planes, s, bn, warps)
                        err = ((y.float() - ref).abs() / ref.abs().clamp_min(1)).max().item()
                        t = triton.testing.do_bench_cudagraph(lambda: gemv_tc(x, planes, s, bn, warps), rep=50) * 1e3
                    except Exception:  # a config the compiler refuses
                        continue
                    if best is None or t < best[0]:
                        best = (round(t, 2), bn, warps, err)
            cur = triton.testing.do_bench_cudagraph(lambda: bitplane_gemv(x, planes, s), rep=50) * 1e3
            out[f"{n}x{k} m{m}"] = {"tc_us_bn_warps_err": best, "library_us": round(cur, 2),
                                   "tc_gb_s": round(planes.numel() * 1.0 / (best[0] / 1e6) / 1e9, 1) if best else None}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
