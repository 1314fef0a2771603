"""``flashnext plan``: vLLM 0.34.0's own KV cache grouping, checked against seed 000's table and by hand."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashnext.errors import FlashnextError
from flashnext.serving import capacity
from flashnext.serving.profiles import available, load_profile
from flashnext.tools.cli import main as cli

pytest.importorskip("vllm.v1.core.kv_cache_planning", reason="vLLM 0.34.0 is installed by .ci/run")

GIB = 2**30


def seed_plan(profile: str, kv_bytes: int, prefix_caching: bool) -> capacity.Plan:
    shape = capacity.ServingShape.from_profile(load_profile(profile), kv_bytes, prefix_caching)
    return capacity.plan(capacity.load_text_config(), shape)


# seed 000 §2 and §7 (docs/seed-000.md): the capacity numbers plan must reproduce
@pytest.mark.parametrize("profile, kv_bytes, prefix, block_size, blocks, per_request, capacity_tokens, times", [
    ("3x3090", 550_000_000, False, 12_144, 171, 42, 1_067_300, "4.07"),
    ("3x3090", 550_000_000, True, 12_144, 171, 61, 734_862, "2.80"),
    ("3x3090", 783_000_000, True, 12_144, 244, 61, 1_048_576, "4.00"),
    ("3x3090-mtp", 550_000_000, True, 9_776, 170, 85, 524_288, "2.00"),
    ("3x3090-mtp", 783_000_000, True, 9_776, 242, 85, 746_339, "2.85"),
])
def test_the_seed_table(profile, kv_bytes, prefix, block_size, blocks, per_request, capacity_tokens, times):
    p = seed_plan(profile, kv_bytes, prefix)
    assert (p.block_size, p.blocks, p.blocks_per_request, p.capacity_tokens) == (
        block_size, blocks, per_request, capacity_tokens)
    assert f"{p.concurrency:.2f}" == times


def test_the_seed_structure():
    p = seed_plan("3x3090", 550_000_000, True)
    assert p.state_page_bytes == 3_207_168 == 3_145_728 + 61_440
    assert p.bytes_per_block == [3_207_168] * 3
    kinds = [g.kind for g in p.groups]
    # two gated delta-net states share a group because the 12-layer QSA group spans ~3 pages
    assert kinds.count("gdn") == 18 and kinds.count("ple_short_conv") == 1
    assert [g.blocks_per_request for g in p.groups if g.kind in ("gdn", "ple_short_conv")] == [2] * 19
    assert [(g.kind, g.blocks_per_request) for g in p.groups if g.kind.startswith("qsa")] == [
        ("qsa_compressed_key", 22), ("qsa_key_ring", 1)]
    # no rank holds two states of one group, so a block is one state page on every rank
    assert all(max(g.layers_per_rank) == 1 for g in p.groups if g.kind == "gdn")
    assert p.qsa_layers_per_rank == [4, 4, 4]
    # 171 x 12,144 x 2 KiB = 3.96 GiB per QSA layer, 47.5 GiB for 12; PyTorch would round each to 4 GiB
    assert p.pinned_host_bytes == 12 * 171 * 12_144 * 2048
    assert p.pinned_host_bytes_pow2 == 12 * 4 * GIB
    assert round(p.tokens_per_mib_vram) == 1_405 and round(p.tokens_per_gib_host, -1) == 15_460


def test_mtp_structure():
    p = seed_plan("3x3090-mtp", 550_000_000, True)
    assert p.state_page_bytes == 3_227_648  # the conv state grows by one draft token, 20,480 B
    assert p.qsa_layers_per_rank == [4, 4, 5] and p.layers_per_rank == [16, 17, 15]
    assert 5 * 66 * p.block_size <= p.state_page_bytes < 5 * 66 * (p.block_size + 16)
    assert round(p.pinned_host_bytes / GIB, 1) == 41.2
    # seed 000 §7: every rank holds the 5 x 9,776-row arena; ranks 0/1 split it 4 ways
    assert p.qsa_arena_rows == 5 * 9_776 and p.qsa_row_cache_rows == [12_220, 12_220, 9_776]
    assert p.qsa_arena_bytes[2] == 5 * 9_776 * 2048 + 5 * 9_776 * 20 + 5 * 4
    assert p.vram_bytes_total == [v + a for v, a in zip(p.vram_bytes, p.qsa_arena_bytes)]


def test_another_config_by_hand(demo_snapshot):
    """The demo checkpoint's small config at PP 2, every number worked out by hand.

    4 layers: GDN, GDN (+ PLE short conv, the layer before ple_layer_ids [2]), GDN, QSA.
    - GDN state: conv (2*32*2 + 4*32 = 256 channels) x 3 x 2 B = 1,536 + ssm 4 x 32 x 32 x 4 B = 16,384 -> 17,920 B.
    - PLE short conv: 256 x 4 hc = 1,024 channels x (3 x 3 = 9) x 2 B = 18,432 B: the state page.
    - The block-size rule budgets the QSA keys at the seed's (32 x 2 + 8) / 4 = 18 B/token; one QSA
      layer on the busiest rank: block size = 18,432 / 18 = 1,024 tokens (a multiple of 16).
    - vLLM's grouping: the QSA group is one page, which holds one GDN state, so 3 GDN groups,
      1 PLE group, 1 compressed-key group, 1 ring group. A block is 18,432 B on rank 0 (the PLE
      state); on rank 1 the engine's compressed key, 32 x 2 / 4 = 16 B/token (16,384 B a block),
      leaves the GDN state's 17,920 B the largest page (issue 40 item 9: the engine's own specs,
      which tests/serving/test_ledger.py takes from the layers vLLM builds).
    - 1,000,000 B -> 54 blocks. One 8,192-token request: 3 + 1 + 8 + 1 = 13 blocks
      (align mode: 3 x 2 + 2 + 8 + 1 = 17). Capacity 54 x 8,192 / 13 = 34,028 (26,021).
    - Host K/V: 2 x 2 heads x 64 x 2 B = 512 B/token: 54 x 1,024 x 512 = 28,311,552 B; 32 MiB rounded.
    """
    text = capacity.load_text_config(demo_snapshot)
    shape = capacity.ServingShape(pipeline_parallel_size=2, max_model_len=8192, kv_cache_memory_bytes=1_000_000,
                                  prefix_caching=False, num_speculative_tokens=0, layer_partition=None,
                                  qsa_kv_offload=True, exact_host_pool=True)
    p = capacity.plan(text, shape)
    assert p.layers_per_rank == [2, 2] and p.qsa_layers_per_rank == [0, 1]
    assert (p.state_page_bytes, p.block_size, p.bytes_per_block) == (18_432, 1_024, [18_432, 17_920])
    assert [g.kind for g in p.groups] == ["gdn"] * 3 + ["ple_short_conv", "qsa_compressed_key", "qsa_key_ring"]
    assert (p.blocks, p.blocks_per_request, p.capacity_tokens) == (54, 13, 34_028)
    assert (p.pinned_host_bytes, p.pinned_host_bytes_pow2) == (28_311_552, 32 * 2**20)

    aligned = capacity.plan(text, capacity.ServingShape(**{**shape.__dict__, "prefix_caching": True}))
    assert (aligned.blocks_per_request, aligned.capacity_tokens) == (17, 26_021)


def test_bad_inputs(demo_snapshot, tmp_path):
    text = capacity.load_text_config(demo_snapshot)
    shape = capacity.ServingShape(2, 8192, 1_000_000, False, 0, (3, 3), True, True)
    with pytest.raises(FlashnextError, match="does not split 4 layers into 2 ranks"):
        capacity.plan(text, shape)
    with pytest.raises(FlashnextError, match="VLLM_QSA_KV_OFFLOAD"):
        capacity.plan(text, capacity.ServingShape(2, 8192, 1_000_000, False, 0, None, False, True))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 4}}))
    with pytest.raises(FlashnextError, match="config.json: text_config: full_attention_interval is missing"):
        capacity.load_text_config(tmp_path)
    # the same one-line errors as every other reader of a config (flashnext.quant.records.jsonfile)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": "4"}}))
    with pytest.raises(FlashnextError, match="text_config: num_hidden_layers must be an integer, got '4'"):
        capacity.load_text_config(tmp_path)


def test_cli_json_and_text():
    r = CliRunner().invoke(cli, ["plan", "--profile", "3x3090", "--kv-cache-memory-bytes", "550000000",
                                 "--no-prefix-caching", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert {k: out[k] for k in ("block_size", "blocks", "blocks_per_request", "capacity_tokens")} == {
        "block_size": 12_144, "blocks": 171, "blocks_per_request": 42, "capacity_tokens": 1_067_300}
    assert round(out["concurrency"], 2) == 4.07 and out["pinned_host_bytes"] == 12 * 171 * 12_144 * 2048
    assert out["notes"] == []  # the series has qsa-offload: no "not in the image yet" note
    r = CliRunner().invoke(cli, ["plan", "--profile", "3x3090-mtp"])
    assert r.exit_code == 0 and "blocks per rank      170" in r.stdout and "(2.00x)" in r.stdout
    assert "85 = 18 gdn x 3 + 1 ple_short_conv x 3 + 1 qsa_compressed_key x 27 + 1 qsa_key_ring x 1" in r.stdout
    assert "QSA arena            48,880 rows per rank" in r.stdout and "4 x 12,220, 4 x 12,220, 5 x 9,776" in r.stdout


@pytest.mark.parametrize("fmt, kv, table, fits", [
    ("file", 783_000_000, None, True),
    ("nvfp4", 550_000_000, 320_001_536 * 80 + 320_001_536 * 10, True),  # 90 B a row: 26.82 GiB
    ("nvfp4", 783_000_000, 320_001_536 * 90, True),
    ("fp8", 783_000_000, 320_001_536 * 160, True),  # 47.68 GiB
    ("bf16", 550_000_000, 320_001_536 * 320, False),  # 95.37 GiB: the seed's reason for the file
])
def test_plan_says_whether_the_host_fits_each_ple_format(fmt, kv, table, fits):
    """Issue 29: the table's pinned bytes with the QSA pools on the reference rig's 125 GiB host; where
    it does not fit, the KV setting that does."""
    r = CliRunner().invoke(cli, ["plan", "--profile", "3x3090", "--kv-cache-memory-bytes", str(kv), "--ple-format",
                                 fmt, "--json"])
    assert r.exit_code == (0 if fits else 1), r.output  # a plan that does not fit exits 1 (issue 41)
    host = json.loads(r.stdout)["host"]
    assert host["pinned"].get("PLE table") == table and host["fits"] is fits and host["host_bytes"] == 125 << 30
    assert host["pinned"]["QSA K/V"] == json.loads(r.stdout)["pinned_host_bytes"]
    if not fits:
        kv_fits = host["largest_kv_cache_memory_bytes_that_fits"]
        assert 0 < kv_fits < kv
        again = CliRunner().invoke(cli, ["plan", "--profile", "3x3090", "--kv-cache-memory-bytes", str(kv_fits),
                                         "--ple-format", fmt, "--json"])
        assert json.loads(again.stdout)["host"]["fits"]
    text = CliRunner().invoke(cli, ["plan", "--profile", "3x3090", "--kv-cache-memory-bytes", str(kv), "--ple-format",
                                    fmt])
    assert ("fits a 125.00 GiB host" if fits else "does NOT fit") in text.stdout
    if not fits:
        assert text.exit_code == 1 and text.stderr.startswith("Error: profile 3x3090 does not fit: pinned host memory")


def test_cli_refuses_other_families():
    r = CliRunner().invoke(cli, ["plan", "--profile", "8xh200-glm53-hisparse"])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "qwen4_exp" in r.output


def test_serve_prints_the_plan_line():
    from flashnext.serving.deployment import Deployment
    from flashnext.serving.run import summary_line

    line = summary_line(Deployment(load_profile("3x3090")))
    assert line.startswith("plan: 244 blocks per rank, 61 per 262,144-token request: 1,048,576 tokens (4.00x)")
    assert summary_line(Deployment(load_profile("8xh200-glm53-hisparse"))) is None


def test_the_vision_tower_on_the_first_rank():
    """Seed 000 §6: 27 blocks of width 1152, 0.836 GiB in bf16, streamed through 2 x 29 MiB slots;
    the 3x3090 profiles serve images up to 2 MP with vit-stream on."""
    vision = capacity.load_vision_config()
    assert round((vision.other_bytes() + vision.depth * vision.block_bytes()) / GIB, 3) == 0.836
    assert round(2 * capacity.slot_bytes(vision.block_parameter_bytes()) / 2**20) == 58
    profile = load_profile("3x3090")
    p = capacity.plan_profile(profile)
    assert p.vision.streamed and p.vision.max_pixels == 2_097_152
    assert p.vision.weight_bytes == p.vision.streamed_weight_bytes < p.vision.resident_weight_bytes / 6
    assert p.vram_bytes_with_images == [p.vram_bytes[0] + p.vision.vram_bytes, *p.vram_bytes[1:]]
    resident = capacity.plan_profile(dataclasses.replace(profile, env={**profile.env, "VLLM_VIT_STREAM": "0"}))
    assert resident.vision.weight_bytes == resident.vision.resident_weight_bytes
    text_only = capacity.plan_profile(dataclasses.replace(profile, vllm_args=[*profile.vllm_args,
                                                                               "--language-model-only"]))
    assert text_only.vision is None and text_only.vram_bytes_with_images == []
    r = CliRunner().invoke(cli, ["plan", "--profile", "3x3090"])
    assert "vision tower         rank 0 only: 129.59 MiB streamed (vit-stream; 856.27 MiB resident)" in r.stdout


# --- issue 27: one home per capacity rule ---------------------------------------------------------

GOLDEN = Path(__file__).with_name("plan_json_before_issue_27.json")


@pytest.mark.parametrize("argv", sorted(json.loads(GOLDEN.read_text())))
def test_plan_json_is_what_it_was_before_the_split(argv):
    """`plan --json` of every profile shipped when serving/capacity.py became a package, with each
    override, as the single module printed it (captured from that code, before the split)."""
    want = json.loads(GOLDEN.read_text())[argv]
    assert argv.split()[1] in available()
    r = CliRunner().invoke(cli, ["plan", *argv.split(), "--json"])
    if "exit_code" in want:  # a family with no planner: refused, as before
        assert r.exit_code == want["exit_code"] and r.stdout == ""
        return
    out = json.loads(r.stdout)
    # issue 41: a plan whose VRAM table puts a rank over its card exits 1, its plan printed. Of these,
    # only the MTP system at the seed's development setting (783,000,000 B, seed 000 §7) is over: rank
    # 1 by 139 MiB, the runtime being the seed's fullest rank's (tests/serving/test_vram_table.py)
    over = argv == "--profile 3x3090-mtp --kv-cache-memory-bytes 783000000 --prefix-caching"
    assert out["vram"]["fits"] is not over and r.exit_code == (1 if over else 0), r.output
    # what was there is as it was; issue 40 added the memory ledger (tests/serving/test_ledger.py), issue
    # 41 the VRAM table (tests/serving/test_vram_table.py)
    assert {k: v for k, v in out.items() if k not in ("ledger", "vram")} == want
    assert "ledger" not in want and "vram" not in want
    assert [rank["rank"] for rank in out["ledger"]["ranks"]] == list(range(len(out["layers_per_rank"])))


@pytest.mark.parametrize("layers, pp, partition", [
    (48, 3, None), (48, 3, (16, 17, 15)), (49, 3, None), (50, 4, None), (7, 1, None), (4, 2, (1, 3)), (5, 5, None)])
def test_rank_layers_is_vllms_split(layers, pp, partition, monkeypatch):
    """The plan splits the layers as vLLM's get_pp_indices does with the same VLLM_PP_LAYER_PARTITION,
    without setting that variable for anyone (the plan is for the profile's environment, not ours)."""
    from vllm.distributed.utils import get_pp_indices

    if partition is None:
        monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    else:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", ",".join(map(str, partition)))
    vllms = [range(*get_pp_indices(layers, rank, pp)) for rank in range(pp)]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,1,1,1,1,1,1,1,1")  # this process's: not the profile's
    assert capacity.rank_layers(layers, pp, partition) == vllms
    assert os.environ["VLLM_PP_LAYER_PARTITION"] == "1,1,1,1,1,1,1,1,1"


def test_the_slot_of_vllms_vision_block_is_the_planned_slot():
    """vit-stream's slot for a real Qwen3-VL vision block (transformers' module, on the meta device)
    is the slot `plan` and the preflight count from the pinned config's parameter sizes."""
    import torch
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionBlock

    from flashnext.serving.runtime.block_stream import block_layout

    vision = capacity.load_vision_config()
    config = Qwen3VLVisionConfig(depth=vision.depth, hidden_size=vision.hidden_size, num_heads=16,
                                 intermediate_size=vision.intermediate_size, out_hidden_size=vision.out_hidden_size)
    with torch.device("meta"):
        block = Qwen3VLVisionBlock(config).to(torch.bfloat16)
    layout, slot = block_layout(block)
    assert slot == capacity.slot_bytes(vision.block_parameter_bytes()) == 30_479_104
    assert sorted(s.nbytes for s in layout) == sorted(vision.block_parameter_bytes())
    assert all(s.offset % capacity.vision.VIT_SLOT_ALIGN == 0 for s in layout)


def test_plan_serve_and_the_preflight_ask_the_families_table(monkeypatch, tmp_path):
    """A family is planned where FAMILIES has a planner for it, by that planner, everywhere."""
    from flashnext.serving import preflight
    from flashnext.serving.deployment import Deployment
    from flashnext.serving.run import summary_line

    hisparse = load_profile("8xh200-glm53-hisparse")
    assert hisparse.model_family not in capacity.FAMILIES
    assert [f.check for f in preflight.preflight(Deployment(hisparse), "native", [])].count("host-ram") == 0
    asked = []

    def planner(profile, kv_cache_memory_bytes=None, prefix_caching=None, model=None):
        asked.append((profile.name, kv_cache_memory_bytes, prefix_caching, model))
        return capacity.plan_profile(load_profile("3x3090"), kv_cache_memory_bytes, prefix_caching, model)

    monkeypatch.setitem(capacity.FAMILIES, hisparse.model_family, planner)
    r = CliRunner().invoke(cli, ["plan", "--profile", hisparse.name, "--kv-cache-memory-bytes", "550000000", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["blocks"] == 171
    assert summary_line(Deployment(hisparse)).startswith("plan: 244 blocks per rank")
    findings = preflight.preflight(Deployment(hisparse), "native", [])
    assert [f.check for f in findings].count("host-ram") == 1
    assert [a[0] for a in asked] == [hisparse.name] * 3 and asked[0][1:3] == (550_000_000, None)


def test_serve_plans_the_snapshot_the_preflight_checks(demo_snapshot, tmp_path):
    """`serve --model S` prints the plan of S, the one `plan --model S` prints and the preflight's
    host-RAM check counts (before issue 27 serve's line was the pinned checkpoint's)."""
    from flashnext.serving import preflight
    from flashnext.serving.deployment import Deployment
    from flashnext.serving.run import summary_line

    profile = load_profile("3x3090")
    r = CliRunner().invoke(cli, ["plan", "--profile", "3x3090", "--model", str(demo_snapshot), "--json"])
    assert r.exit_code == 0, r.output
    planned = json.loads(r.stdout)
    base = capacity.plan_profile(profile)
    assert planned["blocks"] != base.blocks  # the demo config is another model: the difference shows
    assert summary_line(Deployment(profile, demo_snapshot)).startswith(f"plan: {planned['blocks']} blocks per rank")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {125 * GIB // 1024} kB\nMemAvailable: {118 * GIB // 1024} kB\n")
    finding = preflight.check_host_ram(Deployment(profile, demo_snapshot, ple_table=tmp_path / "table.bin"), meminfo,
                                       tmp_path / "absent")
    assert finding.terms["QSA K/V"] == planned["pinned_host_bytes_needed"] != base.pinned_host_bytes_needed
