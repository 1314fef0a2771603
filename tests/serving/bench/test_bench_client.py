"""The client's boundary with the server, in pieces: URLs with credentials, and the stream's limits."""

import asyncio

import httpx
import pytest

from flashnext.serving.bench import client
from flashnext.serving.bench.client import redact_url, scrub, stream_chat, url_secrets
from flashnext.serving.bench.runner import chat_url, models_url


@pytest.mark.parametrize("url, shown", [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("http://u:p%40ss@host:8000/v1", "http://***@host:8000/v1"),
    ("https://tok@host/v1?api_key=sk-1&api-version=2024", "https://***@host/v1?api_key=***&api-version=***"),
    ("http://host/v1?bare#frag", "http://host/v1?***#***"),
])
def test_a_url_is_shown_without_its_credentials(url, shown):
    assert redact_url(url) == shown


def test_the_secrets_of_a_url_are_scrubbed_as_given_and_decoded():
    secrets = url_secrets("http://alice:p%40ssword@host/v1?api_key=sk%2Dsecret")
    assert {"alice", "p%40ssword", "p@ssword", "sk%2Dsecret", "sk-secret"} <= secrets
    assert scrub("401 for alice with p@ssword and sk-secret", secrets) == "401 for *** with *** and ***"


@pytest.mark.parametrize("base, chat, models", [
    ("http://h:1", "http://h:1/v1/chat/completions", "http://h:1/v1/models"),
    ("http://h:1/v1/?api_key=k", "http://h:1/v1/chat/completions?api_key=k", "http://h:1/v1/models?api_key=k"),
    ("http://h:1/v1/chat/completions?x=1", "http://h:1/v1/chat/completions?x=1", "http://h:1/v1/models?x=1"),
])
def test_the_endpoints_keep_the_query_of_the_url(base, chat, models):
    assert (chat_url(base), models_url(base)) == (chat, models)


def _read(content, body=None):
    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=content))

    async def go():
        async with httpx.AsyncClient(transport=transport) as c:
            return await stream_chat(c, "http://s/v1/chat/completions", body or {"max_tokens": 4}, request_timeout=10)

    return asyncio.run(go())


def test_a_line_that_never_ends_is_read_no_further_than_the_limit(monkeypatch):
    monkeypatch.setattr(client, "LINE_LIMIT", 1000)
    sent = []

    async def endless():
        while True:
            sent.append(100)
            yield b"x" * 100

    got = _read(endless())
    assert (got.error, got.error_detail) == ("too_large", "a line of the stream passed 1000 bytes")
    assert sum(sent) <= 1100


def test_a_line_at_the_limit_is_read(monkeypatch):
    monkeypatch.setattr(client, "LINE_LIMIT", 1000)
    event = b'data: {"choices": [{"delta": {"content": "' + b"y" * 900 + b'"}, "finish_reason": "stop"}]}'
    assert len(event) <= 1000
    got = _read(event + b"\r\n\r\ndata: [DONE]\n\n")
    assert got.ok, got.error_detail
    assert got.text == "y" * 900
