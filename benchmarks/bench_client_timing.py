"""How exactly ``flashnext bench`` times tokens: its client against the ``openai`` SDK, side by side.

A loopback server in its own process (tests/support/fault_server.py, answering normally) writes a
token chunk every ``--interval-ms`` (10 ms: the 3x3090 rig's ~100 tok/s) and records when it wrote
each one; both clients stream the same requests at 1 and 4 concurrent, alternating, and each token's
arrival time is compared with its send time (one clock: CLOCK_MONOTONIC across processes). Reported:
the delay from write to timestamp (p50, p99) and the error of each inter-token gap.

    python -m benchmarks.bench_client_timing --interval-ms 10 --tokens 100 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _serve(conn, tokens: int, interval_s: float) -> None:
    from support.fault_server import FaultServer

    with FaultServer(schedule=("ok",), tokens=tokens, interval_s=interval_s) as server:
        conn.send(server.url)
        conn.recv()  # stop
        conn.send(server.sent_at)


def _answer_number(text: str) -> int:
    return int(text.split("t", 1)[0][1:])


async def _flashnext(url: str, c: int) -> list[tuple[int, list[float]]]:
    import httpx

    from flashnext.serving.bench.client import stream_chat

    body = {"model": "fault-model", "messages": [{"role": "user", "content": "go"}], "max_tokens": 64}
    async with httpx.AsyncClient(timeout=60) as client:
        done = await asyncio.gather(*(stream_chat(client, f"{url}/v1/chat/completions", body, request_timeout=60)
                                      for _ in range(c)))
    return [(_answer_number(d.text), [d.sent_at + t for t in d.token_times_s]) for d in done]


async def _openai(url: str, c: int) -> list[tuple[int, list[float]]]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none")

    async def one():
        times, text = [], ""
        stream = await client.chat.completions.create(model="fault-model", stream=True, max_tokens=64,
                                                      messages=[{"role": "user", "content": "go"}])
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())
                text += chunk.choices[0].delta.content
        return _answer_number(text), times

    try:
        return await asyncio.gather(*(one() for _ in range(c)))
    finally:
        await client.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--interval-ms", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_serve, args=(child, args.tokens, args.interval_ms / 1000))
    proc.start()
    url = parent.recv()
    got: dict[tuple[str, int], list] = {}
    for _ in range(args.rounds):
        for c in (1, 4):
            for name, fn in (("flashnext", _flashnext), ("openai SDK", _openai)):
                got.setdefault((name, c), []).extend(asyncio.run(fn(url, c)))
    parent.send("stop")
    sent = parent.recv()
    proc.join()
    print(f"{platform.node()} {platform.processor() or platform.machine()}, Python {platform.python_version()}; "
          f"{args.tokens} tokens every {args.interval_ms:g} ms, {args.rounds} rounds")
    print("| client | concurrent | delay p50 (µs) | delay p99 (µs) | ITL error p50 (µs) | ITL error p99 (µs) | tokens |")
    print("|---|---|---|---|---|---|---|")
    for (name, c), answers in got.items():
        delay, gap = [], []
        for k, times in answers:
            ref = sent[k]
            delay += [(t - s) * 1e6 for t, s in zip(times, ref)]
            gap += [abs((t1 - t0) - (s1 - s0)) * 1e6 for t0, t1, s0, s1 in zip(times, times[1:], ref, ref[1:])]
        q = statistics.quantiles
        print(f"| {name} | {c} | {statistics.median(delay):.0f} | {q(delay, n=100)[98]:.0f} | "
              f"{statistics.median(gap):.0f} | {q(gap, n=100)[98]:.0f} | {len(delay)} |")


if __name__ == "__main__":
    main()
