"""Which of vLLM's linear layers the bit-plane overlay's record makes bit-plane (int6-bitplane)."""
import pytest

from flashnext.errors import FlashnextError
from flashnext.quant.formats.bitplane import LAYOUT
from flashnext.serving.hooks.int6_bitplane import bitplane_parts, recorded_modules

pytest.importorskip("vllm", reason="vLLM 0.33.0 is installed by .ci/run")

MAPPING = {"gate_up_proj": ["gate_proj", "up_proj"], "qkv_proj": ["q_proj", "k_proj", "v_proj"]}
RECORD = {"model.language_model.layers.0.mlp.shared_expert.gate_proj",
          "model.language_model.layers.0.mlp.shared_expert.up_proj",
          "model.language_model.layers.0.mlp.shared_expert.down_proj",
          "model.language_model.layers.1.self_attn.q_proj"}


@pytest.fixture(scope="module")
def mapper():
    """The rename mapper vLLM applies for the release's model class."""
    from vllm.model_executor.models import ModelRegistry

    cls = ModelRegistry._try_load_model_cls("Qwen4ExpForConditionalGeneration")
    return cls.hf_to_vllm_mapper.get_rename_mapper()


def test_vllm_names_match_the_checkpoint_names(mapper):
    vllm = "language_model.model.layers.0.mlp.shared_expert."
    assert bitplane_parts(vllm + "gate_up_proj", MAPPING, RECORD, mapper)  # merged: every part listed
    assert bitplane_parts(vllm + "down_proj", MAPPING, RECORD, mapper)
    assert not bitplane_parts("language_model.model.layers.1.mlp.shared_expert.down_proj", MAPPING, RECORD, mapper)
    assert not bitplane_parts("mtp.layers.0.mlp.shared_expert.down_proj", MAPPING, RECORD, mapper)  # not the draft's
    assert not bitplane_parts("language_model.lm_head", MAPPING, RECORD, mapper)
    # Without the model's mapper the checkpoint's names are not vLLM's.
    assert not bitplane_parts(vllm + "down_proj", MAPPING, RECORD)


def test_a_merged_layer_listed_in_part_is_refused(mapper):
    with pytest.raises(FlashnextError, match="only some of"):
        bitplane_parts("language_model.model.layers.1.self_attn.qkv_proj", MAPPING, RECORD, mapper)


def test_the_record_is_read_from_config_and_its_layout_checked():
    from transformers import PretrainedConfig

    config = PretrainedConfig(flashnext={"int6_bitplane": {"layout": LAYOUT, "modules": sorted(RECORD)}})
    assert recorded_modules(config) == RECORD
    assert recorded_modules(PretrainedConfig()) == set()
    with pytest.raises(FlashnextError, match="layout 'other/2'"):
        recorded_modules(PretrainedConfig(flashnext={"int6_bitplane": {"layout": "other/2", "modules": []}}))
    with pytest.raises(FlashnextError, match="modules must be a list"):
        recorded_modules(PretrainedConfig(flashnext={"int6_bitplane": {"layout": LAYOUT, "modules": "x"}}))
