"""One streamed chat completion, timed as the client sees it; the one place server answers are read.

A request never raises: whatever the server does (an HTTP error, a stall, a stream that ends
before its finish, a chunk that is not JSON or not a completion chunk, counts no server could
mean, a line that never ends) ends up in :attr:`Completion.error`, so that one bad answer is
counted in the report instead of ending the run. Every answer is validated here into typed values
(``str``, ``int``, finite ``float``), so nothing downstream (the metrics, report.json, the HTML)
sees a lone surrogate, a NaN or a count of 10^33.

URLs may carry credentials (``user:pass@``, ``?api_key=``): :func:`redact_url` is what any report,
message or page shows of one, and :func:`url_secrets` what :func:`scrub` removes from text a
server sent back.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

import httpx

from flashnext.errors import FlashnextError
from flashnext.quant.records.jsonfile import parse_json

# What a failed request is called in the report (``Completion.error``).
ERROR_KINDS = (
    "connect",        # no connection to the server
    "http",           # an HTTP status >= 400, or an error event in the stream
    "stall",          # no byte for --stall-timeout seconds
    "timeout",        # the whole request ran past --request-timeout
    "dropped",        # the stream ended before a finish_reason or [DONE]
    "invalid_json",   # an event whose data is not strict JSON (NaN, a lone surrogate, nested too deep, a syntax error)
    "invalid_chunk",  # JSON, but not a completion chunk (choices not a list of objects, a field of the wrong type)
    "absurd_usage",   # usage counts no server could mean (negative, past the request's max_tokens)
    "too_large",      # a line past LINE_LIMIT bytes, or an answer past its byte budget
    "empty",          # the answer finished without a single token
)

# A completion chunk is a few KiB long (top-20 logprobs included); a line far past that is a hostile
# or broken server, refused before it costs memory.
LINE_LIMIT = 1 << 20
# An answer's byte budget: generous for top-20 logprobs on every token, bounded for a server that
# streams forever (and at most _BUDGET_MAX, whatever max_tokens asked for).
_BUDGET_BASE = 1 << 20
_BUDGET_PER_TOKEN = 32 << 10
_BUDGET_MAX = 1 << 30
# No engine counts more tokens than an int32 holds; a count past the request's max_tokens is a lie too.
MAX_TOKEN_COUNT = (1 << 31) - 1
# Logprobs are <= 0; servers that round may send a hair above it. vLLM sends -inf as -9999.0, so
# anything below that means the same, and is kept there (sums of logprobs then stay finite).
LOGPROB_SLACK = 1e-4
LOGPROB_FLOOR = -9999.0
_ERROR_BODY_LIMIT = 4096
_MODELS_LIMIT = 1 << 20
_MODEL_NAME_LIMIT = 1024


class Malformed(ValueError):
    """A server answer that cannot be used, with the report's name for why (one of ERROR_KINDS)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


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


# -- strict JSON ----------------------------------------------------------------------------------

def parse_strict(text: str | bytes, where: str):
    """``text`` as JSON that every later step can hold: the shared strict reading (no NaN/Infinity,
    no number that reads as infinity, no duplicate key, bounded depth) and no lone surrogate either
    (report.json and the HTML are UTF-8). Raises :class:`Malformed` (``invalid_json``) saying which."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise Malformed("invalid_json", f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        value = parse_json(text, where)
    except FlashnextError as e:
        raise Malformed("invalid_json", str(e)) from None
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except UnicodeEncodeError:  # "\ud800" reads as a str that UTF-8 cannot hold
        raise Malformed("invalid_json", f"{where}: a lone surrogate in JSON") from None
    return value


def check_text(value: str, what: str) -> str:
    """``value`` if UTF-8 can hold it (argv may carry lone surrogates), else one line saying so."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise FlashnextError(f"{what} is not valid text (a lone surrogate)") from None
    return value


# -- typed chunk fields ---------------------------------------------------------------------------

