"""A stand-in OpenAI-compatible server on loopback, only for what a real server will not do on
demand: stall, drop a stream, send a chunk that is not JSON, fail with a 500 or mid-stream, and the
hostile answers of ``HOSTILE`` (lone surrogates, NaN logprobs, usage of the wrong type or size,
non-object choices, JSON nested 10^5 deep, a line or an answer that never ends, an error page that
echoes the request's credentials); ``models`` breaks ``/v1/models`` the same way.

It speaks raw HTTP/1.1 over asyncio streams (chunked server-sent events), so that a dropped stream
is a connection closed before the terminating chunk, as a crashed server leaves it. Requests for
at most two tokens (``flashnext bench``'s probe) always succeed; every other request takes the next
behaviour of ``schedule`` in turn. ``served`` counts what each behaviour answered; ``sent_at``
keeps, for each answer, the ``time.perf_counter()`` of every token chunk it wrote (a benchmark
compares a client's timings with them). ``interval_s`` paces the tokens. ``requests`` keeps the
method, target and ``Authorization`` header of every request, the probe's and ``/v1/models`` too.

``metrics``, when given, serves ``GET /metrics``: it is called with the number of chat requests in
flight and returns the Prometheus text to answer (a test builds it with vLLM's own
``PrometheusStatLogger``); without it ``/metrics`` is a 404, as on llama.cpp's server. ``images``
keeps the (width, height) of every image a request carried, decoded with PIL: proof that what was
sent is an image of the size asked for.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections import Counter
from itertools import cycle

BEHAVIOURS = ("ok", "stall", "drop", "invalid_json", "http_500", "error_event", "no_finish")


def _raw_chunk(delta: str, logprobs: str = "") -> str:
    """A chunk written by hand: JSON that ``json.dumps`` would never write (NaN, a lone surrogate)."""
    lp = f', "logprobs": {{"content": [{logprobs}]}}' if logprobs else ""
    return f'{{"id": "c", "choices": [{{"index": 0, "delta": {delta}{lp}, "finish_reason": null}}]}}'


def _raw_logprob(value: str) -> str:
    return f'{{"token": "a", "logprob": {value}, "top_logprobs": [{{"token": "a", "logprob": {value}}}]}}'


# The token chunk at position 1 of the answer, replaced by one of these.
RAW_EVENTS = {
    "lone_surrogate": _raw_chunk('{"content": "\\ud800"}'),
    "nan_logprob": _raw_chunk('{"content": "a"}', _raw_logprob("NaN")),
    "inf_logprob": _raw_chunk('{"content": "a"}', _raw_logprob("-Infinity")),
    "overflow_logprob": _raw_chunk('{"content": "a"}', _raw_logprob("-1e999")),
    "positive_logprob": _raw_chunk('{"content": "a"}', _raw_logprob("1000.0")),
    "token_not_string": _raw_chunk('{"content": "a"}', '{"token": 7, "logprob": -0.5, "top_logprobs": []}'),
    "choices_object": '{"id": "c", "choices": {"0": {"index": 0, "delta": {"content": "a"}}}}',
    "choice_not_object": '{"id": "c", "choices": [5]}',
    "content_not_string": _raw_chunk('{"content": {"text": "a"}}'),
    "deep_json": '{"choices": ' + '[' * 100_000 + ']' * 100_000 + '}',
}
# The last chunk's usage, replaced by one of these.
USAGE = {
    "usage_wrong_type": {"prompt_tokens": "12", "completion_tokens": "8", "total_tokens": "20"},
    "usage_not_object": [12, 8],
    "usage_absurd": {"prompt_tokens": 12, "completion_tokens": 10 ** 33, "total_tokens": 10 ** 33 + 12},
    "usage_negative": {"prompt_tokens": -5, "completion_tokens": 8, "total_tokens": 3},
}
# Answers that never end: a line, or the lines of a stream (bounded here only by the client leaving).
ENDLESS = ("endless_line", "endless_answer")
HOSTILE = (*RAW_EVENTS, *USAGE, *ENDLESS, "echo_secret")
MODELS = ("ok", "int_id", "surrogate_id", "deep", "endless")


class FaultServer:
    def __init__(self, schedule: tuple[str, ...] = BEHAVIOURS, tokens: int = 8, interval_s: float = 0.002,
                 models: str = "ok", metrics=None):
        unknown = set(schedule) - set(BEHAVIOURS) - set(HOSTILE)
        if unknown or models not in MODELS:
            raise ValueError(f"unknown behaviours {unknown or models}")
        self._schedule = cycle(schedule)
        self.models = models
        self.requests: list[tuple[str, str, str | None]] = []
        self.tokens = tokens
        self.interval_s = interval_s
        self.served: Counter[str] = Counter()
        self.sent_at: list[list[float]] = []
        self.metrics = metrics
        self.in_flight = 0
        self.images: list[tuple[int, int]] = []
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
                self.requests.append((method, path, headers.get("authorization")))
                keep = await self._respond(method, path, json.loads(body) if body else {}, writer,
                                           headers.get("authorization"))
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _respond(self, method: str, target: str, body: dict, w: asyncio.StreamWriter,
                       auth: str | None = None) -> bool:
        path = target.split("?", 1)[0]
        if method == "GET" and path.endswith("/models"):
            return await self._models(w)
        if method == "GET" and path == "/metrics" and self.metrics is not None:
            payload = self.metrics(self.in_flight).encode()
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(payload), payload))
            return True
        if not path.endswith("/chat/completions"):
            self._json(w, 404, {"error": {"message": f"no route {path}"}})
            return True
        probe = int(body.get("max_tokens") or 16) <= 2
        behaviour = "ok" if probe else next(self._schedule)
        self.served[behaviour] += 1
        self.images += _image_sizes(body)
        self.in_flight += 1
        try:
            return await self._answer(behaviour, probe, target, body, w, auth)
        finally:
            self.in_flight -= 1

    async def _answer(self, behaviour: str, probe: bool, target: str, body: dict, w: asyncio.StreamWriter,
                      auth: str | None) -> bool:
        if behaviour == "http_500":
            self._json(w, 500, {"error": {"message": "injected failure"}})
            return True
        if behaviour == "echo_secret":  # as an error page that shows the request does
            who = base64.b64decode(auth.split(" ", 1)[1]).decode() if auth and " " in auth else ""
            self._json(w, 500, {"error": {"message": f"injected failure for {who} at {target}"}})
            return True
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        if behaviour in ENDLESS:
            await self._endless(w, behaviour)
            return False
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
            if behaviour in RAW_EVENTS and i == 1:
                self._event(w, RAW_EVENTS[behaviour])
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
                last["usage"] = USAGE.get(behaviour) or {
                    "prompt_tokens": 4 + len(json.dumps(body.get("messages"))) // 4,
                    "completion_tokens": n, "total_tokens": n + 4}
            self._event(w, json.dumps(last))
            self._event(w, "[DONE]")
        w.write(b"0\r\n\r\n")
        await w.drain()
        return True

    async def _endless(self, w: asyncio.StreamWriter, behaviour: str) -> None:
        """Write until the client goes: one line that never ends, or token chunks that never do."""
        if behaviour == "endless_line":
            self._write_chunk(w, b'data: {"choices": [{"delta": {"content": "')
        piece = "x" * 4096
        try:
            while True:
                if behaviour == "endless_line":
                    self._write_chunk(w, piece.encode() * 16)
                else:
                    self._event(w, json.dumps(self._chunk(piece, False)))
                await w.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.transport.abort()

    async def _models(self, w: asyncio.StreamWriter) -> bool:
        ids = {"ok": '"fault-model"', "int_id": "7", "surrogate_id": '"fault-\\udc80-model"'}
        if self.models in ids:
            payload = f'{{"object": "list", "data": [{{"id": {ids[self.models]}, "object": "model"}}]}}'.encode()
        elif self.models == "deep":
            payload = b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        else:  # endless: a body that never ends, throttled so a client that keeps reading it grows slowly
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
            self._write_chunk(w, b'{"data": [{"id": "')
            try:
                while True:
                    self._write_chunk(w, b"m" * 65536)
                    await w.drain()
                    await asyncio.sleep(0.01)
            except (ConnectionError, asyncio.CancelledError):
                w.transport.abort()
                return False
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(payload), payload))
        return True

    @staticmethod
    def _write_chunk(w: asyncio.StreamWriter, payload: bytes) -> None:
        w.write(b"%x\r\n%s\r\n" % (len(payload), payload))

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
        FaultServer._write_chunk(w, f"data: {data}\n\n".encode())

    @staticmethod
    def _json(w: asyncio.StreamWriter, status: int, obj: dict) -> None:
        payload = json.dumps(obj).encode()
        reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}[status]
        w.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (status, reason.encode(), len(payload), payload))


def _image_sizes(body: dict) -> list[tuple[int, int]]:
    """The (width, height) of each image in the request's messages (base64 data URLs)."""
    import io

    from PIL import Image

    sizes = []
    for m in body.get("messages") or []:
        for part in m.get("content") if isinstance(m.get("content"), list) else []:
            url = part.get("image_url", {}).get("url", "") if part.get("type") == "image_url" else ""
            if url.startswith("data:image/"):
                with Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as im:
                    sizes.append(im.size)
    return sizes
