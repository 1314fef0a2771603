"""Patch qsa-offload: the QSA K/V in host memory, budgeted as seed 000 budgets it (§5, §7), planned by
``flashnext plan`` to the byte, and served through vLLM's own metadata builders and cache writer."""

import pytest

from support import SUPPORT_DIR, free_port, run_scenario

from flashnext.serving import capacity
from flashnext.serving.profiles import load_profile

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")

KV_BYTES = 4_000_000
ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}


def scenario(tree, demo_snapshot, **env) -> dict:
    script = (SUPPORT_DIR / "qsa_offload_scenario.py").read_text()
    return run_scenario(script, (str(demo_snapshot), free_port(), str(KV_BYTES)), tree and str(tree), {**ENV, **env})


@pytest.fixture(scope="module")
def served(patched_tree, demo_snapshot) -> dict:
    return scenario(patched_tree, demo_snapshot, VLLM_QSA_KV_OFFLOAD="1")


def demo_plan(demo_snapshot) -> capacity.Plan:
    return capacity.plan(capacity.load_text_config(demo_snapshot),
                         capacity.ServingShape(1, 4096, KV_BYTES, True, 0, None, True, True))


def test_stock_and_switched_off_keep_the_k_v_in_vram(patched_tree, demo_snapshot):
    stock = scenario(None, demo_snapshot, VLLM_QSA_KV_OFFLOAD="1")  # stock vLLM 0.34.0 has no such switch
    # 0.34.0's default block of 64 tokens (0.33.0's was 16, aligned up to 48) already holds a state
    # page: 64 x 512 B of K/V >= 18,432 B, so the alignment keeps it and pads the state pages
    assert "3.self_attn.attn" in stock["specs"] and stock["block_size"] == 64 and stock["offloaded_layers"] == 0
    assert stock["mamba_page_size_padded"] == 64 * 512
    off = scenario(patched_tree, demo_snapshot, VLLM_QSA_KV_OFFLOAD="0")
    keys = ("specs", "block_size", "num_blocks", "concurrency", "offloaded_layers")
    assert {k: off[k] for k in keys} == {k: stock[k] for k in keys}
    assert off["after_load"] == {"arena_bytes": 0, "host_bytes": 0}  # nothing of the offload exists


def test_the_arena_exists_at_load_and_the_host_rows_when_vllm_allocates_the_kv_cache(served, demo_snapshot):
    """The arena is VRAM: it must exist before vLLM profiles (it is built with the model, inside
    load_model's memory accounting); the host rows are sized by the KV cache config, so they appear
    when vLLM allocates and binds the KV cache, before any step. No step allocates anything."""
    plan = demo_plan(demo_snapshot)
    arena, host = plan.qsa_arena_bytes[0], plan.pinned_host_bytes_per_rank[0]
    # demo: 1 QSA layer, blocks of 1,024 tokens; a row is 2 heads x (64 + 64) bf16 = 512 B
    assert (plan.qsa_arena_rows, plan.qsa_row_cache_rows) == (1024, [1024])
    assert arena == 1024 * 512 + 1024 * (8 + 4 + 8) + 4 == 544_772
    assert host == plan.pinned_host_bytes == 217 * 1024 * 512 == 113_770_496
    assert served["after_load"] == {"arena_bytes": arena, "host_bytes": 0}
    assert served["before_kv_allocation"] == {"arena_bytes": arena, "host_bytes": 0}
    assert served["after_kv_allocation"] == {"arena_bytes": arena, "host_bytes": host}
    assert served["after_steps"] == served["after_kv_allocation"]
    assert plan.vram_bytes_total == [plan.vram_bytes[0] + arena]


def test_the_engine_lays_out_what_the_plan_says(served, demo_snapshot):
    plan = demo_plan(demo_snapshot)
    on = served
    assert "3.self_attn.attn" not in on["specs"] and on["mamba_page_size_padded"] is None
    assert (on["block_size"], on["num_blocks"]) == (plan.block_size, plan.blocks) == (1024, 217)
    assert on["concurrency"] == plan.concurrency and len(on["groups"]) == len(plan.groups)
    assert on["host_rows"] == [plan.blocks, plan.block_size, 2, 128]
    assert (on["arena_blocks"], on["row_cache_rows"]) == (1, plan.qsa_row_cache_rows[0])


def test_the_patched_forward_stores_and_attends_with_vllms_own_metadata(served):
    """``_run_qsa`` with the metadata vLLM's QSAIndexerMetadataBuilder built for the compressed-key
    and ring groups, K/V stored by Qwen4ExpQSAImpl.do_kv_cache_update (vLLM's Triton writer standing
    in for the CUDA op): a 37- and a 21-token prefill, then one decode token each."""
    assert served["builders"] == ["QSAIndexerMetadataBuilder"] and served["metadata_types"] == ["QSAIndexerMetadata"]
    # the layer has no group, so vLLM builds it no metadata: _run_qsa got a Qwen4ExpQSAMetadata made
    # from the compressed-key group's, whose slots are the host rows the block ids give
    assert served["main_metadata"] == [dict(vllms=True, tokens=37 + 21, slots=True),
                                       dict(vllms=True, tokens=2, slots=True)]
    assert served["fused_writer"] is False  # the demo's 32-dim indexer: the unfused writer, on CUDA too
    # every token's K and V are in the host row the request's blocks put it in (computed from the
    # block ids and positions, not from the layer's metadata), and no other row changed
    assert served["rows_written"] == 37 + 21 + 2 and served["other_rows_untouched"]
    assert served["stored_key_error"] == 0.0 and served["stored_value_error"] == 0.0
    # staged prefill, then the row cache: each against a torch reference over those rows
    assert served["selected_counts"][0] == 37 and max(served["attention_errors"]) <= 2 ** -6
    assert served["cached_rows_after_prefill"] == 0  # the staged prefill overwrote the arena: no tags
    assert served["cached_rows_after_decode"] > 0


@pytest.mark.parametrize("profile, rows, arena_rows", [
    ("3x3090", [12_144] * 3, 4 * 12_144),
    ("3x3090-mtp", [12_220, 12_220, 9_776], 5 * 9_776),  # seed 000 §7, the end
])
def test_every_rank_holds_the_busiest_ranks_arena(profile, rows, arena_rows):
    """What the hook allocates on each rank of the seed's system (on the meta device), against the plan."""
    from flashnext.serving.runtime.qsa_offload import rank_row_cache

    shape = capacity.ServingShape.from_profile(load_profile(profile), 550_000_000, True)
    text = capacity.load_text_config()
    plan = capacity.plan(text, shape)
    assert (plan.qsa_arena_rows, plan.qsa_row_cache_rows) == (arena_rows, rows)
    for rank in range(3):
        cache = rank_row_cache(text, shape.pipeline_parallel_size, shape.layer_partition,
                               shape.num_speculative_tokens, plan.state_page_bytes, rank, text.num_key_value_heads,
                               text.head_dim, "meta")
        assert cache.arena.shape[0] * cache.arena.shape[1] == arena_rows and cache.sets == rows[rank]
        assert cache.num_layers == plan.qsa_layers_per_rank[rank]
        assert cache.nbytes + cache.state_nbytes == plan.qsa_arena_bytes[rank]
    # 5 x 9,776 x 2 KiB = 95.5 MiB of rows (the seed's "≈ 95 MiB"), plus under 1 MiB of tags
    assert round(arena_rows * 2048 / 2**20, 1) in (94.9, 95.5)
