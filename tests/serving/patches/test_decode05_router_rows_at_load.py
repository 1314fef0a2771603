"""decode-05's router rows are made at load, inside vLLM's weights number (issue 40, item 3).

vLLM 0.34.0's own model for the demo checkpoint, built on the CPU, then vLLM's own post-load step
(``model_loader.utils.process_weights_after_loading``, which ends in ``finalize_model_weights``: the
module hooks, where the patched ``Qwen4ExpSparseMoeBlock.process_weights_after_loading`` merges the
rows). Stand-ins, named in the scenario: the routed experts' kernel, bf16 layers with seeded weights.
"""

import pytest

from support import SUPPORT_DIR, free_port, run_scenario

ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}


@pytest.fixture(scope="module")
def scenario():
    return (SUPPORT_DIR / "moe_decode_rows_at_load_scenario.py").read_text()


def test_vllms_post_load_step_merges_every_blocks_router_rows(patched_tree, demo_snapshot, scenario):
    stock = run_scenario(scenario, (str(demo_snapshot), free_port()), None, ENV)
    assert stock["patched"] is False
    assert not any(b["one_storage"] for b in stock["blocks"])  # vLLM's layout: two weights, two storages
    out = run_scenario(scenario, (str(demo_snapshot), free_port()), str(patched_tree), ENV)
    assert out["patched"] is True and len(out["blocks"]) == 4
    for block in out["blocks"]:
        # the router's rows, then the shared gate's, in one [E + 1, H] matrix and nothing else
        assert block["one_storage"] and block["storage_bytes"] == block["matrix_bytes"]
        assert block["gate_offset"] == 0 and block["shared_gate_offset"] == block["experts"] * block["hidden"]
    assert all(out["gate_moved"])  # the merge replaced the weights vLLM loaded, at load
    for step in out["steps"]:
        assert step["fused_path"]
        # before: the first step of 4 tokens or fewer made the matrix (aten.empty), at capture or mid-service
        assert step["new_router_rows"] == [], step
        # what the router kernel read is the merged matrix itself (the interpreter's view of its argument)
        assert step["rows_shaped_views"]
    assert out["gate_unmoved_by_decode"]
