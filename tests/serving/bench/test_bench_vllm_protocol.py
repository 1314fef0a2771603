"""``flashnext bench`` speaks vLLM 0.34.0's own chat protocol: every request it sends validates as
vLLM's ``ChatCompletionRequest``, and it reads streams serialized by vLLM's own response classes
(the way vLLM's chat server writes them). The bytes come through httpx's transport hook: a vLLM
server cannot run on this machine, its protocol classes can.
"""

import asyncio
import random

import httpx
import pytest

from flashnext.serving.bench import Settings, workloads
from flashnext.serving.bench.client import stream_chat
from flashnext.serving.bench.runner import Bench, Endpoint
from flashnext.serving.bench.report import Capabilities, Scale

protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
from vllm.entrypoints.generate.base.protocol import DeltaMessage  # noqa: E402
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, UsageInfo  # noqa: E402


def _settings(**kw):
    base = dict(prompt_tokens=[64], concurrency=[1], decode_concurrency=[1], decode_tokens=8, ttft_max_tokens=4,
                warmup=0, repeats=1, needle_tokens=[128], needle_depths=[0.5], needle_concurrency=1,
                needle_max_tokens=8, structured_requests=1, structured_concurrency=1, structured_max_tokens=64,
                structured_format="json_schema", top_logprobs=5, seed=0, request_timeout_s=10, stall_timeout_s=5,
                phases=["decode"], extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    return Settings(**(base | kw))


def _endpoint():
    ep = Endpoint("this run", "http://vllm", "Qwen/Qwen3.8-Flash-Next")
    ep.caps = Capabilities(ignore_eos=True, logprobs=True, usage=True)
    ep.scale = Scale(chars_per_token=4.0, template_tokens=10, measured=True)
    return ep


def test_every_request_the_bench_builds_is_a_valid_vllm_request():
    bench = Bench(_settings(), ["http://vllm"])
    ep = _endpoint()
    scale = ep.text_scale
    bodies = [
        bench.body(ep, workloads.latency_prompt(64, scale, 0, 0), 4),
        bench.body(ep, workloads.decode_prompt(0), 8, run_to_length=True, logprobs=True),
        bench.body(ep, workloads.needle_prompt(128, 0.5, scale, 0).prompt, 8),
        bench.body(ep, workloads.structured_prompt(0), 64,
                    response_format=workloads.structured_response_format("json_schema")),
    ]
    # multiturn's later turns (the answers so far, then tool output) and an images request
    rng = random.Random(0)
    conversation = [*workloads.agent_first_turn(256, scale, rng), {"role": "assistant", "content": "I will read it."},
                    workloads.agent_next_turn(64, scale, rng)]
    bodies.append(bench.body(ep, conversation, 753, run_to_length=True))
    image = workloads.image_data_url(0, 64, 32, 0)
    bodies.append(bench.body(ep, workloads.image_messages(image), 16))
    for body in bodies:
        request = protocol.ChatCompletionRequest.model_validate({**body, "stream": True})
        assert request.temperature == 0 and request.seed == 0
    [image_part, _] = protocol.ChatCompletionRequest.model_validate({**bodies[-1], "stream": True}).messages[0]["content"]
    assert image_part["type"] == "image_url" and image_part["image_url"]["url"] == image
    decode = protocol.ChatCompletionRequest.model_validate({**bodies[1], "stream": True})
    assert (decode.ignore_eos, decode.min_tokens, decode.logprobs, decode.top_logprobs) == (True, 8, True, 5)
    assert decode.stream_options.include_usage
    structured = protocol.ChatCompletionRequest.model_validate({**bodies[3], "stream": True})
    assert structured.extract_structured_outputs().json == workloads.STRUCTURED_SCHEMA


def _vllm_stream(chunks: list) -> bytes:
    """What vLLM's chat server writes for these chunks (serving.py: exclude_unset, then [DONE])."""
    out = []
    for c in chunks:
        data = (c.model_dump_json() if isinstance(c, ErrorResponse)
                else c.model_dump_json(exclude_unset=True, exclude_none=not c.choices))
        out.append(f"data: {data}\n\n")
    out.append("data: [DONE]\n\n")
    return "".join(out).encode()


def _lp(token, logprob):
    return protocol.ChatCompletionLogProbsContent(
        token=token, logprob=logprob, top_logprobs=[protocol.ChatCompletionLogProb(token=token, logprob=logprob),
                                                   protocol.ChatCompletionLogProb(token="zz", logprob=-4.0)])


def _choice(delta, logprobs=None, finish=None):
    kw = {"index": 0, "delta": delta}
    if logprobs is not None:
        kw["logprobs"] = protocol.ChatCompletionLogProbs(content=logprobs)
    if finish:
        kw["finish_reason"] = finish
    return protocol.ChatCompletionResponseStreamChoice(**kw)


def _chunk(*choices, usage=None):
    kw = {"model": "m", "choices": list(choices)}
    if usage:
        kw["usage"] = usage
    return protocol.ChatCompletionStreamResponse(**kw)


def _read(body: bytes):
    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=body))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_chat(client, "http://vllm/v1/chat/completions", {"model": "m"}, request_timeout=10)

    return asyncio.run(go())


def test_a_vllm_stream_with_reasoning_speculative_chunks_and_usage():
    body = _vllm_stream([
        _chunk(_choice(DeltaMessage(role="assistant", content=""))),
        _chunk(_choice(DeltaMessage(reasoning="Thinking"), [_lp("Thinking", -0.1)])),
        # MTP: one step accepted two draft tokens, so one chunk carries three tokens.
        _chunk(_choice(DeltaMessage(content="Hello world!"), [_lp("Hello", -0.2), _lp(" world", -0.3), _lp("!", -0.4)])),
        _chunk(_choice(DeltaMessage(content=""), finish="length")),
        _chunk(usage=UsageInfo(prompt_tokens=12, completion_tokens=4, total_tokens=16)),
    ])
    got = _read(body)
    assert got.ok, got.error_detail
    assert got.text == "Hello world!"
    assert [t.token for t in got.logprobs] == ["Thinking", "Hello", " world", "!"]
    assert got.logprobs[2].top == {" world": -0.3, "zz": -4.0}
    assert (got.prompt_tokens, got.completion_tokens, got.n_tokens, got.finish_reason) == (12, 4, 4, "length")
    assert len(got.token_times_s) == 4 and len(got.itl_s) == 3


def test_a_vllm_error_chunk_is_reported_as_an_http_error():
    error = ErrorResponse(error=ErrorInfo(message="structured output grammar failed", type="BadRequestError", code=400))
    got = _read(_vllm_stream([_chunk(_choice(DeltaMessage(role="assistant", content=""))), error]))
    assert not got.ok and got.error == "http" and "grammar failed" in got.error_detail
