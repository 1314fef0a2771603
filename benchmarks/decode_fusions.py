"""decode-04 and decode-05's kernels against the unfused path and against stock vLLM's own path
(:mod:`benchmarks.stock_kernels`), side by side in one run, at the real shapes. CUDA-graph replays
(``triton.testing.do_bench_cudagraph``, median, us). ``patched_over_stock`` <= 1 is issue 28's
target: stock, not bf16, is what a user runs without the patch.

decode-04's ``stock``: Humming INT8 for both GEMMs with vLLM's own ``hc_silu`` and ``hc_gate_mix``
(the column holds the reason where those cannot be imported); decode-05's shared expert
(``shared_expert``): gate_up + SiLU-and-mul + down + gated combine, patched against Humming INT6
and the elementwise steps as vLLM's compiled graph runs them.

decode-04, the INT8 hyper-connection mix (hidden 2560, 4 streams, low rank 320, merged down/inject
rows padded to 336):

* ``fused``: :func:`flashnext.quant.kernels.hc_mix.hc_mix`, two launches;
* ``int8_gemms``: the unfused path's two GEMMs alone through ``int8_mma`` (what int8-modules runs
  with decode-04 off), a lower bound of that path, which also launches ``hc_silu`` and
  ``hc_gate_mix``;
* ``bf16_gemms``: the same two GEMMs in bf16 through cuBLAS (vLLM on a bf16 checkpoint), also
  without the elementwise kernels;
* ``int8_unfused_torch``: the whole unfused path with its elementwise steps in torch (more
  launches than vLLM's Triton ``hc_silu`` / ``hc_gate_mix``; an upper bound).

decode-05's router (512 experts + the shared expert's gate over hidden 2560, top 10):

* ``fused``: :func:`flashnext.quant.kernels.moe_route.route`, one launch; ``fused+align`` also
  writes Marlin's block alignment (block 8) in the same launch;
* ``gemms``: the router GEMV and the shared gate's GEMV in bf16 through cuBLAS alone, a lower bound
  of vLLM's path, which adds ``topk_softmax``;
* ``unfused_torch``: those GEMMs, then softmax, top-k and renormalization in torch.

Needs a CUDA GPU.

    python benchmarks/decode_fusions.py [--json] [--tokens 1 2 4 8 16]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from benchmarks.stock_kernels import elementwise_steps, hc_elementwise, stock_linear
from flashnext.quant.formats.packing import pack_int32
from flashnext.quant.kernels.bitplane_gemv import GEMV_MAX_TOKENS, bitplane_down_combine, bitplane_gate_up_silu
from flashnext.quant.kernels.decode_mma import bitplane_matmul, fused_gemvs_win, int8_mma
from flashnext.quant.kernels.hc_mix import hc_mix
from flashnext.quant.kernels.moe_route import route
from flashnext.quant.kernels.reference import reference_mix, reference_route

HIDDEN, HC, LOWRANK = 2560, 4, 320
ROWS = LOWRANK + HC + (-(LOWRANK + HC)) % 16


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1000


def weights(rows: int, cols: int, g: torch.Generator, with_codes: bool = False):
    codes = torch.randint(-127, 128, (rows, cols), generator=g, dtype=torch.int16).to(torch.int8)
    scales = (torch.rand(rows, cols // 64, generator=g) * 2e-3 + 1e-4).to(torch.bfloat16)
    dense = (codes.float().view(rows, -1, 64) * scales.float().unsqueeze(-1)).view(rows, cols).to(torch.bfloat16)
    packed = (pack_int32(codes, 8).cuda(), scales.cuda(), dense.cuda())
    return packed + (codes.cuda(),) if with_codes else packed


EXPERTS, TOP_K = 512, 10


def route_point(m: int) -> dict:
    g = torch.Generator().manual_seed(1000 + m)
    rows = (torch.randn(EXPERTS + 1, HIDDEN, generator=g) * 0.02).to(torch.bfloat16).cuda()
    router, gate = rows[:EXPERTS], rows[EXPERTS:]
    x = torch.randn(m, HIDDEN, generator=g).to(torch.bfloat16).cuda()

    def unfused():
        logits = torch.nn.functional.linear(x, router)
        shared = torch.nn.functional.linear(x, gate)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, TOP_K, dim=-1)
        return weights / weights.sum(-1, keepdim=True), ids, shared

    got = route(x, rows, TOP_K)
    want = reference_route(x.cpu(), rows.cpu(), TOP_K)
    return {
        "tokens": m,
        "fused": bench(lambda: route(x, rows, TOP_K)),
        "fused_with_alignment": bench(lambda: route(x, rows, TOP_K, align_block=8)) if m <= 4 else None,
        "gemms": bench(lambda: (torch.nn.functional.linear(x, router), torch.nn.functional.linear(x, gate))),
        "unfused_torch": bench(unfused),
        "same_experts": bool(torch.equal(got[2].cpu(), want[2])),
    }


def point(m: int) -> dict:
    g = torch.Generator().manual_seed(m)
    down_packed, down_scales, down_dense, down_codes = weights(ROWS, HC * HIDDEN, g, with_codes=True)
    up_packed, up_scales, up_dense, up_codes = weights(HC * HIDDEN, LOWRANK, g, with_codes=True)
    down, up = (down_packed, down_scales), (up_packed, up_scales)
    xn = torch.randn(m, HC * HIDDEN, generator=g).to(torch.bfloat16).cuda()

    def unfused_torch():
        y = int8_mma(xn, *down)
        low = y[:, :LOWRANK].float() / HC
        low = (low * torch.sigmoid(low)).to(torch.bfloat16)
        gate = int8_mma(low, *up).float()
        return (torch.sigmoid(gate).view(m, HC, HIDDEN) * xn.float().view(m, HC, HIDDEN)).mean(1).to(torch.bfloat16)

    low = torch.randn(m, LOWRANK, generator=g).to(torch.bfloat16).cuda()
    block, injection = hc_mix(xn, down, up, LOWRANK, HC)
    want_block, want_injection, _ = reference_mix(xn.cpu(), tuple(t.cpu() for t in down), tuple(t.cpu() for t in up),
                                                  LOWRANK, HC)
    weight_bytes = ROWS * HC * HIDDEN + HC * HIDDEN * LOWRANK + (down_scales.numel() + up_scales.numel()) * 2
    row = {
        "tokens": m,
        "fused": bench(lambda: hc_mix(xn, down, up, LOWRANK, HC)),
        "int8_gemms": bench(lambda: (int8_mma(xn, *down), int8_mma(low, *up))),
        "bf16_gemms": bench(lambda: (torch.nn.functional.linear(xn, down_dense),
                                     torch.nn.functional.linear(low, up_dense))),
        "int8_unfused_torch": bench(unfused_torch),
        # random data: against the torch reference, at most a bf16 rounding apart (the tests check
        # bit-exactness on exactly representable data)
        "block_input_max_rel_error": float(((block.cpu().float() - want_block.float()).abs()
                                            / want_block.float().abs().clamp_min(1e-2)).max()),
        "injection_bit_exact": bool(torch.equal(injection.cpu(), want_injection)),
    }
    row["fused_read_GBps"] = weight_bytes / row["fused"] / 1e3
    row.update(stock_hc_step(down_codes, down_scales, up_codes, up_scales, xn, row["fused"]))
    return row


def stock_hc_step(down_codes, down_scales, up_codes, up_scales, xn, fused_us: float) -> dict:
    """decode-04's stock path: the two INT8 GEMMs through stock vLLM's kernel (Humming) and
    vLLM's own ``hc_silu`` and ``hc_gate_mix`` between and after them."""
    down, missing = stock_linear(down_codes, down_scales, 8)
    up, _ = stock_linear(up_codes, up_scales, 8) if down is not None else (None, None)
    hc_silu, hc_gate_mix, hc_missing = hc_elementwise()
    if down is None:
        return {"stock": missing}
    out = {"stock_int8_gemms": bench(lambda: (down(xn), up(xn[:, :LOWRANK].contiguous())))}
    if hc_missing:
        out["stock"] = hc_missing
        return out

    def stock_step():
        low = hc_silu(down(xn)[:, :LOWRANK], HC)
        return hc_gate_mix(xn, up(low), HC)

    out["stock"] = bench(stock_step)
    out["patched_over_stock"] = round(fused_us / out["stock"], 3)
    return out


