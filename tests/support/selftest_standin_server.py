"""A stand-in for ``vllm serve`` in the selftest's GPU-part tests: vLLM cannot serve on this machine
(no GPU) nor on the GPU machine we have (its vLLM build lacks the CUDA kernels), so the process that
the selftest starts is this one, and only the process is replaced: it gets the selftest's exact
environment, and answers the OpenAI-compatible routes that ``flashnext bench`` uses (streamed chat
completions with usage, top-k logprobs, ignore_eos).

Its answers are a deterministic function of the prompt and position, so that two runs agree token
for token, as a greedy server's do. What a patch's switch would change is told to it by the test:

* ``STANDIN_DIVERGE=NAME=VALUE``: when the environment has NAME=VALUE, every position's logprobs
  shift and answers change after their third token (a patch whose switch changes the output);
* ``STANDIN_REFUSE=NAME=VALUE``: when the environment has NAME=VALUE, exit 1 at startup with a
  ValueError line, as vLLM refuses a configuration.

With ``--model-path``, the directory ``vllm serve`` was given: when its config.json says
``ple_embedding_dtype`` (a quantized PLE table), the test tells it what the format changes:

* ``STANDIN_PLE_SHIFT=X``: the second-ranked logit of every position moves by X (the answers stay;
  the logprobs differ a little, as a table within the format's error moves them);
* ``STANDIN_PLE_REFUSE=1``: exit 1 at startup with a ValueError line (a build that cannot serve it).

``python selftest_standin_server.py --port P --model NAME [--model-path DIR]``
"""

import argparse
import hashlib
import json
import math
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WORDS = [f" w{i}" for i in range(32)]


def _matches(var: str) -> bool:
    spec = os.environ.get(var, "")
    name, _, value = spec.partition("=")
    return bool(name) and os.environ.get(name) == value


def _quantized_ple(model_path: str | None) -> str | None:
    """config.json's ``ple_embedding_dtype`` of the served directory (None: the BF16 table)."""
    if not model_path:
        return None
    try:
        config = json.load(open(os.path.join(model_path, "config.json")))
    except OSError:
        return None
    return (config.get("text_config") or config).get("ple_embedding_dtype")


def _token(prompt: str, i: int, salt: str, shifted: bool, nudge: float = 0.0) -> tuple[str, dict[str, float]]:
    """The i-th token of the answer to ``prompt`` and its top-5 logprobs (``shifted``: the same
    choice from other logits, as a numerically different build gives; ``nudge``: the second
    logit moved by that much)."""
    h = hashlib.sha256(f"{salt}|{prompt}|{i}".encode()).digest()
    ranked = [WORDS[(h[0] + k * 7) % len(WORDS)] for k in range(5)]
    logits = [3.0 - k + (0.8 if shifted and k == 1 else 0.0) + (nudge if k == 1 else 0.0) for k in range(5)]
    z = math.log(sum(math.exp(x) for x in logits) + 2.0)  # the rest of the vocabulary holds a little mass
    return ranked[0], {t: x - z for t, x in zip(ranked, logits)}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the stream ends when the connection closes
    model = "standin"
    diverge = False
    nudge = 0.0

    def log_message(self, *args):
        pass

    def _json(self, status: int, obj: dict) -> None:
        payload = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self):
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        if self.path != "/v1/chat/completions":
            return self._json(404, {"error": {"message": f"no route {self.path}"}})
        if body.get("model") != self.model:
            return self._json(404, {"error": {"message": f"model {body.get('model')!r} is not served"}})
        prompt = json.dumps(body.get("messages"))
        n = int(body.get("max_tokens") or 16)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for i in range(n):
            salt = "switch-off" if self.diverge and i >= 3 else "same"
            text, top = _token(prompt, i, salt, self.diverge, self.nudge)
            choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
            if body.get("logprobs"):
                k = int(body.get("top_logprobs") or 1)
                choice["logprobs"] = {"content": [{"token": text, "logprob": top[text], "top_logprobs": [
                    {"token": t, "logprob": lp} for t, lp in list(top.items())[:k]]}]}
            self._event({"id": "c", "object": "chat.completion.chunk", "model": self.model, "choices": [choice]})
            time.sleep(0.001)
        last = {"id": "c", "object": "chat.completion.chunk", "model": self.model,
                "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        if (body.get("stream_options") or {}).get("include_usage"):
            prompt_tokens = 4 + len(prompt) // 4
            last["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        self._event(last)
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, obj: dict) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--model-path", default=None)
    args = ap.parse_args()
    if _matches("STANDIN_REFUSE"):
        print(f"ValueError: stand-in: this build refuses {os.environ['STANDIN_REFUSE']}", file=sys.stderr)
        return 1
    quantized = _quantized_ple(args.model_path)
    if quantized and os.environ.get("STANDIN_PLE_REFUSE") == "1":
        print(f"ValueError: stand-in: this build cannot serve ple_embedding_dtype {quantized!r}", file=sys.stderr)
        return 1
    Handler.model, Handler.diverge = args.model, _matches("STANDIN_DIVERGE")
    Handler.nudge = float(os.environ.get("STANDIN_PLE_SHIFT", "0")) if quantized else 0.0
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