def _json_type(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _bad(where: str, expected: str, value) -> Malformed:
    return Malformed("invalid_chunk", f"{where} is {_json_type(value)}, expected {expected}")


def _opt_str(obj: dict, key: str, where: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise _bad(f"{where}.{key}", "a string", value)
    return value


def _opt_dict(obj: dict, key: str, where: str) -> dict:
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(f"{where}.{key}", "an object", value)
    return value


def _opt_list(obj: dict, key: str, where: str) -> list:
    value = obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad(f"{where}.{key}", "an array", value)
    return value


def _logprob(obj, where: str) -> tuple[str, float]:
    if not isinstance(obj, dict):
        raise _bad(where, "an object", obj)
    token = obj.get("token")
    if not isinstance(token, str):
        raise _bad(f"{where}.token", "a string", token)
    value = obj.get("logprob")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"{where}.logprob", "a number", value)
    if not (math.isfinite(value) and value <= LOGPROB_SLACK):
        raise Malformed("invalid_chunk", f"{where}.logprob {value!r} is not a log-probability (<= 0)")
    return token, min(max(float(value), LOGPROB_FLOOR), 0.0)


def _token_count(usage: dict, key: str, limit: int, limit_why: str) -> int | None:
    value = usage.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"usage.{key}", "an integer", value)
    if value < 0:
        raise Malformed("absurd_usage", f"usage.{key} is {value}")
    if value > limit:
        shown = f"{value:.3g}" if value > 1e15 else str(value)
        raise Malformed("absurd_usage", f"usage.{key} {shown} is more than {limit_why} ({limit})")
    return value


@dataclass
class _Choice:
    text: str
    n_tokens: int
    tokens: list[TopLogprobs] | None
    finish_reason: str | None


def _choice(choice, where: str) -> _Choice:
    """The answer text a choice carries, how many tokens (``logprobs`` tells; else one a chunk), and those."""
    if not isinstance(choice, dict):
        raise _bad(where, "an object", choice)
    delta = _opt_dict(choice, "delta", where)
    text = _opt_str(delta, "content", f"{where}.delta") or ""
    # Thinking streamed apart from the answer is generated tokens too, timed like the rest.
    reasoning = "".join(_opt_str(delta, k, f"{where}.delta") or "" for k in ("reasoning_content", "reasoning"))
    finish = _opt_str(choice, "finish_reason", where)
    entries = _opt_list(_opt_dict(choice, "logprobs", where), "content", f"{where}.logprobs")
    if entries:
        tokens = []
        for i, e in enumerate(entries):
            at = f"{where}.logprobs.content[{i}]"
            token, logprob = _logprob(e, at)
            top = dict(_logprob(t, f"{at}.top_logprobs[{j}]")
                       for j, t in enumerate(_opt_list(e, "top_logprobs", at)))
            tokens.append(TopLogprobs(token=token, logprob=logprob, top=top))
        return _Choice(text, len(tokens), tokens, finish)
    return _Choice(text, 1 if text or reasoning else 0, None, finish)


def _int_field(body: dict, key: str) -> int | None:
    value = body.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _completion_limit(body: dict) -> tuple[int, str]:
    asked = [v for k in ("max_tokens", "max_completion_tokens") if (v := _int_field(body, k)) is not None]
    if asked:
        return min(max(asked), MAX_TOKEN_COUNT), "the request's max_tokens"
    return MAX_TOKEN_COUNT, "any engine counts"


def _byte_budget(body: dict) -> int:
    limit, _ = _completion_limit(body)
    return min(_BUDGET_BASE + limit * _BUDGET_PER_TOKEN, _BUDGET_MAX)


# -- the stream -----------------------------------------------------------------------------------

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
    except Malformed as e:
        out.error, out.error_detail = e.kind, str(e)[:200]
    except httpx.HTTPError as e:
        out.error, out.error_detail = "dropped", f"{type(e).__name__}: {e}"
    out.e2e_s = time.perf_counter() - t0
    out.ok = out.error is None
    return out


