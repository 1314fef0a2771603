"""int8-modules' LM head through vLLM's own kernel chooser (issue 28: where a library kernel wins,
call it). vLLM 0.34.0's ``qwen4_exp`` model is built on the CPU as a 3090 (sm86) and an H200 (sm90)
would build it; the stand-ins are named in support/int8_lm_head_scenario.py."""

import pytest

from support import SUPPORT_DIR, free_port, run_scenario

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(patched_tree, demo_snapshot) -> dict:
    script = (SUPPORT_DIR / "int8_lm_head_scenario.py").read_text()
    env = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
    return run_scenario(script, (str(demo_snapshot), free_port()), str(patched_tree), env)


def test_the_lm_head_gets_the_kernel_vllms_chooser_picks(served):
    assert served["kernels"] == {
        "86": ["Int8EmbeddingMethod", "MarlinLinearKernel"],   # the 3090: Marlin, as for vLLM's own INT8 layers
        "90": ["Int8EmbeddingMethod", "MacheteLinearKernel"],  # Hopper
        "cpu": ["Int8EmbeddingMethod", "int8_matmul"],         # no INT8 kernel on the CPU: flashnext's
        "86, switch flashnext": [None, "int8_matmul"],         # VLLM_INT8_LM_HEAD_KERNEL=flashnext
    }


def test_vllms_scheme_loads_the_checkpoint_and_computes_the_logits(served):
    assert served["scheme"] == "CompressedTensorsWNA16"
    params = served["parameters"]
    assert params["weight_packed"][0] == "torch.int32" and params["weight_packed"][2] == "PackedvLLMParameter"
    assert params["weight_scale"][2] == "GroupQuantScaleParameter"
    assert served["words_equal"] and served["scales_equal"]  # vLLM's loader put the checkpoint's words in place
    assert served["logits_shape"][0] == 3
    assert served["logits_max_error"] <= 1e-3  # the same bf16 weights; summation order only
