import json
import re

import torch
from click.testing import CliRunner
from safetensors import safe_open

from flashnext.quant.demo import DEMO_TEXT_CONFIG
from flashnext.quant.formats.packing import packed_words, unpack_int32
from flashnext.tools.cli import main as cli


def test_byte_identical_on_every_run(demo_snapshot, tmp_path):
    result = CliRunner().invoke(cli, ["demo-checkpoint", "--out", str(tmp_path / "again"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["shards"] == 5
    again = tmp_path / "again"
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in demo_snapshot.iterdir())
    for p in demo_snapshot.iterdir():
        assert (again / p.name).read_bytes() == p.read_bytes(), p.name


def test_refuses_existing_out_without_force(demo_snapshot):
    result = CliRunner().invoke(cli, ["demo-checkpoint", "--out", str(demo_snapshot)])
    assert result.exit_code != 0 and "already exists" in result.output


def test_config_is_qwen4_exp_with_text_config(demo_snapshot):
    cfg = json.loads((demo_snapshot / "config.json").read_text())
    assert cfg["model_type"] == "qwen4_exp"
    assert cfg["architectures"] == ["Qwen4ExpForConditionalGeneration"]
    tc = cfg["text_config"]
    assert tc["model_type"] == "qwen4_exp_text"
    for key in ("num_experts", "moe_intermediate_size", "hidden_size", "ple_layer_ids",
                "ngram_vocab_size_base", "split_ngram_parts", "mtp_num_hidden_layers", "layer_types"):
        assert key in tc
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert "re:^mtp\\..*" in qc["ignore"]


def _tensors(snapshot):
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())["weight_map"]
    files = {f: safe_open(snapshot / f, "pt") for f in set(index.values())}
    return index, lambda name: files[index[name]].get_slice(name)


def test_release_layout(demo_snapshot):
    index, get = _tensors(demo_snapshot)
    assert len(set(index.values())) >= 4
    H, E, I = DEMO_TEXT_CONFIG["hidden_size"], DEMO_TEXT_CONFIG["num_experts"], DEMO_TEXT_CONFIG["moe_intermediate_size"]
    # MTP experts fused, BF16, as the BF16 release stores them
    assert get("mtp.layers.0.mlp.experts.gate_up_proj").get_shape() == [E, 2 * I, H]
    assert get("mtp.layers.0.mlp.experts.down_proj").get_shape() == [E, H, I]
    assert get("mtp.layers.0.mlp.experts.down_proj").get_dtype() == "BF16"
    # routed experts INT4 g128, INT6 g64 dense, INT8 g64 and g128
    cases = {
        "model.language_model.layers.0.mlp.experts.3.down_proj": (4, 128),
        "model.language_model.layers.0.linear_attn.in_proj_qkv": (6, 64),
        "model.language_model.layers.3.self_attn.o_proj": (6, 64),
        "model.language_model.layers.2.mlp.shared_expert.up_proj": (6, 64),
        "model.language_model.layers.1.attn_hyper_connection.input_mix_weight_up": (8, 64),
        "lm_head": (8, 128),
        "model.language_model.embed_tokens": (8, 128),
        "model.language_model.layers.1.ple.key_proj": (8, 128),
        "model.language_model.layers.3.self_attn.indexer.index_qk_proj": (8, 128),
    }
    for module, (bits, gs) in cases.items():
        n, k = get(f"{module}.weight_shape")[:].tolist()
        packed = get(f"{module}.weight_packed")
        assert packed.get_dtype() == "I32"
        assert packed.get_shape() == [n, packed_words(k, bits)], module
        assert get(f"{module}.weight_scale").get_shape() == [n, k // gs], module
        codes = unpack_int32(packed[:], bits, k)
        assert int(codes.min()) >= -(1 << (bits - 1)) and int(codes.max()) < 1 << (bits - 1)
    # BF16 modules kept out by ignore
    for name in ("model.language_model.layers.0.mlp.gate.weight",
                 "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight",
                 "model.visual.blocks.0.attn.qkv.weight", "mtp.fc_embedding.weight"):
        assert get(name).get_dtype() == "BF16", name


def test_weights_are_heavy_tailed(demo_snapshot):
    _, get = _tensors(demo_snapshot)
    w = get("mtp.layers.0.mlp.experts.gate_up_proj")[:].float().flatten()
    z = (w - w.mean()) / w.std()
    kurtosis = float((z ** 4).mean())
    assert kurtosis > 5, kurtosis  # a Gaussian has 3


def test_ple_shards_follow_the_layout(demo_snapshot):
    from flashnext.quant.ple.layout import ple_layout

    index, get = _tensors(demo_snapshot)
    layout = ple_layout(DEMO_TEXT_CONFIG)
    shards = sorted((n for n in index if re.search(r"ngram_embedding\.shard_\d+\.weight$", n)),
                    key=lambda n: int(re.search(r"shard_(\d+)", n)[1]))
    assert len(shards) == layout.split_parts
    assert sum(get(n).get_shape()[0] for n in shards) == layout.padded_rows
    sizes = get("model.language_model.layers.1.ple.ple_embedding.ngram_heads_vocab_sizes")[:]
    assert sizes.dtype == torch.int64 and tuple(sizes.tolist()) == layout.head_sizes


def test_the_draft_head_reads_the_targets_int8_embed_tokens_and_lm_head(demo_snapshot):
    """As in the release (``mtp_use_dedicated_embeddings: false``), the MTP head stores no embedding
    or LM head of its own: vLLM's ``Qwen4ExpMTP`` loads ``model.language_model.embed_tokens.*`` and
    ``lm_head.*``, the INT8 g128 tensors, which the ``ignore`` that keeps ``mtp.*`` BF16 leaves alone."""
    cfg = json.loads((demo_snapshot / "config.json").read_text())
    assert cfg["text_config"]["mtp_use_dedicated_embeddings"] is False
    index, get = _tensors(demo_snapshot)
    assert not [n for n in index if n.startswith("mtp.") and re.search(r"embed_tokens|shared_head|lm_head", n)]
    ignore = [re.compile(p[3:]) for p in cfg["quantization_config"]["ignore"]]
    for module in ("model.language_model.embed_tokens", "lm_head"):
        assert get(f"{module}.weight_packed").get_dtype() == "I32"
        assert get(f"{module}.weight_scale").get_shape() == [4096, 256 // 128]
        assert not any(p.fullmatch(module) for p in ignore)