async def _lines(response: httpx.Response, budget: int):
    """The stream's lines (LF or CRLF), each at most LINE_LIMIT bytes, all of them within ``budget``
    bytes: a server that never ends a line, or never ends its answer, costs bounded memory."""
    buf = bytearray()
    total = 0
    async for piece in response.aiter_bytes():
        total += len(piece)
        if total > budget:
            raise Malformed("too_large", f"the answer passed {budget} bytes")
        scan_from = len(buf)  # what is already in buf holds no line end
        buf += piece
        begin = 0
        while (end := buf.find(b"\n", scan_from)) != -1:
            if end - begin > LINE_LIMIT:
                break
            yield bytes(buf[begin:end]).rstrip(b"\r").decode("utf-8", "replace")
            begin = scan_from = end + 1
        del buf[:begin]
        if len(buf) > LINE_LIMIT:
            raise Malformed("too_large", f"a line of the stream passed {LINE_LIMIT} bytes")
    if buf:
        yield bytes(buf).rstrip(b"\r").decode("utf-8", "replace")


async def _error_body(response: httpx.Response) -> str:
    kept = bytearray()
    async for piece in response.aiter_bytes():
        kept += piece
        if len(kept) >= _ERROR_BODY_LIMIT:
            break
    return kept[:_ERROR_BODY_LIMIT].decode("utf-8", "replace").strip().replace("\n", " ")


async def _read_stream(client: httpx.AsyncClient, url: str, body: dict, out: Completion, t0: float) -> None:
    async with client.stream("POST", url, json=body) as response:
        out.status = response.status_code
        if response.status_code >= 400:
            detail = await _error_body(response)
            out.error, out.error_detail = "http", f"HTTP {response.status_code}: {detail[:200]}"
            return
        async with aclosing(_lines(response, _byte_budget(body))) as lines:
            done = await _read_events(lines, out, t0, *_completion_limit(body))
        if out.error is not None:
            return
        if not done and out.finish_reason is None:
            out.error, out.error_detail = "dropped", "the stream ended without a finish_reason or [DONE]"
        elif out.ttft_s is None:
            out.error = "empty"
            out.error_detail = f"finished ({out.finish_reason or '[DONE]'}) without a single token"


async def _read_events(lines, out: Completion, t0: float, completion_limit: int, limit_why: str) -> bool:
    """Fill ``out`` from the stream's events; True once ``[DONE]`` came."""
    async for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        chunk = parse_strict(data, "event")
        if not isinstance(chunk, dict):
            raise Malformed("invalid_chunk", f"a chunk is {_json_type(chunk)}, expected an object: {data[:80]}")
        if "error" in chunk:  # vLLM reports a failure mid-stream this way
            out.error, out.error_detail = "http", f"error in stream: {json.dumps(chunk['error'])[:200]}"
            return False
        now = time.perf_counter() - t0
        usage = _opt_dict(chunk, "usage", "chunk")
        prompt = _token_count(usage, "prompt_tokens", MAX_TOKEN_COUNT, "any engine counts")
        completion = _token_count(usage, "completion_tokens", completion_limit, limit_why)
        out.prompt_tokens = out.prompt_tokens if prompt is None else prompt
        out.completion_tokens = out.completion_tokens if completion is None else completion
        for i, raw in enumerate(_opt_list(chunk, "choices", "chunk")):
            choice = _choice(raw, f"choices[{i}]")
            n = choice.n_tokens
            if n:
                previous = out.token_times_s[-1] if out.token_times_s else now
                if out.ttft_s is None:
                    out.ttft_s = now
                    out.token_times_s.extend([now] * n)
                else:
                    step = (now - previous) / n
                    out.token_times_s.extend(previous + step * (k + 1) for k in range(n))
            out.text += choice.text
            if choice.tokens is not None:
                out.logprobs = (out.logprobs or []) + choice.tokens
            if choice.finish_reason:
                out.finish_reason = choice.finish_reason
    return False


