"""The INT6 bit-plane kernels against the kernel stock vLLM 0.33.0 runs for the same INT6 g64 layer
(Humming, :mod:`benchmarks.stock_kernels`), a bf16 GEMM (cuBLAS) and PyTorch's int4 g128 GEMV
(tinygemm), side by side in one run, at 1, 2, 4, 8 and 16 tokens and at 512 (prefill: the tiled
prefill GEMM, and the dequantize-then-GEMM path it replaced), at the
served shapes and at 8192² and 16384²; ``--int8`` does the same for the INT8 modules (LM head and
tied embedding, the HC GEMMs) against bf16 and Humming INT8 (Marlin, stock's other INT8 kernel,
needs vLLM's CUDA build: the output says so).

The baseline is stock vLLM's kernel, not bf16: that is what a user runs without flashnext's
patches, so ``patched_over_stock`` (<= 1 is the issue-28 target) is the number that decides whether
a patch stays. Where Humming cannot run, its column holds the reason.

Times are CUDA-graph replays (``triton.testing.do_bench_cudagraph``, median, us). "read GB/s" is
each kernel's own weight and scale bytes over its time. Prints one JSON document (rows also go to
stderr as they finish). Needs a CUDA GPU.

    python -m benchmarks.int6_vs_bf16 [--shapes 1280x2560 ...] [--tokens 1 2 4 8 16 512]
    python -m benchmarks.int6_vs_bf16 --int8 [--shapes 248320x2560x128 ...]
    python -m benchmarks.int6_vs_bf16 --sweep --shapes 2560x640 --tokens 4 8
    python -m benchmarks.int6_vs_bf16 --prefill-sweep --shapes 1280x2560 --tokens 512
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import torch
import triton

from benchmarks.stock_kernels import MARLIN_MISSING, stock_linear
from flashnext.quant.formats.bitplane import bitplane_to_codes, codes_to_bitplane
from flashnext.quant.formats.packing import dequantize_groups, pack_int32
from flashnext.quant.kernels import configs
from flashnext.quant.kernels._common import sm_count
from flashnext.quant.kernels.bitplane_gemv import GEMV_MAX_TOKENS, bitplane_gemv
from flashnext.quant.kernels.decode_mma import (MMA_MAX_TOKENS, bitplane_matmul, bitplane_mma, int8_matmul, int8_mma,
                                                int8_weights, matmul_variant)
from flashnext.quant.kernels.prefill_gemm import bitplane_gemm, int8_gemm

# The served INT6 matrices (N x K) of Qwen3.8-Flash-Next at hidden 2560 (manifests/qwen3.8-flash-next.json):
# the shared expert's gate_up and down; the linear attention's in_proj_qkv (16 + 16 key heads and 48
# value heads of 128), in_proj_z and out_proj; QSA's qkv (24 query heads of 256 with their gate, 2 KV
# heads); QSA's o_proj is out_proj's shape.
SERVED = [(1280, 2560), (2560, 640), (10240, 2560), (6144, 2560), (2560, 6144), (13312, 2560)]
LARGE = [(8192, 8192), (16384, 16384)]
# The INT8 modules (int8-modules): LM head / tied embedding (vocab 248320, g128), the HC merged
# down/inject (336 x 10240) and up (10240 x 320) GEMMs (g64).
INT8_SHAPES = [(248320, 2560, 128), (336, 10240, 64), (10240, 320, 64)]
DECODE_TOKENS = [1, 2, 4, 8, 16]
PREFILL_TOKENS = 512


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


def _error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return round(float(((y.float() - ref).abs() / ref.abs().clamp_min(1.0)).max()), 5)


def _stock_columns(out: dict, stock, missing: str | None, x: torch.Tensor, ref: torch.Tensor, patched: float) -> None:
    """The stock-vLLM column (Humming), or the reason it is absent, and patched / stock."""
    if stock is None:
        out["stock_humming"] = missing
        return
    out["stock_humming_max_rel_error"] = _error(stock(x), ref)
    out["stock_humming_us"] = round(bench(lambda: stock(x)), 2)
    out["patched_over_stock"] = round(patched / out["stock_humming_us"], 3)


def int6_weights(n: int, k: int, seed: int):
    """Random symmetric INT6 g64 codes (-31..31, what a symmetric quantizer writes), their planes,
    scales and dense bf16 weights."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(-31, 32, (n, k), dtype=torch.int8, device="cuda", generator=g)
    scales = (torch.rand(n, k // 64, device="cuda", generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    weight = (codes.float() * scales.float().repeat_interleave(64, 1)).to(torch.bfloat16)
    return codes, codes_to_bitplane(codes), scales, weight


def shape_points(n: int, k: int, tokens) -> list[dict]:
    """bf16, flashnext's INT6 kernels and stock vLLM's (Humming) at one shape, every token count;
    above 16 tokens (prefill) flashnext's path is the int6-bitplane module's: dequantize, bf16 GEMM."""
    codes, planes, scales, weight = int6_weights(n, k, n + k)
    stock, missing = stock_linear(codes, scales, 6)
    g = torch.Generator(device="cuda").manual_seed(k)
    rows = []
    for m in tokens:
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        ref = x.float() @ weight.float().T
        out = {"n": n, "k": k, "tokens": m,
               "bf16_us": round(bench(lambda: torch.nn.functional.linear(x, weight)), 2)}
        if m > MMA_MAX_TOKENS:
            def dequantize_then_gemm():  # what the int6-bitplane module ran before the prefill GEMM
                dense = dequantize_groups(bitplane_to_codes(planes, k), scales, x.dtype)
                return torch.nn.functional.linear(x, dense)
            out["max_rel_error"] = _error(bitplane_matmul(x, planes, scales), ref)
            out["int6_dequantize_gemm_us"] = round(bench(dequantize_then_gemm), 2)
            out["int6_prefill_gemm_us"] = patched = round(bench(lambda: bitplane_matmul(x, planes, scales)), 2)
        else:
            out["max_rel_error"] = _error(bitplane_matmul(x, planes, scales), ref)
            out["int6_mma_us"] = round(bench(lambda: bitplane_mma(x, planes, scales)), 2)
            if m <= GEMV_MAX_TOKENS:
                out["int6_gemv_us"] = round(bench(lambda: bitplane_gemv(x, planes, scales)), 2)
            out["int6_matmul_us"] = patched = round(bench(lambda: bitplane_matmul(x, planes, scales)), 2)
            out["int6_matmul_picks"] = matmul_variant(m, n, k, x.device)
            out["int6_best_us"] = min(out["int6_mma_us"], out.get("int6_gemv_us", float("inf")))
            int6_bytes = planes.numel() + scales.numel() * 2
            out["int6_read_gbps"] = round(int6_bytes / out["int6_best_us"] / 1e3, 1)
            if m <= 8:
                fn, _ = tinygemm(n, k, x)
                if fn is not None:
                    out["int4_tinygemm_us"] = round(bench(fn), 2)
        out["bf16_read_gbps"] = round(weight.numel() * 2 / out["bf16_us"] / 1e3, 1)
        _stock_columns(out, stock, missing, x, ref, patched)
        rows.append(out)
        print(json.dumps(out), file=sys.stderr, flush=True)
    return rows


def int8_points(n: int, k: int, group: int, tokens) -> list[dict]:
    """The INT8 kernel (int8-modules: the LM head, the embedding's tied weight, the HC GEMMs)
    against bf16 and stock vLLM's kernel at one shape; above 16 tokens through ``int8_matmul``, the
    module's prefill path."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=g)
    scales = (torch.rand(n, k // group, device="cuda", generator=g) * 0.01 + 1e-4).to(torch.bfloat16)
    packed = pack_int32(codes, 8)
    weight = (codes.float() * scales.float().repeat_interleave(group, 1)).to(torch.bfloat16)
    stock, missing = stock_linear(codes, scales, 8)
    rows = []
    for m in tokens:
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        ref = x.float() @ weight.float().T
        kernel = int8_mma if m <= MMA_MAX_TOKENS else int8_matmul
        out = {"n": n, "k": k, "group": group, "tokens": m, "max_rel_error": _error(kernel(x, packed, scales), ref),
               "bf16_us": round(bench(lambda: torch.nn.functional.linear(x, weight)), 2),
               "int8_us": round(bench(lambda: kernel(x, packed, scales)), 2), "marlin": MARLIN_MISSING}
        if m > MMA_MAX_TOKENS:  # what int8_matmul ran before the prefill GEMM
            old = (lambda: torch.cat([int8_mma(c, packed, scales) for c in x.split(MMA_MAX_TOKENS)])
                   if n * k > 1 << 26 else torch.nn.functional.linear(x, int8_weights(packed, scales, x.dtype)))
            out["int8_before_us"] = round(bench(old), 2)
        out["int8_read_gbps"] = round((packed.numel() * 4 + scales.numel() * 2) / out["int8_us"] / 1e3, 1)
        _stock_columns(out, stock, missing, x, ref, out["int8_us"])
        rows.append(out)
        print(json.dumps(out), file=sys.stderr, flush=True)
    return rows


def best_five(row: dict, launches) -> dict:
    """``row`` with ``best``: the five fastest of ``launches`` (``(label, fn)``: ``(us, *label)``),
    a launch the compiler refuses (resources) timed as infinite; printed to stderr as it finishes."""
    timed = []
    for label, fn in launches:
        try:
            t = bench(fn)
        except Exception:  # noqa: BLE001 - a refused launch is a result of the sweep
            t = float("inf")
        timed.append((round(t, 2), *label))
    row["best"] = sorted(timed)[:5]
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


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
                   "bf16_us": round(bench(lambda: torch.nn.functional.linear(x, weight)), 2)}
            default = configs.config_for("bitplane_mma", n, k, x.device)
            split = default.splits(triton.cdiv(n, default.block_n), k // default.step(k, 64), sm_count(x.device))
            launches = []
            for bn, warps, stages, split_scale in itertools.product((32, 64, 128), (4, 8), (3, 4, 5, 8), (1, 2)):
                s = max(1, min(k // 64, split * split_scale * 64 // bn))
                launches.append(((bn, warps, stages, s), functools.partial(
                    bitplane_mma, x, planes, scales, block_n=bn, split_k=s, num_warps=warps, num_stages=stages)))
            out.append(best_five(row, launches))
    return out


def prefill_sweep(shapes, tokens) -> list[dict]:
    """The prefill GEMM's launch parameters (``configs.GemmConfig``) at each INT6 shape and token
    count, against bf16 and Humming; the five fastest per point."""
    out = []
    for n, k in shapes:
        codes, planes, scales, weight = int6_weights(n, k, n + k)
        stock, missing = stock_linear(codes, scales, 6)
        for m in tokens:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            row = {"n": n, "k": k, "tokens": m,
                   "bf16_us": round(bench(lambda: torch.nn.functional.linear(x, weight)), 2),
                   "stock_humming_us": round(bench(lambda: stock(x)), 2) if stock else missing}
            launches = []
            for bm, bn, step, warps, stages in itertools.product((32, 64, 128, 256), (64, 128), (64, 128), (4, 8), (3,)):
                tile = configs.GemmConfig(block_m=bm, block_n=bn, steps=(step,), num_warps=warps, num_stages=stages)
                launches.append(((bm, bn, step, warps, stages),
                                 functools.partial(bitplane_gemm, x, planes, scales, config=tile)))
            out.append(best_five(row, launches))
    return out


def int8_prefill_sweep(shapes, tokens) -> list[dict]:
    """The INT8 prefill GEMM's tiles (``configs.GemmConfig``; one group a step) at each INT8 shape,
    against bf16, Humming and the dequantize-then-GEMM path; the five fastest per point."""
    out = []
    for n, k, group in shapes:
        codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
        scales = (torch.rand(n, k // group, device="cuda") * 0.01 + 1e-4).to(torch.bfloat16)
        packed = pack_int32(codes, 8)
        weight = (codes.float() * scales.float().repeat_interleave(group, 1)).to(torch.bfloat16)
        stock, missing = stock_linear(codes, scales, 8)
        for m in tokens:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            row = {"n": n, "k": k, "group": group, "tokens": m,
                   "bf16_us": round(bench(lambda: torch.nn.functional.linear(x, weight)), 2),
                   "dequantize_gemm_us": round(bench(lambda: torch.nn.functional.linear(
                       x, int8_weights(packed, scales, x.dtype))), 2),
                   "stock_humming_us": round(bench(lambda: stock(x)), 2) if stock else missing}
            launches = []
            for bm, bn, warps in itertools.product((32, 64, 128), (32, 64, 128), (4,)):
                tile = configs.GemmConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=3)
                launches.append(((bm, bn, warps), functools.partial(int8_gemm, x, packed, scales, config=tile)))
            out.append(best_five(row, launches))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=None, help="NxK, default: served shapes, 8192², 16384²")
    parser.add_argument("--tokens", type=int, nargs="+", default=DECODE_TOKENS + [PREFILL_TOKENS])
    parser.add_argument("--sweep", action="store_true", help="time the tensor-core kernel's launch parameters")
    parser.add_argument("--prefill-sweep", action="store_true", help="time the prefill GEMM's launch parameters")
    parser.add_argument("--int8", action="store_true", help="the INT8 modules' shapes instead (NxKxGROUP)")
    args = parser.parse_args()
    if args.int8:
        shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else INT8_SHAPES)
        if args.prefill_sweep:
            rows = int8_prefill_sweep(shapes, args.tokens)
            print(json.dumps({"device": torch.cuda.get_device_name(), "int8_prefill_sweep": rows}, indent=1))
            return
        rows = [r for n, k, group in shapes for r in int8_points(n, k, group, args.tokens)]
        print(json.dumps({"device": torch.cuda.get_device_name(), "int8": rows}, indent=1))
        return
    shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SERVED + LARGE)
    if args.sweep:
        print(json.dumps({"device": torch.cuda.get_device_name(), "sweep": sweep(shapes, args.tokens)}, indent=1))
        return
    if args.prefill_sweep:
        rows = prefill_sweep(shapes, args.tokens)
        print(json.dumps({"device": torch.cuda.get_device_name(), "prefill_sweep": rows}, indent=1))
        return
    rows = [r for n, k in shapes for r in shape_points(n, k, args.tokens)]
    print(json.dumps({"device": torch.cuda.get_device_name(), "int6": rows}, indent=1))


if __name__ == "__main__":
    main()
