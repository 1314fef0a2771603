"""A stand-in OpenAI-compatible server on loopback, only for what a real server will not do on
demand: stall, drop a stream, send a chunk that is not JSON, fail with a 500 or mid-stream.

It speaks raw HTTP/1.1 over asyncio streams (chunked server-sent events), so that a dropped stream
is a connection closed before the terminating chunk, as a crashed server leaves it. Requests for
at most two tokens (``flashnext bench``'s probe) always succeed; every other request takes the next
behaviour of ``schedule`` in turn. ``served`` counts what each behaviour answered; ``sent_at``
keeps, for each answer, the ``time.perf_counter()`` of every token chunk it wrote (a benchmark
compares a client's timings with them). ``interval_s`` paces the tokens.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from itertools import cycle

BEHAVIOURS = ("ok", "stall", "drop", "invalid_json", "http_500", "error_event", "no_finish")


class FaultServer:
    def __init__(self, schedule: tuple[str, ...] = BEHAVIOURS, tokens: int = 8, interval_s: float = 0.002):
        unknown = set(schedule) - set(BEHAVIOURS)
        if unknown:
            raise ValueError(f"unknown behaviours {unknown}")
        self._schedule = cycle(schedule)
        self.tokens = tokens
        self.interval_s = interval_s
        self.served: Counter[str] = Counter()
        self.sent_at: list[list[float]] = []
        self._loop = asyncio.new_event_loop()
        self._server = None
        self._stop = None
        self.port = 0

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> "FaultServer":
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def main():
            self._stop = asyncio.Event()
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            await self._stop.wait()
            self._server.close()
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in pending:  # stalled handlers sleep until cancelled
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        self._loop.run_until_complete(main())

    # -- HTTP ------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                keep = await self._respond(method, path, json.loads(body) if body else {}, writer)
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _respond(self, method: str, path: str, body: dict, w: asyncio.StreamWriter) -> bool:
        if method == "GET" and path.endswith("/models"):
            self._json(w, 200, {"object": "list", "data": [{"id": "fault-model", "object": "model"}]})
            return True
        if not path.endswith("/chat/completions"):
            self._json(w, 404, {"error": {"message": f"no route {path}"}})
            return True
        probe = int(body.get("max_tokens") or 16) <= 2
        behaviour = "ok" if probe else next(self._schedule)
        self.served[behaviour] += 1
        if behaviour == "http_500":
            self._json(w, 500, {"error": {"message": "injected failure"}})
            return True
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        n = int(body.get("max_tokens") or 16) if probe else self.tokens
        with_logprobs = bool(body.get("logprobs"))
        sent: list[float] = []
        answer = len(self.sent_at)  # its tokens carry this number: "a<answer>t<token>"
        self.sent_at.append(sent)
        for i in range(n):
            if behaviour == "stall" and i == 1:
                await asyncio.sleep(3600)  # until the client gives up and the connection goes
            if behaviour == "drop" and i == n // 2:
                await w.drain()
                w.transport.abort()  # no terminating chunk: the stream is cut
                return False
            if behaviour == "invalid_json" and i == 1:
                self._event(w, "{not json")
                continue
            if behaviour == "error_event" and i == 2:
                self._event(w, json.dumps({"error": {"message": "injected engine error", "code": 500}}))
                break
            self._event(w, json.dumps(self._chunk(f"a{answer}t{i} ", with_logprobs)))
            await w.drain()
            sent.append(time.perf_counter())
            await asyncio.sleep(self.interval_s)
        if behaviour != "no_finish":
            last = self._chunk("", False, finish="length")
            if body.get("stream_options", {}).get("include_usage"):
                last["usage"] = {"prompt_tokens": 4 + len(json.dumps(body.get("messages"))) // 4,
                                 "completion_tokens": n, "total_tokens": n + 4}
            self._event(w, json.dumps(last))
            self._event(w, "[DONE]")
        w.write(b"0\r\n\r\n")
        await w.drain()
        return True

    @staticmethod
    def _chunk(text: str, with_logprobs: bool, finish: str | None = None) -> dict:
        choice = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
        if with_logprobs and text:
            choice["logprobs"] = {"content": [{"token": text, "logprob": -0.1,
                                               "top_logprobs": [{"token": text, "logprob": -0.1},
                                                                {"token": "x", "logprob": -2.5}]}]}
        return {"id": "c", "object": "chat.completion.chunk", "model": "fault-model", "choices": [choice]}

    @staticmethod
    def _event(w: asyncio.StreamWriter, data: str) -> None:
        payload = f"data: {data}\n\n".encode()
        w.write(b"%x\r\n%s\r\n" % (len(payload), payload))

    @staticmethod
    def _json(w: asyncio.StreamWriter, status: int, obj: dict) -> None:
        payload = json.dumps(obj).encode()
        reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}[status]
        w.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (status, reason.encode(), len(payload), payload))
