"""What patch ple-mmap's per-step device-to-host copy of the PLE row ids costs (issue 25, 7a).

``PleFileServing.ngram_ids`` brings each step's row ids (``tokens x 16`` int64, computed on the GPU by
vLLM's kernel) to the host with a blocking ``.to("cpu")``, because the rows are gathered from the
mapped table file on the host. This measures, on one GPU, in plain torch (the GPU machine has no
vLLM; a small elementwise kernel stands in for vLLM's ``ple_ngram_ids``):

- ``idle``: the copy on an idle stream, blocking ``.to("cpu")`` against ``copy_(non_blocking=True)``
  into pinned memory and an event;
- ``behind``: the same with ``--queued-ms`` of GPU work queued ahead on the stream (a forward still
  running): how long the host is blocked;
- ``gather``: the host work that follows the copy, ``np.take`` of the step's rows (320 B each) from a
  mapped file in the page cache, and the pinned host-to-device copy of them.

    python benchmarks/ple_ids_sync.py [--tokens 1 4 8] [--queued-ms 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import tempfile
import time

import numpy as np
import torch

HEADS = 16
ROW_BYTES = 320  # 160 bf16 per row (the release's PLE table)


def _median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _stand_in_ids(tokens: torch.Tensor) -> torch.Tensor:
    """A stand-in for vLLM's hash kernel: one elementwise launch producing ``[T, 16]`` int64."""
    return (tokens.view(-1, 1).long() * 1_000_003 + torch.arange(HEADS, device=tokens.device)) % 320_000_000


def _busy(ms: float, a: torch.Tensor) -> None:
    """Queue about ``ms`` of GPU work (bf16 matmuls) without waiting for it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    a @ a
    end.record()
    end.synchronize()
    per = max(start.elapsed_time(end), 1e-3)
    for _ in range(max(int(ms / per), 1)):
        a @ a


def measure(tokens: int, queued_ms: float, repeat: int) -> dict:
    dev = torch.device("cuda")
    step_tokens = torch.randint(0, 248_320, (tokens,), device=dev, dtype=torch.int32)
    pinned = torch.empty(tokens, HEADS, dtype=torch.int64, pin_memory=True)
    event = torch.cuda.Event()
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

    def blocking():
        return _stand_in_ids(step_tokens).to("cpu", torch.int64).numpy()

    def pinned_event():
        pinned.copy_(_stand_in_ids(step_tokens), non_blocking=True)
        event.record()
        event.synchronize()
        return pinned.numpy()

    for fn in (blocking, pinned_event):
        fn()
    torch.cuda.synchronize()
    out = {"tokens": tokens, "ids_bytes": tokens * HEADS * 8,
           "idle_blocking_us": _median_us(blocking, repeat), "idle_pinned_event_us": _median_us(pinned_event, repeat)}

    behind = {}
    for name, fn in (("blocking", blocking), ("pinned_event", pinned_event)):
        waits = []
        for _ in range(max(repeat // 50, 5)):
            torch.cuda.synchronize()
            _busy(queued_ms, a)
            start = time.perf_counter()
            fn()
            waits.append(time.perf_counter() - start)
        behind[name] = statistics.median(waits) * 1e3
    out["behind_ms"] = behind

    rows = 1 << 21  # a 640 MiB table, warm in the page cache
    with tempfile.NamedTemporaryFile() as f:
        f.truncate(rows * ROW_BYTES)
        with mmap.mmap(f.fileno(), rows * ROW_BYTES, prot=mmap.PROT_READ) as m:
            table = np.frombuffer(m, dtype=np.uint8).reshape(rows, ROW_BYTES)
            ids = np.random.default_rng(0).integers(0, rows, tokens * HEADS)
            np.take(table, np.arange(rows, step=max(rows // 4096, 1)), axis=0)  # fault the pages in
            np.take(table, ids, axis=0)
            staging = torch.empty(tokens * HEADS, ROW_BYTES, dtype=torch.uint8, pin_memory=True)
            device_rows = torch.empty(tokens * HEADS, ROW_BYTES, dtype=torch.uint8, device=dev)

            def gather():
                np.take(table, ids, axis=0, out=staging.numpy())
                device_rows.copy_(staging, non_blocking=True)

            out["gather_and_copy_us"] = _median_us(gather, repeat)
            torch.cuda.synchronize()
            del gather, table  # the mapping closes only when no array views it
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--queued-ms", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=1000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = [measure(t, args.queued_ms, args.repeat) for t in args.tokens]
    report = {"device": torch.cuda.get_device_name(), "queued_ms": args.queued_ms, "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['device']}; {args.queued_ms} ms of GPU work queued ahead for 'behind'")
    for r in results:
        print(f"{r['tokens']:>3} tokens ({r['ids_bytes']} B of ids): idle blocking {r['idle_blocking_us']:.1f} us, "
              f"pinned+event {r['idle_pinned_event_us']:.1f} us; behind: blocking {r['behind_ms']['blocking']:.2f} ms, "
              f"pinned+event {r['behind_ms']['pinned_event']:.2f} ms; gather+H2D {r['gather_and_copy_us']:.1f} us")


if __name__ == "__main__":
    main()
