"""What to change when a failure's cause is known: the one table of known causes and their advice.

A failed request is counted by phase and kind (``http`` with its status); when a group matches a
row of :data:`KNOWN_CAUSES`, the report, the page and the command's output say what to change,
so that a cause a user can fix in one option does not hide behind a count.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KnownCause:
    """A failure group this row explains: its ``kind``, and where given, its phase, HTTP status,
    ``--structured-format`` and words of the server's message (any one of them, lower case)."""

    kind: str
    advice: str
    phases: tuple[str, ...] = ()
    statuses: tuple[int, ...] = ()
    structured_format: str | None = None
    words: tuple[str, ...] = ()

    def explains(self, phase: str, kind: str, status: int | None, details: list[str], structured_format: str) -> bool:
        if kind != self.kind or (self.phases and phase not in self.phases):
            return False
        if self.statuses and status not in self.statuses:
            return False
        if self.structured_format is not None and structured_format != self.structured_format:
            return False
        return not self.words or any(w in d.lower() for d in details for w in self.words)


# First match wins: the specific rows come before the general ones of the same kind.
KNOWN_CAUSES: tuple[KnownCause, ...] = (
    # llama.cpp's server refuses OpenAI's json_schema response_format: 422, or (llama-cpp-python 0.3.36)
    # 500 with "Input should be 'text' or 'json_object'" about body.response_format.type.
    *(KnownCause("http", f"the server refused response_format {fmt}: pass --structured-format {other} ({who})",
                 phases=("structured",), statuses=statuses, structured_format=fmt, words=words)
      for fmt, other, who in (("json_schema", "json_object", "llama.cpp's server takes that"),
                              ("json_object", "json_schema", "vLLM's and OpenAI's"))
      for statuses, words in (((400, 422), ()), ((500,), ("response_format",)))),
    # vLLM: "This model's maximum context length is N tokens"; llama.cpp: "exceeds the context window".
    KnownCause("http", "a prompt is longer than the server's context: lower --prompt-tokens/--needle-tokens, or "
               "serve a longer --max-model-len", statuses=(400, 413, 422),
               words=("context length", "context window", "maximum context", "too long")),
    KnownCause("http", "the server does not know the model or the path: pass --model NAME (one of its /v1/models) "
               "and check the URL", statuses=(404,)),
    KnownCause("http", "the server wants credentials: put them in the URL (https://user:pass@host/ or "
               "?api_key=...)", statuses=(401, 403)),
    KnownCause("http", "the server refused the request body: if --extra-body carries fields it does not take, "
               "drop them", statuses=(400, 422)),
    KnownCause("http", "the server is overloaded: lower --concurrency/--decode-concurrency", statuses=(429, 503)),
    KnownCause("http", "the server failed on its side: see its log for the error", statuses=(500, 502, 504)),
    KnownCause("connect", "no connection: is the server up, and is URL its address (it went away mid-run?)"),
    KnownCause("timeout", "requests ran past --request-timeout: raise it (a long prompt on a small rig takes minutes)"),
    KnownCause("stall", "the stream went silent for --stall-timeout seconds: raise it if the server is just slow "
               "(a long prefill), else see the server's log"),
    KnownCause("dropped", "the server closed streams mid-answer: see its log (a crash, out of memory)"),
    # llama.cpp's server with one slot ends a second concurrent request with a bare [DONE].
    KnownCause("empty", "answers without a token: a server with one slot (llama.cpp's) ends concurrent requests "
               "so; give it more slots (or --interrupt_requests False), or lower the concurrency"),
)


def advice_for(phase: str, kind: str, status: int | None, details: list[str], structured_format: str) -> str | None:
    """What to change for this failure group, or None when its cause is not known."""
    for cause in KNOWN_CAUSES:
        if cause.explains(phase, kind, status, details, structured_format):
            return cause.advice
    return None