SHARED_INTERMEDIATE = 640  # the shared expert: gate_up 1280 x 2560, down 2560 x 640


def shared_expert_point(m: int) -> dict:
    """decode-05's shared expert as one step, ``routed + sigmoid(gate) * down(silu_and_mul(gate_up(x)))``:
    patched (int6-bitplane + decode-05: the fused GEMVs where ``fused_gemvs_win`` says so, else
    ``bitplane_matmul`` and the same elementwise steps; both are timed) against stock vLLM (Humming INT6 for both
    GEMMs, vLLM's SiLU-and-mul and combine as its compiled graph runs them)."""
    from benchmarks.int6_vs_bf16 import int6_weights

    up_codes, up_planes, up_scales, up_dense = int6_weights(2 * SHARED_INTERMEDIATE, HIDDEN, 7)
    down_codes, down_planes, down_scales, down_dense = int6_weights(HIDDEN, SHARED_INTERMEDIATE, 8)
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    routed = torch.randn(m, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    gate = torch.randn(m, 1, device="cuda", generator=g).to(torch.bfloat16)
    hidden = torch.randn(m, 2 * SHARED_INTERMEDIATE, device="cuda", generator=g).to(torch.bfloat16)
    silu_and_mul, combine, mode = elementwise_steps(hidden, routed, gate)

    def fused_gemvs():
        h = bitplane_gate_up_silu(x, up_planes, up_scales)
        return bitplane_down_combine(h, down_planes, down_scales, routed, gate)

    def matmuls():
        h = silu_and_mul(bitplane_matmul(x, up_planes, up_scales))
        return combine(bitplane_matmul(h, down_planes, down_scales), gate, routed)

    # what decode-05's hook runs (moe_decode.fused_shared_expert asks the same function)
    fused = m <= GEMV_MAX_TOKENS and fused_gemvs_win(m, (2 * SHARED_INTERMEDIATE, HIDDEN),
                                                     (HIDDEN, SHARED_INTERMEDIATE), x.device)
    patched = fused_gemvs if fused else matmuls

    def dense_step():
        h = silu_and_mul(torch.nn.functional.linear(x, up_dense))
        return combine(torch.nn.functional.linear(h, down_dense), gate, routed)

    want = dense_step().float()
    row = {"tokens": m, "elementwise": mode, "patched_runs": "fused_gemvs" if fused else "matmuls",
           "patched": bench(patched), "matmuls": bench(matmuls), "bf16": bench(dense_step),
           "patched_max_abs_error": float((patched().float() - want).abs().max())}
    if m <= GEMV_MAX_TOKENS:
        row["fused_gemvs"] = bench(fused_gemvs)
    stock_up, missing = stock_linear(up_codes, up_scales, 6)
    stock_down, _ = stock_linear(down_codes, down_scales, 6) if stock_up is not None else (None, None)
    if stock_up is None:
        row["stock"] = missing
        return row

    def stock_step():
        return combine(stock_down(silu_and_mul(stock_up(x))), gate, routed)

    row["stock"] = bench(stock_step)
    row["stock_gemms"] = bench(lambda: (stock_up(x), stock_down(hidden[:, :SHARED_INTERMEDIATE].contiguous())))
    row["stock_max_abs_error"] = float((stock_step().float() - want).abs().max())
    row["patched_over_stock"] = round(row["patched"] / row["stock"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--parts", nargs="+", choices=("hc", "route", "shared"), default=["hc", "route", "shared"],
                        help="which steps to time: decode-04's HC mix, decode-05's router, its shared expert")
    parser.add_argument("--sweep", action="store_true", help="time launch shapes instead")
    args = parser.parse_args()
    if args.sweep:
        return sweep()
    parts = set(args.parts)
    rows = [point(m) for m in args.tokens] if "hc" in parts else []
    routes = [route_point(m) for m in args.tokens] if "route" in parts else []
    shared = [shared_expert_point(m) for m in args.tokens] if "shared" in parts else []
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "hc_mix": rows, "route": routes,
                          "shared_expert": shared}, indent=1))
        return
    print(f"# {torch.cuda.get_device_name()}; hidden {HIDDEN}, {HC} streams, low rank {LOWRANK}; us")
    print("tokens  fused  int8_gemms  bf16_gemms  int8_unfused_torch  fused GB/s  block max rel err  injection exact")
    for r in rows:
        print(f"{r['tokens']:>6}  {r['fused']:5.1f}  {r['int8_gemms']:10.1f}  {r['bf16_gemms']:10.1f}  "
              f"{r['int8_unfused_torch']:18.1f}  {r['fused_read_GBps']:10.0f}  "
              f"{r['block_input_max_rel_error']:17.1e}  {r['injection_bit_exact']}")
    print(f"# router: {EXPERTS} experts + shared gate over {HIDDEN}, top {TOP_K}; us")
    print("tokens  fused  fused+align  gemms  unfused_torch  same experts as the reference")
    for r in routes:
        print(f"{r['tokens']:>6}  {r['fused']:5.1f}  {r['fused_with_alignment'] or float('nan'):11.1f}  {r['gemms']:5.1f}  "
              f"{r['unfused_torch']:13.1f}  {r['same_experts']}")