# -- /v1/models -----------------------------------------------------------------------------------

async def served_model(client: httpx.AsyncClient, models_url: str, shown_url: str) -> str:
    """The first model id of an OpenAI ``/v1/models`` answer, or one line saying why there is none
    (``shown_url``: the redacted URL, for the message)."""
    again = "pass --model NAME"
    try:
        async with client.stream("GET", models_url) as r:
            if r.status_code >= 400:
                raise FlashnextError(f"{shown_url}: could not read the served model (/models answered HTTP "
                                     f"{r.status_code}); {again}")
            raw = bytearray()
            async for piece in r.aiter_bytes():
                raw += piece
                if len(raw) > _MODELS_LIMIT:
                    raise FlashnextError(f"{shown_url}: /models answered more than {_MODELS_LIMIT} bytes; {again}")
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        raise FlashnextError(f"cannot reach {shown_url} ({type(e).__name__}): is the server up?") from None
    except httpx.HTTPError as e:
        raise FlashnextError(f"{shown_url}: could not read the served model from /models "
                             f"({type(e).__name__}); {again}") from None
    try:
        doc = parse_strict(bytes(raw), "/models")
    except Malformed as e:
        raise FlashnextError(f"{shown_url}: {e}; {again}") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    model = first.get("id") if isinstance(first, dict) else None
    if not isinstance(model, str) or not model or len(model) > _MODEL_NAME_LIMIT or not model.isprintable():
        why = ("no data[0].id" if first is None or model is None else
               f"data[0].id is {_json_type(model)}, not a model name" if not isinstance(model, str) else
               "data[0].id is not a printable name of at most 1024 characters")
        raise FlashnextError(f"{shown_url}: /models gives {why}; {again}")
    return model


# -- URLs and their credentials -------------------------------------------------------------------

_HIDDEN = "***"
# Shorter values would match everywhere in a report; the URL itself is always redacted structurally.
_MIN_SECRET = 4


def redact_url(url: str) -> str:
    """``url`` with its user info and every query value (and fragment) replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a URL that cannot be parsed)"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{_HIDDEN}@{netloc.rsplit('@', 1)[1]}"
    query = "&".join(f"{p.split('=', 1)[0]}={_HIDDEN}" if "=" in p else _HIDDEN
                     for p in parts.query.split("&") if p) if parts.query else ""
    shown = f"{parts.scheme}://{netloc}{parts.path}" if parts.scheme else f"{netloc}{parts.path}"
    return shown + (f"?{query}" if query else "") + (f"#{_HIDDEN}" if parts.fragment else "")


def url_secrets(url: str) -> set[str]:
    """What of ``url`` must never be shown, as given and percent-decoded."""
    try:
        parts = urlsplit(url)
        values = [parts.username, parts.password, parts.fragment]
        values += [v for p in parts.query.split("&") for v in p.split("=", 1)[1:]]
        values += [v for _, v in parse_qsl(parts.query)]
    except ValueError:
        return set()
    found = {v for v in values if v} | {unquote(v) for v in values if v}
    return {v for v in found if len(v) >= _MIN_SECRET}


def scrub(text: str, secrets: set[str]) -> str:
    """``text`` with every secret replaced by ``***`` (longest first, so no part of one survives)."""
    for s in sorted(secrets, key=len, reverse=True):
        text = text.replace(s, _HIDDEN)
    return text


def check_url(url: str) -> None:
    """One line (with the URL redacted) unless ``url`` is an http(s) URL with a host."""
    if "://" not in url:  # `localhost:8000` parses as the scheme "localhost"
        bare = ("***@" + url.rsplit("@", 1)[1]) if "@" in url else url
        raise FlashnextError(f"{bare} has no scheme: give http://{bare} (or https://)")
    shown = redact_url(url)
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError):
        raise FlashnextError(f"{shown} is not a valid URL") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise FlashnextError(f"{shown}: give an http:// or https:// URL with a host")
