"""One QSA layer's decode attention with its K/V in pinned host memory (patch qsa-offload), cold and
with the decode-07 row cache warm, against the same attention with K/V in VRAM, side by side.

Real shapes: 24 query heads, 2 KV heads of 256, top-2048 selection, 12,144-token blocks, one
2 KiB row per token. For each context length: a sequence of decode steps whose selections keep
``--overlap`` of the previous step's rows (the seed measured 0.72); times are CUDA-event medians per
step (plan + attention + merge). "cold" empties the cache before every step, so every row crosses
PCIe; its bandwidth is the selected rows' bytes over its time. Needs a CUDA GPU.

    python benchmarks/qsa_offload.py [--contexts 2048 32768 262144] [--rows 1 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from flashnext.quant.kernels import qsa_row_cache as rc
from flashnext.serving.hooks.host_pool import uva_view

Q_HEADS, KV_HEADS, HEAD_DIM, TOPK, BLOCK_SIZE = 24, 2, 256, 2048, 12144
ROW_BYTES = KV_HEADS * 2 * HEAD_DIM * 2


def selections(context: int, rows: int, steps: int, overlap: float, seed: int) -> list[torch.Tensor]:
    """``steps`` packed selections ``[rows, TOPK + 1]``, each keeping ``overlap`` of the previous."""
    g = torch.Generator().manual_seed(seed)
    count = min(TOPK, context)
    out, previous = [], None
    for _ in range(steps):
        indices = torch.full((rows, TOPK + 1), -1, dtype=torch.int32)
        for r in range(rows):
            fresh = torch.randperm(context, generator=g)[:2 * count]
            if previous is not None:
                kept = previous[r, torch.randperm(count, generator=g)[:int(overlap * count)]].long()
                fresh = torch.cat([kept, fresh[~torch.isin(fresh, kept)]])
            indices[r, :count] = fresh[:count].int()
            indices[r, -1] = count
        out.append(indices.cuda())
        previous = indices
    return out


def timed(fn, steps, graph: bool = True) -> float:
    """Median GPU time of ``fn`` per step, replayed from a CUDA graph so that Python's launch
    overhead is not measured; each step's selection is copied into the graph's input first."""
    if not graph:
        return eager_timed(fn, steps)
    static = steps[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(static)
    times = []
    for step in steps:
        static.copy_(step)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times[len(times) // 5:])  # the first steps fill the cache


def eager_timed(fn, steps) -> float:
    """The same, launched from Python each step, as the eager QSA forward runs it."""
    times = []
    for step in steps:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(step)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times[len(times) // 5:])


def run(context: int, rows: int, overlap: float, steps: int, config: rc.LaunchConfig) -> dict:
    blocks = -(-context // BLOCK_SIZE)
    g = torch.Generator().manual_seed(context)
    pinned = torch.randn(blocks, BLOCK_SIZE, KV_HEADS, 2 * HEAD_DIM, generator=g).to(torch.bfloat16).pin_memory()
    host = uva_view(pinned)
    vram = pinned.cuda()
    table = torch.arange(blocks, dtype=torch.int32, device="cuda").repeat(rows, 1)  # rows share the context
    token_to_req = torch.arange(rows, dtype=torch.int32, device="cuda")
    q = torch.randn(rows, Q_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    gate = torch.randn(rows, Q_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    warm_steps = selections(context, rows, steps, overlap, seed=1)
    cache = rc.RowCache(4, 4, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")

    def all_vram(indices):
        rc.host_attention(q, vram, indices, table, token_to_req, gate, config=config)

    def host_only(indices):
        rc.host_attention(q, host, indices, table, token_to_req, gate, config=config)

    def cold(indices):
        cache.invalidate_all()
        cache.attend(0, q, host, indices, table, token_to_req, gate, config=config)

    def warm(indices):
        cache.attend(0, q, host, indices, table, token_to_req, gate, config=config)

    for fn in (all_vram, host_only, cold, warm):  # compile every variant before timing
        fn(warm_steps[0])
    torch.cuda.synchronize()
    result = {"context": context, "rows": rows, "overlap": overlap, "config": config.__dict__}
    for name, fn in (("all_vram_us", all_vram), ("host_only_us", host_only), ("cold_us", cold),
                     ("all_vram_again_us", all_vram)):
        result[name] = round(timed(fn, warm_steps), 1)
    cache.invalidate_all()
    result["warm_us"] = round(timed(warm, warm_steps), 1)
    result["warm_eager_us"] = round(timed(warm, warm_steps, graph=False), 1)
    # the hit rate along the sequence: each step against what the steps before it left
    cache.invalidate_all()
    rates = []
    for indices in warm_steps:
        slots = rc.reference_slots(indices, table, token_to_req, blocks, BLOCK_SIZE).reshape(-1)
        valid = slots[slots >= 0]
        rates.append(float((cache.tags[0][valid % cache.sets] == valid).float().mean()))
        cache.attend(0, q, host, indices, table, token_to_req, gate, config=config)
    result["hit_rate"] = round(statistics.mean(rates[len(rates) // 5:]), 3)
    unique_rows = sum(int(torch.unique(warm_steps[-1][r, :TOPK][warm_steps[-1][r, :TOPK] >= 0]).numel())
                      for r in range(rows))
    result["cold_bytes"] = unique_rows * ROW_BYTES
    result["cold_gbps"] = round(result["cold_bytes"] / result["cold_us"] / 1e3, 1)
    result["warm_vs_vram"] = round(result["warm_us"] / result["all_vram_us"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 32768, 262144])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--overlap", type=float, default=0.72)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--splits", type=int, nargs="+", default=[64])
    parser.add_argument("--block", type=int, default=rc.BLOCK_N)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    for splits in args.splits:
        config = rc.LaunchConfig(block=args.block, splits=splits)
        for context in args.contexts:
            for rows in args.rows:
                results.append(run(context, rows, args.overlap, args.steps, config))
                if not args.json:
                    r = results[-1]
                    print(f"splits {splits:3d} ctx {context:7d} rows {rows}: vram {r['all_vram_us']:7.1f} us  "
                          f"host {r['host_only_us']:7.1f}  cold {r['cold_us']:7.1f} ({r['cold_gbps']} GB/s)  "
                          f"warm {r['warm_us']:7.1f} ({r['warm_vs_vram']}x vram, hit {r['hit_rate']})", flush=True)
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
