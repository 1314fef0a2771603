"""The INT6 bit-plane kernels against a bf16 GEMV (cuBLAS) and PyTorch's int4 g128 GEMV (tinygemm),
side by side in one run, at 1, 2, 4 and 8 tokens, at the served shapes and at 8192² and 16384².

Times are CUDA-graph replays (``triton.testing.do_bench_cudagraph``, median, us). "read GB/s" is
each kernel's own weight and scale bytes over its time; the issue's bandwidth target compares the
INT6 kernel's against the bf16 GEMV's. Needs a CUDA GPU.

    python benchmarks/int6_vs_bf16.py [--json] [--shapes 1280x2560 ...] [--tokens 1 2 4 8]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from flashnext.quant.formats.bitplane import codes_to_bitplane
from flashnext.quant.kernels import configs
from flashnext.quant.kernels._common import sm_count
from flashnext.quant.kernels.bitplane_gemv import GEMV_MAX_TOKENS, bitplane_gemv
from flashnext.quant.kernels.decode_mma import bitplane_mma

# The served INT6 matrices (N x K) of Qwen3.8-Flash-Next at hidden 2560 (manifests/qwen3.8-flash-next.json):
# the shared expert's gate_up and down; the linear attention's in_proj_qkv (16 + 16 key heads and 48
# value heads of 128), in_proj_z and out_proj; QSA's qkv (24 query heads of 256 with their gate, 2 KV
# heads); QSA's o_proj is out_proj's shape.
SERVED = [(1280, 2560), (2560, 640), (10240, 2560), (6144, 2560), (2560, 6144), (13312, 2560)]
LARGE = [(8192, 8192), (16384, 16384)]


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1000


def tinygemm(n: int, k: int, x: torch.Tensor):
    """PyTorch's int4 g128 GEMV on random weights, or None where this torch has no such op."""
    try:
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
        packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
        scales = torch.rand(k // 128, n, 2, device="cuda").to(torch.bfloat16)
        fn = lambda: torch._weight_int4pack_mm(x, packed, 128, scales)
        fn()
        return fn, n * k // 2 + scales.numel() * 2
    except (RuntimeError, AttributeError, TypeError):
        return None, 0


def point(n: int, k: int, m: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(n + m)
    codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, device="cuda", generator=g)
    planes = codes_to_bitplane(codes)
    scales = (torch.randn(n, k // 64, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    weight = (codes.float() * scales.float().repeat_interleave(64, 1)).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    int6_bytes = planes.numel() + scales.numel() * 2
    bf16_bytes = weight.numel() * 2
    ref = x.float() @ weight.float().T
    y = bitplane_mma(x, planes, scales)
    error = float(((y.float() - ref).abs() / ref.abs().clamp_min(1.0)).max())
    out = {"n": n, "k": k, "tokens": m, "max_rel_error": round(error, 5),
           "bf16_us": round(bench(lambda: torch.nn.functional.linear(x, weight)), 2),
           "int6_mma_us": round(bench(lambda: bitplane_mma(x, planes, scales)), 2)}
    if m <= GEMV_MAX_TOKENS:
        out["int6_gemv_us"] = round(bench(lambda: bitplane_gemv(x, planes, scales)), 2)
    fn, int4_bytes = tinygemm(n, k, x)
    if fn is not None:
        out["int4_tinygemm_us"] = round(bench(fn), 2)
    best = min(v for key, v in out.items() if key in ("int6_mma_us", "int6_gemv_us"))
    out["int6_best_us"] = best
    out["bf16_read_gbps"] = round(bf16_bytes / out["bf16_us"] / 1e3, 1)
    out["int6_read_gbps"] = round(int6_bytes / best / 1e3, 1)
    out["int6_vs_bf16_bandwidth"] = round(out["int6_read_gbps"] / out["bf16_read_gbps"], 3)
    out["speedup_vs_bf16"] = round(out["bf16_us"] / best, 2)
    return out


def int8_point(n: int, k: int, m: int) -> dict:
    """The INT8 kernel (patch int8-modules' LM head) against bf16 at one shape."""
    from flashnext.quant.formats.packing import pack_int32
    from flashnext.quant.kernels.decode_mma import int8_mma

    g = torch.Generator(device="cuda").manual_seed(n + m)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, device="cuda", generator=g)
    scales = (torch.rand(n, k // 128, device="cuda", generator=g) * 0.01).to(torch.bfloat16)
    packed = pack_int32(codes, 8)
    weight = (codes.float() * scales.float().repeat_interleave(128, 1)).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    ref = x.float() @ weight.float().T
    error = float(((int8_mma(x, packed, scales).float() - ref).abs() / ref.abs().clamp_min(1.0)).max())
    out = {"n": n, "k": k, "tokens": m, "max_rel_error": round(error, 5),
           "bf16_us": round(bench(lambda: torch.nn.functional.linear(x, weight)), 2),
           "int8_us": round(bench(lambda: int8_mma(x, packed, scales)), 2)}
    out["int8_read_gbps"] = round((packed.numel() * 4 + scales.numel() * 2) / out["int8_us"] / 1e3, 1)
    out["bf16_read_gbps"] = round(weight.numel() * 2 / out["bf16_us"] / 1e3, 1)
    out["speedup_vs_bf16"] = round(out["bf16_us"] / out["int8_us"], 2)
    return out


def sweep(shapes, tokens) -> list[dict]:
    """The tensor-core kernel's launch parameters, timed against bf16 at each shape."""
    out = []
    for n, k in shapes:
        codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, device="cuda")
        planes = codes_to_bitplane(codes)
        scales = (torch.randn(n, k // 64, device="cuda") * 0.02).to(torch.bfloat16)
        weight = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        for m in tokens:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            row = {"n": n, "k": k, "tokens": m,
                   "bf16_us": round(bench(lambda: torch.nn.functional.linear(x, weight)), 2), "configs": []}
            for bn, warps, stages, split_scale in itertools.product((32, 64, 128), (4, 8), (3, 4, 5, 8), (1, 2)):
                default = configs.config_for("bitplane_mma", n, k, x.device)
                blocks = triton.cdiv(n, default.block_n)
                split = default.splits(blocks, k // default.step(k, 64), sm_count(x.device))
                split = max(1, min(k // 64, split * split_scale * 64 // bn))
                try:
                    t = bench(lambda: bitplane_mma(x, planes, scales, block_n=bn, split_k=split, num_warps=warps,
                                                   num_stages=stages))
                except Exception:  # a config the compiler refuses (resources)
                    t = float("inf")
                row["configs"].append((round(t, 2), bn, warps, stages, split))
            row["configs"].sort()
            row["best"] = row["configs"][:5]
            del row["configs"]
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=None, help="NxK, default: served shapes, 8192², 16384²")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="time the tensor-core kernel's launch parameters")
    parser.add_argument("--int8", action="store_true", help="the INT8 kernel instead, default shape: the LM head")
    args = parser.parse_args()
    shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SERVED + LARGE)
    if args.sweep:
        sweep(shapes, args.tokens)
        return
    if args.int8:
        for n, k in ([tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else [(248320, 2560)]):
            for m in args.tokens:
                print(json.dumps(int8_point(n, k, m)), flush=True)
        return
    results = []
    for n, k in shapes:
        for m in args.tokens:
            r = point(n, k, m)
            results.append(r)
            if not args.json:
                print(f"{n:6d}x{k:<6d} m={m}: bf16 {r['bf16_us']:8.2f}  int6 mma {r['int6_mma_us']:8.2f}  "
                      f"gemv {r.get('int6_gemv_us', '-')!s:>8}  int4 {r.get('int4_tinygemm_us', '-')!s:>8}  "
                      f"x{r['speedup_vs_bf16']}  bw {r['int6_vs_bf16_bandwidth']}  err {r['max_rel_error']}",
                      flush=True)
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
