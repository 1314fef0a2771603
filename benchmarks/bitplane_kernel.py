"""Bit-plane INT6 GEMV on the GPU against (a) dequantize + bf16 matmul, (b) a kernel reading the dense
6-bit layout directly, (c) a bf16 GEMV, at the shared expert's shapes and at a large shape.

    python -m benchmarks.bitplane_kernel            # on the GPU machine

Times are CUDA-graph replays (``triton.testing.do_bench_cudagraph``, median). Bandwidth counts the
weight and scale bytes read once, against the device's measured copy bandwidth (a 4 GiB device copy,
bytes read + written over time).
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from flashnext.quant.formats.bitplane import codes_to_bitplane
from flashnext.quant.kernels.bitplane_gemv import bitplane_down_combine, bitplane_gate_up_silu, bitplane_gemv
from flashnext.quant.kernels.configs import GemvConfig
from flashnext.quant.formats.packing import pack_int32


@triton.jit
def _dense6_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, W, stride_xm, stride_wn, stride_sn, stride_ym,
                        M: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Baseline (b): reads compressed-tensors' dense 6-bit words, values straddling words."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    for m in tl.static_range(M):
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            bit = k * 6
            word = bit >> 5
            off = bit & 31
            base = w_ptr + rows[:, None] * stride_wn
            w0 = tl.load(base + word[None, :], mask=n_mask[:, None], other=0).to(tl.uint32, bitcast=True)
            nxt = word + 1
            w1 = tl.load(base + nxt[None, :], mask=n_mask[:, None] & (nxt < W)[None, :], other=0).to(tl.uint32, bitcast=True)
            spill = tl.where(off[None, :] > 26, w1 << (32 - off[None, :]).to(tl.uint32), 0)
            u = ((w0 >> off[None, :].to(tl.uint32)) | spill) & 63
            q = u.to(tl.int32) - 32
            x = tl.load(x_ptr + m * stride_xm + k).to(tl.float32)
            prod = tl.reshape(q.to(tl.float32) * x[None, :], [BLOCK_N, GROUPS, GROUP])
            s = tl.load(s_ptr + rows[:, None] * stride_sn + (k0 // GROUP + tl.arange(0, GROUPS))[None, :],
                        mask=n_mask[:, None], other=0).to(tl.float32)
            acc += tl.sum(tl.sum(prod, axis=2) * s, axis=1)
        tl.store(y_ptr + m * stride_ym + rows, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


def dense6_gemv(x, words, scales, K):
    M, N = x.shape[0], words.shape[0]
    group = K // scales.shape[1]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _dense6_gemv_kernel[(triton.cdiv(N, 16),)](x, words, scales, y, N, K, words.shape[1], x.stride(0), words.stride(0),
                                               scales.stride(0), y.stride(0), M=M, GROUP=group, BLOCK_N=16,
                                               BLOCK_K=256 if K % 256 == 0 else 64)
    return y


def dequant_matmul(x, planes, scales, K):
    """Baseline (a): unpack the planes and scale to a bf16 matrix, then cuBLAS."""
    lo, hi = planes[:, : K // 2].to(torch.int16), planes[:, K // 2:].to(torch.int16)
    nib = torch.stack((lo & 15, lo >> 4), -1).view(planes.shape[0], K)
    crumb = torch.stack([(hi >> s) & 3 for s in (0, 2, 4, 6)], -1).view(planes.shape[0], K)
    w = (((crumb << 4) | nib) - 32).to(torch.bfloat16) * scales.repeat_interleave(K // scales.shape[1], 1)
    return torch.nn.functional.linear(x, w)


def copy_bandwidth() -> float:
    a = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=5, rep=50)
    return 2 * a.numel() / (ms / 1e3)


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3  # µs


def case(n, k, m, gs=64):
    q = torch.randint(-32, 32, (n, k), dtype=torch.int8, device="cuda")
    scales = (torch.randn(n, k // gs, device="cuda") * 0.02).to(torch.bfloat16)
    planes = codes_to_bitplane(q)
    words = pack_int32(q, 6)
    w32 = q.float() * scales.float().repeat_interleave(gs, 1)
    w_bf16 = w32.to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    ref = x.float() @ w32.T
    y = bitplane_gemv(x, planes, scales)
    err = ((y.float() - ref).abs() / ref.abs().clamp_min(1)).max().item()
    err_dense = ((dense6_gemv(x, words, scales, k).float() - ref).abs() / ref.abs().clamp_min(1)).max().item()
    weight_bytes = planes.numel() + scales.numel() * 2
    t = {"bitplane": bench(lambda: bitplane_gemv(x, planes, scales)),
         "dense6_kernel": bench(lambda: dense6_gemv(x, words, scales, k)),
         "dequant_matmul": bench(lambda: dequant_matmul(x, planes, scales, k)),
         "bf16_gemv": bench(lambda: torch.nn.functional.linear(x, w_bf16))}
    return {"n": n, "k": k, "m": m, "us": {a: round(b, 2) for a, b in t.items()},
            "bitplane_gb_s": round(weight_bytes / (t["bitplane"] / 1e6) / 1e9, 1),
            "speedup_vs_dequant": round(t["dequant_matmul"] / t["bitplane"], 2),
            "speedup_vs_dense6": round(t["dense6_kernel"] / t["bitplane"], 2),
            "max_rel_err_vs_fp32": err, "dense6_max_rel_err": err_dense}


def fused_checks() -> dict:
    I, H = 640, 2560
    q = torch.randint(-32, 32, (2 * I, H), dtype=torch.int8, device="cuda")
    s = (torch.randn(2 * I, H // 64, device="cuda") * 0.02).to(torch.bfloat16)
    w = q.float() * s.float().repeat_interleave(64, 1)
    x = torch.randn(2, H, device="cuda").to(torch.bfloat16)
    g, u = (x.float() @ w.T).split(I, dim=1)
    planes = codes_to_bitplane(q)
    got = bitplane_gate_up_silu(x, planes, s).float()
    ref = torch.nn.functional.silu(g) * u
    qd = torch.randint(-32, 32, (H, I), dtype=torch.int8, device="cuda")
    sd = (torch.randn(H, I // 64, device="cuda") * 0.02).to(torch.bfloat16)
    wd = qd.float() * sd.float().repeat_interleave(64, 1)
    xd = torch.randn(2, I, device="cuda").to(torch.bfloat16)
    routed, gate = torch.randn(2, H, device="cuda").to(torch.bfloat16), torch.randn(2, 1, device="cuda").to(torch.bfloat16)
    planes_d = codes_to_bitplane(qd)
    got_d = bitplane_down_combine(xd, planes_d, sd, routed, gate).float()
    ref_d = routed.float() + torch.sigmoid(gate.float()) * (xd.float() @ wd.T)
    return {"gate_up_silu_max_rel_err": ((got - ref).abs() / ref.abs().clamp_min(1)).max().item(),
            "down_combine_max_rel_err": ((got_d - ref_d).abs() / ref_d.abs().clamp_min(1)).max().item(),
            "gate_up_silu_us": round(bench(lambda: bitplane_gate_up_silu(x[:1], planes, s)), 2),
            "gate_up_gemv_then_silu_mul_us": round(bench(lambda: _unfused_gate_up(x[:1], planes, s, I)), 2),
            "down_combine_us": round(bench(lambda: bitplane_down_combine(xd[:1], planes_d, sd, routed[:1], gate[:1])), 2),
            "down_gemv_then_combine_us": round(bench(lambda: _unfused_down(xd[:1], planes_d, sd, routed[:1], gate[:1])), 2)}


def _unfused_gate_up(x, planes, s, I):
    g, u = bitplane_gemv(x, planes, s).split(I, dim=1)
    return torch.nn.functional.silu(g) * u


def _unfused_down(x, planes, s, routed, gate):
    return routed + torch.sigmoid(gate) * bitplane_gemv(x, planes, s)


def sweep() -> dict:
    """Pick launch parameters per size class by timing batch-1 GEMVs (weights ≥ 16 M: large)."""
    chosen = {}
    for size, (n, k) in (("small", (1280, 2560)), ("large", (16384, 16384))):
        q = torch.randint(-32, 32, (n, k), dtype=torch.int8, device="cuda")
        planes = codes_to_bitplane(q)
        scales = (torch.randn(n, k // 64, device="cuda") * 0.02).to(torch.bfloat16)
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        timings = []
        for bn in (4, 8, 16, 32):
            for bk in (512, 1024):
                for warps in (4, 8):
                    for stages in (3,):
                        cfg = {"block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages}
                        launch = GemvConfig(**cfg, wide=size == "large")
                        try:
                            timings.append((bench(lambda: bitplane_gemv(x, planes, scales, launch=launch)), cfg))
                        except Exception as e:  # a config the compiler refuses (resources)
                            timings.append((float("inf"), {**cfg, "error": type(e).__name__}))
        timings.sort(key=lambda t: t[0])
        chosen[size] = {"best_us": round(timings[0][0], 2), "config": timings[0][1],
                        "worst_us": round(max(t for t, _ in timings if t != float("inf")), 2),
                        "top3": [(round(t, 2), c) for t, c in timings[:3]]}
    return chosen


def main() -> None:
    import sys

    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    results = {"device": torch.cuda.get_device_name(), "copy_gb_s": round(copy_bw / 1e9, 1), "cases": []}
    if "--sweep" in sys.argv:
        results["sweep"] = sweep()
    if "--fused-only" in sys.argv:
        print(json.dumps(fused_checks(), indent=2))
        return
    for n, k in ((1280, 2560), (2560, 640)):
        for m in (1, 2, 4):
            results["cases"].append(case(n, k, m))
    for n, k in ((16384, 16384),):
        for m in (1, 4):
            c = case(n, k, m)
            c["fraction_of_copy_bw"] = round(c["bitplane_gb_s"] * 1e9 / copy_bw, 3)
            results["cases"].append(c)
    results["fused"] = fused_checks()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