def sweep() -> None:
    """Launch shapes of the three kernels at one token, one per line (us)."""
    g = torch.Generator().manual_seed(0)
    down_packed, down_scales, _ = weights(ROWS, HC * HIDDEN, g)
    up_packed, up_scales, _ = weights(HC * HIDDEN, LOWRANK, g)
    rows = (torch.randn(EXPERTS + 1, HIDDEN, generator=g) * 0.02).to(torch.bfloat16).cuda()
    for m in (1, 4):
        xn = torch.randn(m, HC * HIDDEN, generator=g).to(torch.bfloat16).cuda()
        low = torch.randn(m, LOWRANK, generator=g).to(torch.bfloat16).cuda()
        x = torch.randn(m, HIDDEN, generator=g).to(torch.bfloat16).cuda()
        for block_n, split in ((64, None), (64, 8), (32, 8), (16, 8), (16, 16), (32, 16), (16, 32)):
            t = bench(lambda: int8_mma(xn, down_packed, down_scales, block_n=block_n, split_k=split))
            print(f"m={m} down int8_mma block_n={block_n} split={split}: {t:.1f}")
        for block_n, split in ((64, None), (64, 1), (32, 1), (16, 1)):
            t = bench(lambda: int8_mma(low, up_packed, up_scales, block_n=block_n, split_k=split))
            print(f"m={m} up int8_mma block_n={block_n} split={split}: {t:.1f}")
        from flashnext.quant.kernels.hc_mix import hc_up_gate_mix
        for block_j, warps in ((8, 4), (8, 2), (16, 4), (16, 8), (32, 4)):
            t = bench(lambda: hc_up_gate_mix(low, up_packed, up_scales, xn, HC, block_j=block_j, num_warps=warps))
            print(f"m={m} up_gate_mix block_j={block_j} warps={warps}: {t:.1f}")
        for split, block_k in ((None, 128), (1, 128), (4, 128), (8, 128), (16, 128)):
            t = bench(lambda: route(x, rows, TOP_K, split_k=split, block_k=block_k))
            print(f"m={m} route split={split} block_k={block_k}: {t:.1f}")
        t = bench(lambda: route(x, rows, 1))
        print(f"m={m} route top-1: {t:.1f}")


if __name__ == "__main__":
    main()
