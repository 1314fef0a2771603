"""Which of vLLM's linear layers the bit-plane overlay's record makes bit-plane (int6-bitplane)."""
from types import SimpleNamespace

import pytest

from flashnext.errors import FlashnextError
from flashnext.quant.formats.bitplane import LAYOUT
from flashnext.serving.hooks.int6_bitplane import bitplane_parts, recorded_modules

MAPPING = {"gate_up_proj": ["gate_proj", "up_proj"], "qkv_proj": ["q_proj", "k_proj", "v_proj"]}
RECORD = {"model.language_model.layers.0.mlp.shared_expert.gate_proj",
          "model.language_model.layers.0.mlp.shared_expert.up_proj",
          "model.language_model.layers.0.mlp.shared_expert.down_proj",
          "model.language_model.layers.1.self_attn.q_proj"}


def test_vllm_names_match_the_checkpoint_names():
    vllm = "language_model.model.layers.0.mlp.shared_expert."
    assert bitplane_parts(vllm + "gate_up_proj", MAPPING, RECORD)  # merged: every part listed
    assert bitplane_parts(vllm + "down_proj", MAPPING, RECORD)
    assert not bitplane_parts("language_model.model.layers.1.mlp.shared_expert.down_proj", MAPPING, RECORD)
    assert not bitplane_parts("mtp.layers.0.mlp.shared_expert.down_proj", MAPPING, RECORD)  # the draft head is not
    assert not bitplane_parts("language_model.lm_head", MAPPING, RECORD)


def test_a_merged_layer_listed_in_part_is_refused():
    with pytest.raises(FlashnextError, match="only some of"):
        bitplane_parts("language_model.model.layers.1.self_attn.qkv_proj", MAPPING, RECORD)


def test_the_record_is_read_from_config_and_its_layout_checked():
    config = SimpleNamespace(flashnext={"int6_bitplane": {"layout": LAYOUT, "modules": sorted(RECORD)}})
    assert recorded_modules(config) == RECORD
    assert recorded_modules(SimpleNamespace()) == set()
    with pytest.raises(FlashnextError, match="layout"):
        recorded_modules(SimpleNamespace(flashnext={"int6_bitplane": {"layout": "other/2", "modules": []}}))
