"""One streamed chat completion, timed as the client sees it.

A request never raises: whatever the server does (an HTTP error, a stall, a stream that ends
before its finish, a chunk that is not JSON) ends up in :attr:`Completion.error`, so that one bad
answer is counted in the report instead of ending the run.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

# What a failed request is called in the report (``Completion.error``).
ERROR_KINDS = (
    "connect",       # no connection to the server
    "http",          # an HTTP status >= 400
    "stall",         # no byte for --stall-timeout seconds
    "timeout",       # the whole request ran past --request-timeout
    "dropped",       # the stream ended before a finish_reason or [DONE]
    "invalid_json",  # a server-sent event whose data is not JSON (or not a completion chunk)
    "empty",         # the answer finished without a single token
)


@dataclass
class TopLogprobs:
    """One generated token: the token, its logprob, and the server's top-k at that position."""

    token: str
    logprob: float
    top: dict[str, float]


@dataclass
class Completion:
    """A streamed completion. Times are seconds from the moment the request was sent."""

    ok: bool = False
    sent_at: float = 0.0             # time.perf_counter() when the request went out
    error: str | None = None         # one of ERROR_KINDS
    error_detail: str | None = None
    status: int | None = None
    ttft_s: float | None = None      # to the first chunk that carries generated text
    e2e_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # one entry per generated token
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    logprobs: list[TopLogprobs] | None = None

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies. A chunk carrying k tokens (speculative decoding) counts as k
        tokens spread evenly over the gap since the previous chunk."""
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens per second after the first token."""
        n = self.n_tokens
        if n < 2 or self.e2e_s is None or self.ttft_s is None:
            return None
        span = self.token_times_s[-1] - self.ttft_s
        return (n - 1) / span if span > 0 else None

    @property
    def n_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.token_times_s)


def _chunk_tokens(choice: dict) -> tuple[str, int, list[TopLogprobs] | None]:
    """The answer text a chunk carries, how many tokens (``logprobs`` tells; else one a chunk), and those."""
    delta = choice.get("delta") or {}
    if not isinstance(delta, dict):
        raise ValueError("delta is not an object")
    text = delta.get("content") if isinstance(delta.get("content"), str) else ""
    # Thinking streamed apart from the answer is generated tokens too, timed like the rest.
    reasoning = "".join(v for k in ("reasoning_content", "reasoning") if isinstance(v := delta.get(k), str))
    lp = choice.get("logprobs")
    entries = lp.get("content") if isinstance(lp, dict) else None
    if entries:
        tokens = [TopLogprobs(token=e["token"], logprob=float(e["logprob"]),
                              top={t["token"]: float(t["logprob"]) for t in e.get("top_logprobs") or []})
                  for e in entries]
        return text, len(tokens), tokens
    return text, (1 if text or reasoning else 0), None


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict, *, request_timeout: float) -> Completion:
    """POST ``body`` (``stream`` forced on) to ``url`` and time every token of the answer."""
    t0 = time.perf_counter()
    out = Completion(sent_at=t0)
    try:
        await asyncio.wait_for(_read_stream(client, url, {**body, "stream": True}, out, t0), request_timeout)
    except asyncio.TimeoutError:
        out.error, out.error_detail = "timeout", f"no complete answer within {request_timeout:g} s"
    except httpx.ReadTimeout:
        out.error, out.error_detail = "stall", "the stream went silent"
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        out.error, out.error_detail = "connect", str(e) or type(e).__name__
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        out.error, out.error_detail = "dropped", str(e) or type(e).__name__
    except (ValueError, KeyError, TypeError) as e:
        out.error, out.error_detail = "invalid_json", str(e)[:200]
    except httpx.HTTPError as e:
        out.error, out.error_detail = "dropped", f"{type(e).__name__}: {e}"
    out.e2e_s = time.perf_counter() - t0
    out.ok = out.error is None
    return out


async def _read_stream(client: httpx.AsyncClient, url: str, body: dict, out: Completion, t0: float) -> None:
    async with client.stream("POST", url, json=body) as response:
        out.status = response.status_code
        if response.status_code >= 400:
            detail = (await response.aread()).decode("utf-8", "replace").strip().replace("\n", " ")
            out.error, out.error_detail = "http", f"HTTP {response.status_code}: {detail[:200]}"
            return
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, event names
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                raise ValueError(f"a chunk is not an object: {data[:80]}")
            if "error" in chunk:  # vLLM reports a failure mid-stream this way
                out.error, out.error_detail = "http", f"error in stream: {json.dumps(chunk['error'])[:200]}"
                return
            now = time.perf_counter() - t0
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
                out.completion_tokens = usage.get("completion_tokens", out.completion_tokens)
            for choice in chunk.get("choices") or []:
                text, n, tokens = _chunk_tokens(choice)
                if n:
                    previous = out.token_times_s[-1] if out.token_times_s else now
                    if out.ttft_s is None:
                        out.ttft_s = now
                        out.token_times_s.extend([now] * n)
                    else:
                        step = (now - previous) / n
                        out.token_times_s.extend(previous + step * (i + 1) for i in range(n))
                out.text += text
                if tokens is not None:
                    out.logprobs = (out.logprobs or []) + tokens
                if choice.get("finish_reason"):
                    out.finish_reason = choice["finish_reason"]
        if not done and out.finish_reason is None:
            out.error, out.error_detail = "dropped", "the stream ended without a finish_reason or [DONE]"
        elif out.ttft_s is None:
            out.error = "empty"
            out.error_detail = f"finished ({out.finish_reason or '[DONE]'}) without a single token"
