"""``flashnext bench`` against llama.cpp's server (``llama-cpp-python``) on loopback: the server
that returns top-k logprobs and constrains answers with a JSON-schema grammar, so token agreement,
KL divergence and "every structured answer validates" are measured on a real server's output.

The A/B pair: the same tiny model (tests/support/chat_server.py) and a copy with 0.2% noise on its
weights, the kind of difference a quantized or patched build makes.
"""

import json

import jsonschema
import pytest
from click.testing import CliRunner

from flashnext.tools.cli import main
from support import ROOT
from support.chat_server import LlamaCppServer, build_tiny_gguf

pytestmark = pytest.mark.slow
pytest.importorskip("llama_cpp.server", reason="pip install 'llama-cpp-python[server]' (tests' extra; .ci/run does)")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-cpp")
    a = build_tiny_gguf(root / "a.gguf", seed=0)
    b = build_tiny_gguf(root / "b.gguf", seed=0, perturb=0.002)
    with LlamaCppServer(a, root / "a.log") as sa, LlamaCppServer(b, root / "b.log") as sb:
        yield sa, sb


def test_a_b_with_logprobs_kl_and_grammar_constrained_answers(servers, tmp_path):
    a, b = servers
    out = tmp_path / "run"
    done = CliRunner().invoke(main, [
        "bench", a.url, "--against", b.url, "--out", str(out), "--prompt-tokens", "128", "--concurrency", "1,2",
        "--decode-concurrency", "1,2", "--decode-tokens", "48", "--ttft-max-tokens", "8", "--repeats", "2",
        "--needle-tokens", "512", "--needle-depths", "0.5", "--needle-max-tokens", "8",
        "--structured-requests", "4", "--structured-concurrency", "2", "--structured-format", "json_object",
        "--structured-max-tokens", "512", "--top-logprobs", "5", "--no-progress"])
    assert done.exit_code == 0, done.output
    report = json.loads((out / "report.json").read_text())
    jsonschema.validate(report, json.loads((ROOT / "manifests" / "bench-report.schema.json").read_text()))
    for e in report["endpoints"]:
        assert e["errors"] == {}, e["error_samples"]
        # llama-cpp-python streams no usage: prompt lengths fall back to 4 characters a token (noted).
        assert e["capabilities"]["logprobs"] and not e["capabilities"]["usage"]
        # Grammar-constrained: every answer is JSON that follows the schema.
        assert e["structured"] == {"requests": 4, "concurrency": 2, "valid": 4, "invalid": [], "failed": 0}
        answers = [g for g in e["greedy_answers"]]
        assert answers and all(len(g["tokens"]) == 48 and len(g["top_logprobs"][0]) == 5 for g in answers)
    assert any("no prompt token counts" in n for n in report["notes"])
    ab = report["ab"]
    # The same server twice: identical, and KL zero to rounding.
    floor = ab["noise_floor"]
    assert floor["by"] == "tokens" and floor["identical"] == floor["answers"] == 3
    assert floor["mean_kl_nats"] == pytest.approx(0.0, abs=1e-6)
    # A nearby model: mostly the same tokens, a small positive KL before each divergence.
    got = ab["agreement"]
    assert got["by"] == "tokens" and got["answers"] == 6 and got["kl_positions"] > 0
    assert 0 < got["mean_kl_nats"] < 0.1 and got["mean_first_divergence"] > 1
    assert got["matching_fraction"] > 0.2
    assert "mean KL" in done.output


def test_its_refusal_of_json_schema_says_to_pass_json_object(servers, tmp_path):
    a, _ = servers
    out = tmp_path / "run"
    done = CliRunner().invoke(main, [
        "bench", a.url, "--out", str(out), "--phases", "structured", "--structured-requests", "2",
        "--structured-concurrency", "1", "--structured-max-tokens", "64", "--no-progress"])
    assert done.exit_code == 0, done.output
    [group] = json.loads((out / "report.json").read_text())["endpoints"][0]["failures"]
    assert (group["phase"], group["kind"], group["count"]) == ("structured", "http", 2)
    assert "--structured-format json_object" in group["advice"]
    assert "what to change: this run, structured: 2 http" in done.output
