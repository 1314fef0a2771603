"""The QSA offload's staged prefill: this tree's kernel against an earlier revision's, in one run.

One 512-token prefill chunk at the end of a 32k and a 262k context, the context's blocks staged
from pinned host memory (read through UVA) via a 4-block arena, as ``benchmarks/qsa_offload.py
--prefill`` times it; for each kernel the median eager time and the device memory the call takes
beyond what was allocated before it (PyTorch's peak), and the largest difference between their
outputs. The earlier kernel is read from git (``--rev``, default 1fd3927: the per-call fp32
partials that issue 40 item 1 removed), so run it in a checkout on a CUDA machine:

    python -m benchmarks.staged_prefill_ab [--rev REV | --earlier FILE] [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import qsa_offload as bench
from flashnext.quant.kernels import qsa_row_cache

KERNEL = "quant/kernels/qsa_row_cache.py"


def kernel_at(rev: str, scratch: Path, earlier: Path | None = None):
    """The row-cache module as it was at ``rev`` (or as the file ``earlier`` holds it, where the
    checkout has no git history, e.g. a copy on a GPU machine)."""
    path = earlier or scratch / "qsa_row_cache_at_rev.py"
    if earlier is None:
        path.write_bytes(subprocess.run(["git", "show", f"{rev}:{KERNEL}"], check=True, capture_output=True).stdout)
    spec = importlib.util.spec_from_file_location("qsa_row_cache_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are made
    spec.loader.exec_module(module)
    return module


def compare(kernels: dict, context: int, rows: int = 512) -> dict:
    blocks = -(-context // bench.BLOCK_SIZE)
    pinned = torch.randn(blocks, bench.BLOCK_SIZE, bench.KV_HEADS, 2 * bench.HEAD_DIM).to(torch.bfloat16).pin_memory()
    host = bench.uva_view(pinned)
    table = torch.arange(blocks, dtype=torch.int32, device="cuda")[None, :]
    token_to_req = torch.zeros(rows, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([context], device="cuda")
    q = torch.randn(rows, bench.Q_HEADS, bench.HEAD_DIM, device="cuda").to(torch.bfloat16)
    gate = torch.randn(rows, bench.Q_HEADS, bench.HEAD_DIM, device="cuda").to(torch.bfloat16)
    indices = torch.stack([torch.cat([torch.randperm(context)[:bench.TOPK], torch.tensor([bench.TOPK])])
                           for _ in range(rows)]).int().cuda()
    config = bench.AttentionConfig(splits=1)
    result, outputs = {"context": context, "rows": rows}, {}
    for name, module in kernels.items():
        cache = module.RowCache(4, 4, bench.BLOCK_SIZE, bench.KV_HEADS, bench.HEAD_DIM, torch.bfloat16, "cuda")

        def staged(_):
            return cache.staged(q, host, indices, table, token_to_req, seq_lens, gate, config=config)

        outputs[name] = staged(None)
        staged(None)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result[f"{name}_ms"] = round(bench.eager_timed(staged, [None] * 5) / 1e3, 2)
        result[f"{name}_peak_mib"] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
    first, second = outputs.values()
    result["max_abs_diff"] = float((first.float() - second.float()).abs().max())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="1fd3927", help="the git revision whose kernel to compare against")
    parser.add_argument("--earlier", type=Path, help=f"the earlier {KERNEL} as a file, instead of git")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 262144])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        kernels = {"earlier": kernel_at(args.rev, Path(scratch), args.earlier), "this": qsa_row_cache}
        results = [compare(kernels, context) for context in args.contexts]
    for r in results:
        print(json.dumps(r) if args.json else
              f"ctx {r['context']:7d}: this {r['this_ms']} ms, {r['this_peak_mib']} MiB; earlier ({args.rev}) "
              f"{r['earlier_ms']} ms, {r['earlier_peak_mib']} MiB; max |diff| {r['max_abs_diff']}")


if __name__ == "__main__":
    main()
