"""Patch qsa-indexer-quant: the release quantizes QSA q/k/v INT6 group 64 and the indexer's
index_qk_proj INT8 group 128; vLLM 0.34.0 merges them into one linear layer that gets q_proj's
scheme (it keeps them apart only when their quant methods are of different types, and
compressed-tensors gives both its CompressedTensorsLinearMethod), and its loader then refuses the
indexer's INT8 tensors. Driven through vLLM's own model,
quantization config, kernel chooser (at sm86, the 3x3090's) and loader on the demo checkpoint,
whose quantization layout is the release's (``quant/demo.py``)."""

import pytest

from support import SUPPORT_DIR, free_port, run_scenario

pytestmark = pytest.mark.slow  # minutes in all on 2 cores: tests/conftest.py sends it to a worker first

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")

ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
INT6_G64, INT8_G128 = [6, 64], [8, 128]


def scenario(tree, demo_snapshot, **env) -> dict:
    script = (SUPPORT_DIR / "qsa_indexer_quant_scenario.py").read_text()
    return run_scenario(script, (str(demo_snapshot), free_port()), tree and str(tree), {**ENV, **env})


@pytest.fixture(scope="module")
def stock(demo_snapshot) -> dict:
    return scenario(None, demo_snapshot)


@pytest.fixture(scope="module")
def patched(patched_tree, demo_snapshot) -> dict:
    return scenario(patched_tree, demo_snapshot)


def test_stock_merges_the_int8_indexer_into_an_int6_layer_and_cannot_load_it(stock):
    # The parts resolve to two schemes, and the merged layer takes the first part's.
    assert stock["schemes"] == {"q_proj": INT6_G64, "k_proj": INT6_G64, "v_proj": INT6_G64,
                                "indexer.index_qk_proj": INT8_G128}
    assert stock["fused"] and stock["index_qk_proj"] is None
    merged = stock["qkv_proj"]
    assert (merged["class"], merged["kernel"], merged["weight_type"], merged["group_size"]) == (
        "Qwen4ExpQSAQKVIndexerLinear", "HummingLinearKernel", "uint6b32", 64)
    assert (merged["k"], merged["n"]) == (256, 768 + 160) and merged["can_implement"] == [True, None]
    # INT8 group-128 words [160, 64] and scales [160, 2] do not fit INT6 group-64 rows [160, 48]/[160, 4].
    assert stock["loaded"].startswith("AssertionError"), stock["loaded"]


def test_patched_gives_the_indexer_its_own_int8_layer_holding_the_checkpoint_weights(patched):
    assert not patched["fused"] and patched["loaded"] is True
    qkv, index = patched["qkv_proj"], patched["index_qk_proj"]
    assert (qkv["class"], qkv["kernel"], qkv["weight_type"], qkv["group_size"], qkv["n"]) == (
        "QKVParallelLinear", "HummingLinearKernel", "uint6b32", 64, 768)
    assert (index["class"], index["kernel"], index["weight_type"], index["group_size"], index["n"]) == (
        "ReplicatedLinear", "MarlinLinearKernel", "uint8b128", 128, 160)
    assert qkv["can_implement"] == [True, None] and index["can_implement"] == [True, None]
    # Against flashnext's own dense unpacking of the checkpoint's tensors, not through the layers.
    assert patched["qkv_rows_equal"] and patched["index_words_equal"] and patched["index_scales_equal"]
    # The indexer projection through its own scheme (vLLM's dequantize + matmul, the CPU route):
    # exact but for the summation order against the bf16-rounded reference weights, and within
    # bf16's dequantization rounding of the fp32 reference.
    assert patched["index_forward_shape"] == [5, 160]
    assert patched["index_forward_max_error_bf16_weights"] < 1e-5
    assert patched["index_forward_max_rel_error"] < 1e-2


def test_switch_off_is_stock(patched_tree, demo_snapshot, stock):
    off = scenario(patched_tree, demo_snapshot, VLLM_QSA_INDEXER_OWN_SCHEME="0")
    assert off == stock


def test_the_merge_stays_where_the_parts_agree():
    """The hook against vLLM's own compressed-tensors config: the release's layout splits, one
    scheme for all four parts (or an unquantized checkpoint) keeps vLLM's merge, and LoRA never merges."""
    import copy
    from types import SimpleNamespace

    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    from flashnext.quant.demo import demo_quantization_config
    from flashnext.serving.hooks import qsa_indexer_quant

    prefix = "language_model.model.layers.3.self_attn"
    plain, lora = SimpleNamespace(lora_config=None), SimpleNamespace(lora_config=object())
    release = CompressedTensorsConfig.from_config(demo_quantization_config())
    assert qsa_indexer_quant.fuse_indexer_projection(plain, release, prefix) is False
    one_scheme = copy.deepcopy(demo_quantization_config())
    one_scheme["config_groups"]["group_1"]["targets"].append(r"re:.*indexer\.index_qk_proj$")
    one_scheme["config_groups"]["group_3"]["targets"].remove(r"re:.*indexer\.index_qk_proj$")
    assert qsa_indexer_quant.fuse_indexer_projection(plain, CompressedTensorsConfig.from_config(one_scheme), prefix)
    assert qsa_indexer_quant.fuse_indexer_projection(plain, None, prefix)
    assert qsa_indexer_quant.fuse_indexer_projection(lora, None, prefix) is False


def test_the_hook_with_its_switch_off_merges_as_vllm_does(monkeypatch):
    from types import SimpleNamespace

    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    from flashnext.quant.demo import demo_quantization_config
    from flashnext.serving.hooks import qsa_indexer_quant

    monkeypatch.setenv("VLLM_QSA_INDEXER_OWN_SCHEME", "0")
    release = CompressedTensorsConfig.from_config(demo_quantization_config())
    assert qsa_indexer_quant.fuse_indexer_projection(SimpleNamespace(lora_config=None), release,
                                                     "language_model.model.layers.3.self_attn")
