"""``flashnext bench`` against a real OpenAI-compatible server: ``transformers serve`` on loopback
with tiny chat models this test builds (tests/support/chat_server.py), started and stopped here.

The models' weights are random, so the needle is never found and no answer is JSON; what is checked
is that the bench measures, scores and reports a real server's streams as they are.
"""

import json

import jsonschema
import pytest
from click.testing import CliRunner

from flashnext.tools.cli import main
from support import ROOT
from support.chat_server import TransformersServer, build_tiny_chat_model

pytestmark = pytest.mark.slow

SCHEMA = json.loads((ROOT / "manifests" / "bench-report.schema.json").read_text())
RUN = ["--prompt-tokens", "96,384", "--concurrency", "1,2", "--decode-concurrency", "1,2", "--decode-tokens", "24",
       "--ttft-max-tokens", "8", "--warmup", "1", "--repeats", "2", "--needle-tokens", "512",
       "--needle-depths", "0.25,0.75", "--needle-concurrency", "2", "--needle-max-tokens", "8",
       "--structured-requests", "4", "--structured-concurrency", "2", "--structured-max-tokens", "16",
       "--no-progress"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two servers whose models differ only in their weights' seed: an A/B with a real difference."""
    root = tmp_path_factory.mktemp("chat-servers")
    a = build_tiny_chat_model(root / "model-a", seed=0)
    b = build_tiny_chat_model(root / "model-b", seed=1)
    with TransformersServer(a, root / "a.log") as sa, TransformersServer(b, root / "b.log") as sb:
        yield sa, sb


def _bench(*args):
    done = CliRunner().invoke(main, ["bench", *args])
    assert done.exit_code == 0, done.output
    return done


def test_a_b_run_against_two_real_servers(servers, tmp_path):
    a, b = servers
    out = tmp_path / "ab"
    # transformers serve's /v1/models fails (HTTP 500) and a pinned server takes only its own name.
    done = _bench(a.url, "--model", str(a.model), "--against", b.url, "--against-model", str(b.model),
                  "--out", str(out), *RUN)
    report = json.loads((out / "report.json").read_text())
    jsonschema.validate(report, SCHEMA)
    assert [e["label"] for e in report["endpoints"]] == ["this run", "against"]
    for e in report["endpoints"]:
        # latency 2 lengths x (1 + 2) x 4 rounds, decode (1 + 2) x 3 rounds, 2 needles, 4 structured
        assert e["errors"] == {} and e["requests"] == 24 + 9 + 2 + 4
        # transformers serve streams usage but refuses ignore_eos and returns no logprobs; the notes say so.
        assert e["capabilities"] == {"ignore_eos": False, "logprobs": False, "usage": True}
        assert e["model"] == str(a.model if e["label"] == "this run" else b.model)
        for p in e["latency"]:
            # The prompt lengths asked for are the lengths the server counted (the probe's scale).
            assert abs(p["measured_prompt_tokens"] - p["prompt_tokens"]) <= 0.1 * p["prompt_tokens"], p
            assert len(p["warm_ttft_samples_s"]) == 2 * p["concurrency"]
            assert len(p["cold_ttft_samples_s"]) == p["concurrency"]
            assert p["itl_s"]["count"] > 0 and 0 < p["itl_s"]["p50"] <= p["itl_s"]["p99"]
        assert [d["concurrency"] for d in e["decode"]] == [1, 2]
        assert all(d["aggregate_tok_s"]["p50"] > 0 and d["failed"] == 0 for d in e["decode"])
        assert [(n["context_tokens"], n["depth"]) for n in e["needle"]] == [(512, 0.25), (512, 0.75)]
        assert all(n["error"] is None and n["found"] is False and n["measured_prompt_tokens"] > 450 for n in e["needle"])
        st = e["structured"]
        assert st["failed"] == 0 and st["valid"] + len(st["invalid"]) == 4
    assert any("no logprobs" in n for n in report["notes"])
    ab = report["ab"]
    # Greedy answers: this run against itself (two rounds) agree; against the other weights they do not.
    assert ab["noise_floor"]["by"] == "characters"
    assert ab["noise_floor"]["identical"] == ab["noise_floor"]["answers"] == 3
    assert ab["agreement"]["answers"] == 6 and ab["agreement"]["identical"] < 6
    assert ab["agreement"]["mean_kl_nats"] is None
    assert any(d["metric"].startswith("decode, ") and d["unit"] == "tok/s" for d in ab["deltas"])
    for name in ("ttft.png", "itl.png", "decode.png", "ab.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (out / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') == 4 and 'src="http' not in html
    assert "this run vs against:" in done.output and "needle: found 0 of 2 answered" in done.output


def test_baseline_compares_with_a_saved_run(servers, tmp_path):
    a, _ = servers
    first = tmp_path / "first"
    _bench(a.url, "--model", str(a.model), "--out", str(first), "--phases", "decode", *RUN)
    done = _bench(a.url, "--model", str(a.model), "--out", str(tmp_path / "second"), "--phases", "decode", "--baseline",
                  str(first / "report.json"), "--json", *RUN)
    result = json.loads(done.output[done.output.index("{"):])
    assert result["summary"]["ab"]["identical"] == result["summary"]["ab"]["answers"] == 6
    report = json.loads((tmp_path / "second" / "report.json").read_text())
    assert report["ab"]["reference"]["name"] == "baseline" and len(report["endpoints"]) == 1


def test_multiturn_and_images_on_a_real_server_without_metrics(servers, tmp_path):
    a, _ = servers
    out = tmp_path / "mt"
    done = _bench(a.url, "--model", str(a.model), "--out", str(out), "--phases", "multiturn,images",
                  "--sessions", "1,2", "--turns", "3", "--first-turn-tokens", "256", "--turn-tokens", "32",
                  "--turn-output-tokens", "8", "--images", "2", "--image-size", "64x64", "--image-prefill-tokens",
                  "512", "--image-max-tokens", "4", "--no-progress")
    report = json.loads((out / "report.json").read_text())
    jsonschema.validate(report, SCHEMA)
    [e] = report["endpoints"]
    for p in e["multiturn"]:
        assert p["failed"] == 0 and p["sessions_completed"] == p["sessions"]
        # The server counted each turn's whole conversation: it grows by the answer and the new message.
        prompts = [t["measured_prompt_tokens"] for t in p["turns"]]
        assert abs(prompts[0] - 256) <= 26 and prompts[1] > prompts[0] + 32 and prompts[2] > prompts[1] + 32, prompts
        assert p["throughput_tok_s"] > 0 and p["per_user_tok_s"]["count"] == 3 * p["sessions"]
        assert p["server"] is None and p["client_in_flight_mean"] > 0
    # A text-only model: every image is answered or refused, and either way reported.
    im = e["images"]
    assert im["answered"] + im["failed"] == 2 and im["prefill_error"] is None
    assert all(r["error"] is None or r["error"].startswith("http") for r in im["requests"])
    # transformers serve has no /metrics: noted, not an error.
    assert e["server_state"]["available"] is False and "/metrics answered HTTP 404" in e["server_state"]["note"]
    assert (out / "multiturn_pareto.png").is_file()
    assert "multiturn x2 sessions" in done.output
