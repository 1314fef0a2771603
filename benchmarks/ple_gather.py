"""PLE row gathers, side by side in one run (issue 29): the quantized table pinned in host memory and
read by the GPU through UVA, against today's BF16 table file behind mmap, warm and cold.

* ``uva_nvfp4``: a full-size NVFP4 table (``--rows``, default the real 320,001,536) in pinned host
  memory; one Triton program per row reads the row's 80 code bytes and 10 scale bytes from the
  host through UVA and decodes them to BF16 on the GPU, as vLLM 0.33.0's
  ``Qwen4ExpPLENvFp4EmbeddingMethod.lookup_from_pinned`` does;
* ``uva_fp8``: the FP8 table pinned the same way; a byte-copy kernel brings each 160-byte row over,
  then ``bf16(fp8) * bf16(scale)`` on the GPU, as ``Qwen4ExpPLEFp8EmbeddingMethod`` does;
* ``mmap_bf16_warm`` / ``mmap_bf16_cold``: the BF16 file (320-byte rows; ``--file-gib`` of it, a
  scaled file: a cold gather's cost is a page fault per row, whatever the file's size) gathered on
  the host into a pinned staging buffer and copied to the GPU, as ple-mmap's ``stage()`` does;
  cold runs evict the file's pages with ``posix_fadvise(DONTNEED)`` first.

vLLM cannot run on the GPU machine (its torch is not vLLM's), so the two UVA lookups are replicas
of vLLM's access pattern (a program per row, the decode in registers), written here and checked
against torch decoding the same rows on the host (``values_differing_from_torch``: 0). Ids are
uniform over the rows (the n-gram hash spreads them so); a decode step is 16 rows per token (2
n-gram orders x 8 heads), a prefill chunk 512 tokens. Each point is the median of ``--reps`` calls, each with fresh ids; GPU times by CUDA
events, eager (``_us``: the launches' host time included, as an eager step pays it) and replayed
from a CUDA graph (``_graph_us``: the GPU's time alone), host paths by the wall clock to the end of
their copy. Without a GPU only the mmap rows run.

    python -m benchmarks.ple_gather [--rows 320001536] [--file-gib 8] [--workdir .bench] [--reps 200] [--no-mmap]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.ple_prefetch import evict, write_table
from benchmarks.qsa_offload import timed
from flashnext.quant.formats import float_rows
from flashnext.quant.ple.mapped import PleTableFile

FULL_ROWS = 320_001_536
D = 160  # elements per row
ROWS_PER_TOKEN = 16
POINTS = {"decode_1": 1, "decode_4": 4, "prefill_512": 512}  # tokens per gather

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _e2m1(code):
        mag = code & 7
        exponent = (mag >> 1).to(tl.float32)
        half = (mag & 1).to(tl.float32) * 0.5
        value = tl.where(mag < 2, half, (1.0 + half) * tl.exp2(exponent - 1.0))
        return tl.where(code >= 8, -value, value)

    @triton.jit
    def _nvfp4_rows_kernel(weight_ptr, scale_ptr, global_scale, ids_ptr, out_ptr,
                           D: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        idx = tl.load(ids_ptr + row).to(tl.int64)
        offsets = tl.arange(0, BLOCK)
        inside = offsets < D
        packed = tl.load(weight_ptr + idx * (D // 2) + offsets // 2, mask=inside, other=0)
        codes = (packed >> ((offsets % 2) * 4)) & 0xF
        scale_bytes = tl.load(scale_ptr + idx * (D // 16) + offsets // 16, mask=inside, other=0)
        scales = scale_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        values = _e2m1(codes) * scales * global_scale
        tl.store(out_ptr + row * D + offsets, values.to(tl.bfloat16), mask=inside)

    @triton.jit
    def _byte_rows_kernel(table_ptr, ids_ptr, out_ptr, ROW_BYTES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        idx = tl.load(ids_ptr + row).to(tl.int64)
        offsets = tl.arange(0, BLOCK)
        inside = offsets < ROW_BYTES
        tl.store(out_ptr + row * ROW_BYTES + offsets,
                 tl.load(table_ptr + idx * ROW_BYTES + offsets, mask=inside, other=0), mask=inside)
except ImportError:  # no Triton: the mmap rows still run
    triton = None


def pinned_random_bytes(rows: int, row_bytes: int, scale_bytes: bool = False) -> torch.Tensor:
    """A pinned ``[rows, row_bytes]`` uint8 table of random bytes, filled from the GPU in chunks.
    As E4M3 scale bytes, the exponent is kept small and NaN (0x7F/0xFF) cannot occur."""
    table = torch.empty((rows, row_bytes), dtype=torch.uint8, pin_memory=True)
    chunk = max(1, (1 << 30) // row_bytes)
    for start in range(0, rows, chunk):
        part = torch.randint(0, 256, (min(chunk, rows - start), row_bytes), dtype=torch.uint8, device="cuda")
        if scale_bytes:
            part = (part & 0x87) | 0x30  # exponent 6..7 of 15: scales in [2^-1, 2^1)
        table[start:start + part.shape[0]].copy_(part)
    torch.cuda.synchronize()
    return table


def id_sets(rows: int, tokens: int, reps: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    return [torch.randint(0, rows, (tokens * ROWS_PER_TOKEN,), generator=g).to(device) for _ in range(reps)]


def uva_nvfp4(rows: int, reps: int) -> dict:
    weight = pinned_random_bytes(rows, D // 2)
    scale = pinned_random_bytes(rows, D // 16, scale_bytes=True)
    global_scale = 1.7e-4
    out = torch.empty((512 * ROWS_PER_TOKEN, D), dtype=torch.bfloat16, device="cuda")

    def lookup(ids):
        _nvfp4_rows_kernel[(ids.numel(),)](weight, scale, global_scale, ids, out, D=D, BLOCK=256)

    check = id_sets(rows, 4, 1, "cuda")[0]
    lookup(check)
    host_ids = check.cpu()
    # vLLM's GPU kernel multiplies (e2m1 * block scale) * global scale, its CPU path e2m1 * (block
    # scale * global scale): one float32 rounding apart. The check follows the kernel's order; the
    # E2M1 values come from flashnext's decoder at unit scales (exact in bf16).
    codes = float_rows.nvfp4_decode(weight[host_ids], torch.ones(check.numel(), D // 16).to(torch.float8_e4m3fn), 1.0)
    block = scale[host_ids].view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
    expected = (codes.float() * block * torch.tensor(global_scale, dtype=torch.float32)).to(torch.bfloat16)
    result = {"table_bytes": weight.numel() + scale.numel(),
              "values_differing_from_torch": int((out[:check.numel()].cpu() != expected).sum())}
    for point, tokens in POINTS.items():
        ids = id_sets(rows, tokens, reps, "cuda")
        result[f"{point}_us"] = round(timed(lookup, ids, graph=False), 2)
        result[f"{point}_graph_us"] = round(timed(lookup, ids), 2)
    del weight, scale
    return result


def uva_fp8(rows: int, reps: int) -> dict:
    table = pinned_random_bytes(rows, D)
    table.view(torch.uint8).bitwise_and_(0xF7)  # no NaN bytes (0x7F/0xFF)
    scale = 2.3e-3
    raw = torch.empty((512 * ROWS_PER_TOKEN, D), dtype=torch.uint8, device="cuda")
    scale_bf16 = torch.tensor(scale, dtype=torch.float32).to(torch.bfloat16).cuda()
    decoded = {}

    def lookup(ids):
        _byte_rows_kernel[(ids.numel(),)](table, ids, raw, ROW_BYTES=D, BLOCK=256)
        decoded["rows"] = raw[:ids.numel()].view(torch.float8_e4m3fn).to(torch.bfloat16) * scale_bf16

    check = id_sets(rows, 4, 1, "cuda")[0]
    lookup(check)
    expected = float_rows.fp8_decode(table[check.cpu()].view(torch.float8_e4m3fn), scale)
    result = {"table_bytes": table.numel(),
              "values_differing_from_torch": int((decoded["rows"].cpu() != expected).sum())}
    for point, tokens in POINTS.items():
        ids = id_sets(rows, tokens, reps, "cuda")
        result[f"{point}_us"] = round(timed(lookup, ids, graph=False), 2)
        result[f"{point}_graph_us"] = round(timed(lookup, ids), 2)
    del table
    return result


def mmap_bf16(path: Path, rows: int, reps: int, cold: bool) -> dict:
    on_gpu = torch.cuda.is_available()
    staging = torch.empty((512 * ROWS_PER_TOKEN, D * 2), dtype=torch.uint8, pin_memory=on_gpu)
    target = torch.empty((512 * ROWS_PER_TOKEN, D * 2), dtype=torch.uint8, device="cuda" if on_gpu else "cpu")
    table = PleTableFile(path, rows, D * 2)
    try:
        if not cold:
            table.gather(np.arange(0, rows, 4096 // (D * 2), dtype=np.int64))  # every page resident
        result = {"file_bytes": path.stat().st_size, "copy_to_gpu": on_gpu}
        for point, tokens in POINTS.items():
            times = []
            point_reps = reps if not cold else (5 if tokens == 512 else max(5, reps // 4))
            for ids in id_sets(rows, tokens, point_reps, "cpu"):
                if cold:
                    evict(path)
                flat = ids.numpy()
                started = time.perf_counter()
                table.gather(flat, out=staging.numpy())
                target[:flat.size].copy_(staging[:flat.size], non_blocking=on_gpu)
                if on_gpu:
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - started) * 1e6)
            result[f"{point}_us"] = round(statistics.median(times), 1)
        return result
    finally:
        table.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=FULL_ROWS, help="rows of each pinned table (default: the real table's)")
    parser.add_argument("--file-gib", type=float, default=8.0, help="size of the scaled BF16 file")
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--formats", nargs="+", default=["nvfp4", "fp8"], choices=["nvfp4", "fp8"])
    parser.add_argument("--no-mmap", action="store_true", help="only the pinned tables")
    args = parser.parse_args()
    gpu = torch.cuda.is_available() and triton is not None
    results: dict = {"machine": f"{platform.node()}, {os.cpu_count()} cpus"
                                + (f", {torch.cuda.get_device_name()}" if gpu else ", no GPU"),
                     "rows_per_token": ROWS_PER_TOKEN, "points_tokens": POINTS}
    if not args.no_mmap:
        args.workdir.mkdir(parents=True, exist_ok=True)
        file_rows = int(args.file_gib * (1 << 30)) // (D * 2)
        path = args.workdir / "ple-bf16.bin"
        write_table(path, file_rows * D * 2)
        results["mmap_bf16_warm"] = mmap_bf16(path, file_rows, args.reps, cold=False)
        results["mmap_bf16_cold"] = mmap_bf16(path, file_rows, args.reps, cold=True)
    if gpu:
        for fmt in args.formats:
            started = time.perf_counter()
            results[f"uva_{fmt}"] = (uva_nvfp4 if fmt == "nvfp4" else uva_fp8)(args.rows, args.reps)
            results[f"uva_{fmt}"]["setup_s"] = round(time.perf_counter() - started, 1)
            if hasattr(torch._C, "_host_emptyCache"):
                torch._C._host_emptyCache()  # give the pinned table back before the next one
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
