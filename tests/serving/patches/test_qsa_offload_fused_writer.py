"""Patch qsa-offload with vLLM 0.34.0's fused QSA writer (issue 40, item 8): the release's
dimensions take ``qsa_prepare``, which stores the main K/V in the same launch as the indexer's
prepare, and with the offload it stores them into the pinned host rows. The demo's 32-dim indexer
takes the unfused writer (tests/serving/patches/test_qsa_offload.py), so this runs the demo at the
smallest dims that take the fused one, through the Triton interpreter; the scenario's docstring
names what is vLLM's and what is stood in for."""

import pytest

from support import SUPPORT_DIR, free_port, run_scenario

pytestmark = pytest.mark.slow  # minutes in all on 2 cores: tests/conftest.py sends it to a worker first

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")

KV_BYTES = 4_000_000
ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1", "VLLM_QSA_KV_OFFLOAD": "1"}


@pytest.fixture(scope="module")
def served(patched_tree, demo_snapshot) -> dict:
    script = (SUPPORT_DIR / "qsa_offload_fused_writer_scenario.py").read_text()
    return run_scenario(script, (str(demo_snapshot), free_port(), str(KV_BYTES)), str(patched_tree), ENV)


def test_vllm_selects_the_fused_writer_at_these_dims(served):
    """vLLM's own condition, at layer build: an indexer head of 128 and a RoPE of 64 dims (here
    the demo's 64-dim heads rotated whole, the release's 256-dim heads a quarter); the main heads
    stay the demo's, so a host row is still 2 x (64 + 64) bf16."""
    assert served["fused_writer"] is True
    assert served["dims"] == dict(indexer_head_dim=128, rotary_dim=64, head_dim=64, kv_heads=2)
    assert served["host_rows"][2:] == [2, 128] and served["host_is_the_pool"]
    # every step went through qsa_prepare, and it was handed the offload's host rows as the main cache
    assert served["fused_launches"] == [True, True, True]


def test_the_fused_kernel_writes_exactly_the_rows_the_offload_names(served):
    """A prefill of two prompts, a chunk crossing from request 0's first block (5) into its second
    (2) beside a decode of request 1 (block 7), then a decode of each. In each step the rows of the
    pool that changed are exactly the slots computed from the block ids and positions (which are
    the slots the offload's metadata hands the kernel), the unfused writer on the same inputs
    changes the same rows, and the values are its bit for bit; the keys differ from its by the
    rounding of norm and RoPE in one fp32 pass against vLLM's eager bf16 steps."""
    steps = served["steps"]
    assert [s["tokens"] for s in steps] == [37 + 21, 8 + 1, 2]
    assert [s["blocks"] for s in steps] == [[5, 7], [2, 5, 7], [2, 7]]
    for step in steps:
        assert step["offload_slots_expected"] and step["changed_rows"] and step["unfused_changed_rows"]
        assert step["values_as_unfused"] and step["gate_as_eager"]
        assert step["key_ulps_from_unfused"] <= 2 and step["query_ulps_from_eager"] <= 3


def test_the_offloaded_attention_reads_what_the_fused_kernel_wrote(served):
    """The fused launch's query and gate, attending over the host rows it wrote, against a torch
    reference over the rows the expected slots hold; the selection is vLLM's indexer's (its Triton
    logits and expansion kernels, the top-k stood in for): the prompts are under its 2,048-token
    budget, so every earlier position."""
    assert max(served["attention_errors"]) <= 2 ** -6
    assert served["selection_counts"] == [p + 1 for p in served["positions"]]
