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

from flashnext.quant.kernels import configs, reference
from flashnext.quant.kernels import qsa_row_cache as rc
from flashnext.quant.kernels.configs import AttentionConfig
from flashnext.serving.runtime.host_pool import uva_view

Q_HEADS, KV_HEADS, HEAD_DIM, TOPK, BLOCK_SIZE = 24, 2, 256, 2048, 12144
ROW_BYTES = KV_HEADS * 2 * HEAD_DIM * 2


def selections(context: int, rows: int, steps: int, overlap: float, history: float, seed: int) -> list[torch.Tensor]:
    """``steps`` packed selections ``[rows, TOPK + 1]``: each keeps ``overlap`` of the previous
    step's rows and, up to ``history``, rows of the three steps before it (the seed measured 0.72
    and 0.86 against the union of the last four); the rest are new."""
    g = torch.Generator().manual_seed(seed)
    count = min(TOPK, context)
    out: list[torch.Tensor] = []
    for step in range(steps):
        indices = torch.full((rows, TOPK + 1), -1, dtype=torch.int32)
        for r in range(rows):
            parts = []
            if out:
                previous = out[-1][r, :count].cpu().long()
                parts.append(previous[torch.randperm(count, generator=g)[:int(overlap * count)]])
                older = torch.cat([o[r, :count].cpu().long() for o in out[-4:-1]]) if len(out) > 1 else None
                if older is not None and history > overlap:
                    older = older[~torch.isin(older, previous)].unique()
                    parts.append(older[torch.randperm(older.numel(), generator=g)[:int((history - overlap) * count)]])
            parts.append(torch.randperm(context, generator=g)[:2 * count])
            chosen = torch.cat(parts)
            first = torch.ones_like(chosen, dtype=torch.bool)  # keep the first occurrence of each row
            seen: set[int] = set()
            for i, v in enumerate(chosen.tolist()):
                first[i] = v not in seen
                seen.add(v)
            indices[r, :count] = chosen[first][:count].int()
            indices[r, -1] = count
        out.append(indices.cuda())
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


def run(context: int, rows: int, overlap: float, history: float, steps: int, config: AttentionConfig) -> dict:
    blocks = -(-context // BLOCK_SIZE)
    g = torch.Generator().manual_seed(context)
    pinned = torch.randn(blocks, BLOCK_SIZE, KV_HEADS, 2 * HEAD_DIM, generator=g).to(torch.bfloat16).pin_memory()
    host = uva_view(pinned)
    vram = pinned.cuda()
    table = torch.arange(blocks, dtype=torch.int32, device="cuda").repeat(rows, 1)  # rows share the context
    token_to_req = torch.arange(rows, dtype=torch.int32, device="cuda")
    q = torch.randn(rows, Q_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    gate = torch.randn(rows, Q_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    warm_steps = selections(context, rows, steps, overlap, history, seed=1)
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
    result = {"context": context, "rows": rows, "overlap": overlap, "history": history, "config": config.__dict__}
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
        slots = reference.reference_slots(indices, table, token_to_req, blocks, BLOCK_SIZE).reshape(-1)
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


def staged_prefill(context: int, rows: int) -> dict:
    """One prefill chunk of ``rows`` query tokens at the end of ``context``: the context's blocks
    staged through a 4-block arena, against the same attention over K/V in VRAM (eager, as prefill runs)."""
    blocks = -(-context // BLOCK_SIZE)
    pinned = torch.randn(blocks, BLOCK_SIZE, KV_HEADS, 2 * HEAD_DIM).to(torch.bfloat16).pin_memory()
    host, vram = uva_view(pinned), pinned.cuda()
    table = torch.arange(blocks, dtype=torch.int32, device="cuda")[None, :]
    token_to_req = torch.zeros(rows, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([context], device="cuda")
    q = torch.randn(rows, Q_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    gate = torch.randn(rows, Q_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    indices = torch.stack([torch.cat([torch.randperm(context)[:TOPK], torch.tensor([TOPK])]) for _ in range(rows)])
    indices = indices.int().cuda()
    cache = rc.RowCache(4, 4, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    config = AttentionConfig(splits=1)
    staged = lambda _: cache.staged(q, host, indices, table, token_to_req, seq_lens, gate, config=config)
    direct = lambda _: rc.host_attention(q, vram, indices, table, token_to_req, gate, config=config)
    for fn in (staged, direct):
        fn(None)
    staged_us = eager_timed(staged, [None] * 5)
    return {"context": context, "rows": rows, "staged_ms": round(staged_us / 1e3, 2),
            "staged_gbps": round(blocks * BLOCK_SIZE * ROW_BYTES / staged_us / 1e3, 1),
            "all_vram_ms": round(eager_timed(direct, [None] * 5) / 1e3, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 32768, 262144])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--overlap", type=float, default=0.72)
    parser.add_argument("--history", type=float, default=0.86)
    parser.add_argument("--prefill", action="store_true", help="also time one staged-prefill chunk")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--splits", type=int, nargs="+", default=[64])
    parser.add_argument("--block", type=int, default=configs.default_config("qsa_attention").block)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    for splits in args.splits:
        config = AttentionConfig(block=args.block, splits=splits)
        for context in args.contexts:
            for rows in args.rows:
                results.append(run(context, rows, args.overlap, args.history, args.steps, config))
                if not args.json:
                    r = results[-1]
                    print(f"splits {splits:3d} ctx {context:7d} rows {rows}: vram {r['all_vram_us']:7.1f} us  "
                          f"host {r['host_only_us']:7.1f}  cold {r['cold_us']:7.1f} ({r['cold_gbps']} GB/s)  "
                          f"warm {r['warm_us']:7.1f} ({r['warm_vs_vram']}x vram, hit {r['hit_rate']})", flush=True)
    prefill = [staged_prefill(context, 512) for context in args.contexts if context > 2048] if args.prefill else []
    for p in prefill if not args.json else []:
        print(f"staged prefill ctx {p['context']:7d}, {p['rows']} rows: {p['staged_ms']} ms "
              f"({p['staged_gbps']} GB/s of staged blocks); all-VRAM {p['all_vram_ms']} ms")
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "results": results, "prefill": prefill}, indent=1))


if __name__ == "__main__":
    main()
