"""n-gram ids of a 262,144-token prompt on one core (target: at most 150 ms).

    python -m benchmarks.ple_hash_speed
"""

from __future__ import annotations

import json
import os
import platform
import time

import numpy as np

from flashnext.quant.ple.hashing import NgramHasher
from flashnext.quant.ple.layout import ple_layout

REAL = {"ngram_size": 3, "heads_per_ngram": 8, "ple_embed_dim": 2560, "vocab_size": 248320,
        "ngram_vocab_size_base": 20000000, "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": 128, "eos_token_id": 248044}


def main() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    hasher = NgramHasher(ple_layout(REAL))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, REAL["vocab_size"], 262_144)
    tokens[rng.integers(0, tokens.size, 300)] = REAL["eos_token_id"]
    hasher.ids(tokens)  # first touch of the buffers
    times = []
    for _ in range(7):
        t = time.perf_counter()
        hasher.ids(tokens)
        times.append((time.perf_counter() - t) * 1000)
    single = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(10_000):
            hasher.token_ids(3555, (1879, 11))
        single.append((time.perf_counter() - t) / 10_000 * 1e6)
    print(json.dumps({"machine": f"{platform.node()}, 1 core pinned", "tokens": tokens.size,
                      "median_ms": round(sorted(times)[len(times) // 2], 1), "min_ms": round(min(times), 1),
                      "one_token_us": round(min(single), 2)}, indent=2))


if __name__ == "__main__":
    main()
