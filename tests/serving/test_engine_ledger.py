"""Issue 40: the engine held to the memory ledger (serving/capacity/ledger.py), on the CPU at PP=1 and 2.

vLLM 0.34.0's own ``qwen4_exp`` model for the demo checkpoint, with the patched tree and patch
qsa-offload on, goes through start-up (the model built: the QSA arena; the KV cache planned by
vLLM's ``get_kv_cache_configs``, allocated and bound by Model Runner V2's ``init_attn_backend`` and
``init_kv_cache``: the host rows and ``RowCache.warm``; then the CUDA-graph capture's stand-in) and
then serves through the offloaded QSA layer's own ``forward`` and ``_run_qsa``, with the metadata
vLLM's ``QSAIndexerMetadataBuilder`` built: a prefill of 16 short prompts, decode steps of 1..16
rows (1..12 through decode-07's row cache, 13..16 through ``host_attention``), and a 3,300-token
prompt in chunks of 512 over four arena windows, each chunk after the first batched with 4, 8,
12 and then 15 decodes (support/engine_ledger_scenario.py). Every tensor flashnext's code allocates
while serving is recorded with its bytes and call site (support/allocations.py), and every Triton
launch as Triton's cache key for an RTX 3090 (support/triton_launches.py). The test fails if a
serving allocation's site is not one the rank's ledger lists (:data:`SITES`), if an entry's bytes
live at once in a step (with what earlier steps left alive) exceed its serving peak, or if a
Triton variant launched while serving was not launched during start-up.

The ledger is the demo's, served as the 3x3090 profile's batch (512 tokens a step, CUDA graphs of
1, 2 and 4 tokens) with 16 sequences, so that decode steps of 5..16 rows run eagerly.

Stand-ins (named in the scenario too): CUDA-graph capture, by one eager decode step of each
capture size through the layer (on a GPU capture runs those steps' kernels, which compiles their
variants); the Triton kernels, recorded and not run but for vLLM's metadata builder's (the
interpreter takes seconds a query row; what they compute is held by test_qsa_offload.py and
test_ledger.py); the scheduler (written-out requests, blocks and chunks); the layer's weights
(seeded; no quantization config: the CPU has no kernels for it); the QSA indexer and the
``reshape_and_cache_flash`` CUDA op (CUDA-only; vLLM's Triton twin writes, and its launches are
not held: on a GPU it is no Triton kernel). At PP=2 (two gloo ranks, vLLM's own pipeline groups
and joint KV planning) each rank is held to its own ledger. Not covered: vLLM's profile run,
EngineCore and its scheduler, MTP and structured output, decode-05's MoE block, the PLE and ViT
paths.
"""

import dataclasses
import json
import os

import pytest

from support import SUPPORT_DIR, free_port, run_scenario, two_ranks

from flashnext.serving import capacity
from flashnext.serving.capacity import ledger as ledgers
from flashnext.serving.profiles import load_profile

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")

KV_BYTES = 4_000_000
MAX_NUM_SEQS = 16
ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1", "VLLM_QSA_KV_OFFLOAD": "1"}
# vLLM's Triton twin of the reshape_and_cache_flash CUDA op, which stands in for it on the CPU
STAND_IN_KERNELS = {"reshape_and_cache_kernel_flash"}

HOST = "host memory"  # pageable, for the host's part of a launch: the ledger counts device and pinned bytes
# Each flashnext call site that allocates while serving, and the ``source`` of the ledger entry
# whose sizing function it allocates by (or HOST).
SITES = {
    "quant/kernels/qsa_row_cache.py:_partials": "qsa_row_cache.partials_bytes",
    "quant/kernels/qsa_row_cache.py:staged_attention": "qsa_row_cache.staged_scratch",
    "quant/kernels/qsa_row_cache.py:_staged_windows": HOST,
    "quant/kernels/qsa_row_cache.py:_window_remap": HOST,
    "serving/runtime/qsa_offload.py:main_metadata": "runtime/qsa_offload.row_slots_bytes",
}


def demo_shape(world: int = 1) -> capacity.ServingShape:
    profile = capacity.ServingShape.from_profile(load_profile("3x3090"))
    return capacity.ServingShape(
        world, 4096, KV_BYTES, True, 0, None, True, True, images=False, engram_cpu_offload=False,
        max_num_batched_tokens=profile.max_num_batched_tokens, max_num_seqs=MAX_NUM_SEQS,
        cudagraph_capture_sizes=profile.cudagraph_capture_sizes)


def demo_ledgers(demo_snapshot, world: int = 1) -> list[ledgers.RankLedger]:
    text = capacity.load_text_config(demo_snapshot)
    shape = demo_shape(world)
    return ledgers.ledger(text, shape, capacity.plan(text, shape), model=demo_snapshot).ranks


def demo_ledger(demo_snapshot) -> ledgers.RankLedger:
    (rank,) = demo_ledgers(demo_snapshot)
    return rank


def scenario_args(demo_snapshot, world: int, warm_up: bool = True) -> tuple:
    """engine_ledger_scenario.py's arguments after RANK and PORT."""
    shape = demo_shape(world)
    return (world, demo_snapshot, KV_BYTES, shape.max_num_batched_tokens, MAX_NUM_SEQS,
            ",".join(map(str, shape.cudagraph_capture_sizes)), 1 if warm_up else 0)


def serve(tree, demo_snapshot, warm_up: bool) -> dict:
    script = (SUPPORT_DIR / "engine_ledger_scenario.py").read_text()
    args = ("0", free_port(), *map(str, scenario_args(demo_snapshot, 1, warm_up)))
    return run_scenario(script, args, str(tree), ENV)


@pytest.fixture(scope="module")
def served(patched_tree, demo_snapshot) -> dict:
    return serve(patched_tree, demo_snapshot, warm_up=True)


def serving(result: dict) -> list[dict]:
    return [s for s in result["steps"] if s["phase"] == "serving"]


def outside_the_ledger(result: dict, rank: ledgers.RankLedger) -> list[str]:
    """What the serving steps allocated that ``rank``'s ledger does not hold: a site it does not
    list, or an entry's bytes live at once in a step (with those earlier steps left alive) beyond
    its serving peak."""
    entries = {e.source: e for e in rank.entries}
    problems, left_alive = [], {}
    for step in serving(result):
        live = dict(left_alive)
        for site, peak in step["peaks"].items():
            source = SITES.get(site)
            if source is None or (source != HOST and source not in entries):
                problems.append(f"{step['name']}: {site} allocates, and the ledger lists no entry for it")
            elif source != HOST:
                live[source] = live.get(source, 0) + peak
        for a in step["allocations"]:
            if a["outlived"] and SITES.get(a["site"]) in entries:
                left_alive[SITES[a["site"]]] = left_alive.get(SITES[a["site"]], 0) + a["bytes"]
        problems += [f"{step['name']}: {n:,} B of {entries[s].name!r}, whose serving peak is {entries[s].gpu_peak:,} B"
                     for s, n in live.items() if n > entries[s].gpu_peak]
    return problems


def new_variants(result: dict) -> dict[str, set[str]]:
    """The Triton variants each serving step launched that no start-up step did (their kernels)."""
    startup = {k for s in result["steps"] if s["phase"] == "start-up" for k in s["keys"]}
    new = {}
    for step in serving(result):
        kernels = {json.loads(k)[0] for k in step["keys"] if k not in startup} - STAND_IN_KERNELS
        if kernels:
            new[step["name"]] = kernels
    return new


def test_the_serve_reaches_what_the_ledger_must_hold(served):
    """The serve covers what the test claims: windows, chunks, mixed batches, 1..16-row steps."""
    steps = {s["name"]: s for s in serving(served)}
    assert [f"decode {n}" in steps for n in range(1, 17)] == [True] * 16
    for rows in range(1, 13):  # decode-07: the row cache's plan, one attention launch
        assert steps[f"decode {rows}"]["launches"].get("_plan_kernel") == 1
    for rows in range(13, 17):  # host_attention: no plan
        assert "_plan_kernel" not in steps[f"decode {rows}"]["launches"]
    last = steps["prefill chunk 3018+282 with 15 decodes"]
    # the long prompt's four blocks and one block of each of the 15 decoding requests, a window each
    assert last["launches"]["_attention_kernel"] == 4 + 15 and last["launches"]["_fold_kernel"] == 4 + 15 - 1
    assert sum(s["name"].startswith("prefill chunk") and "decodes" in s["name"] for s in steps.values()) == 6
    assert served["block_size"] == 1024 and served["num_blocks"] == 217


def test_start_up_holds_what_the_ledger_says(served, demo_snapshot):
    rank = demo_ledger(demo_snapshot)
    by_name = {e.name: e for e in rank.entries}
    load = next(s for s in served["steps"] if s["name"] == "load")
    assert {a["site"] for a in load["allocations"]} == {"quant/kernels/qsa_row_cache.py:__init__"}
    assert sum(a["bytes"] for a in load["allocations"] if a["outlived"]) == (
        by_name["QSA staging arena"].gpu_startup + by_name["decode-07 row-cache state"].gpu_startup)
    assert served["arena_bytes"] == by_name["QSA staging arena"].gpu_startup
    assert served["host_rows_bytes"] == by_name["QSA K/V host rows"].pinned_host


def test_every_serving_allocation_is_in_the_ledger(served, demo_snapshot):
    rank = demo_ledger(demo_snapshot)
    assert not outside_the_ledger(served, rank)
    steps = serving(served)
    assert not any(a["outlived"] for s in steps for a in s["allocations"])  # nothing a step leaves behind
    # each entry reached: the staged scratch at a full chunk (the demo's one-block arena cannot
    # hold it), 16 rows' partials, a full step's slots
    peak = {}
    for s in steps:
        for site, n in s["peaks"].items():
            peak[SITES[site]] = max(peak.get(SITES[site], 0), n)
    entries = {e.source: e for e in rank.entries}
    assert peak["qsa_row_cache.staged_scratch"] == entries["qsa_row_cache.staged_scratch"].gpu_peak == 1_066_496
    assert peak["qsa_row_cache.partials_bytes"] == 16 * 16 * 4 * 65 * 4  # splits x rows x heads x (64 + 1) fp32
    assert peak["runtime/qsa_offload.row_slots_bytes"] == 512 * 65


def test_nothing_compiles_while_serving(served):
    assert not new_variants(served)


def test_the_check_finds_bytes_beyond_an_entry_and_sites_it_lacks(served, demo_snapshot):
    """Not vacuous: the same serve against a ledger whose decode-07 partials hold the row cache's
    12 rows (not the eager 13..16-row steps'), or that has no entry for the row slots, fails."""
    rank = demo_ledger(demo_snapshot)
    twelve_rows = 16 * 12 * 4 * 65 * 4
    short = ledgers.RankLedger(0, [dataclasses.replace(e, gpu_peak=twelve_rows) if e.name == "decode-07 partials"
                                   else e for e in rank.entries])
    assert [p.split(":")[0] for p in outside_the_ledger(served, short)] == [
        "decode 13", "decode 14", "decode 15", "decode 16", "decode 16 with the long prompt"]
    without = ledgers.RankLedger(0, [e for e in rank.entries if e.name != "QSA row slots"])
    problems = outside_the_ledger(served, without)
    assert len(problems) == len(serving(served)) and all("main_metadata allocates" in p for p in problems)


def test_without_the_warm_up_the_staged_prefill_compiles_while_serving(patched_tree, demo_snapshot):
    """The tree before ``RowCache.warm`` (``OffloadedQSA.bind`` without it): the staged prefill's
    attention, fold and merge and ``host_attention``'s attention (13..16 rows) compile at the first
    step that takes them, after start-up. The check reports it."""
    result = serve(patched_tree, demo_snapshot, warm_up=False)
    new = new_variants(result)
    assert new[f"prefill {MAX_NUM_SEQS} x 24"] == {"_attention_kernel", "_fold_kernel", "_merge_kernel"}
    assert all(new[f"decode {rows}"] == {"_attention_kernel"} for rows in range(13, 17))
    assert not any(f"decode {rows}" in new for rows in range(1, 13))  # the capture's


@pytest.fixture(scope="module")
def served_pp2(patched_tree, demo_snapshot) -> list[dict]:
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(patched_tree), str(SUPPORT_DIR.parent)])}
    return two_ranks(env, "engine_ledger_scenario.py", scenario_args(demo_snapshot, 2))


def test_each_rank_at_pp2_holds_its_own_ledger(served_pp2, demo_snapshot):
    """PP=2 over gloo, the engine's own layer split and joint KV planning: the rank without a QSA
    layer allocates nothing of flashnext's at start-up and its ledger lists no QSA entry; the rank
    with it holds its arena, row-cache state and host rows exactly as its ledger says, and serves
    the same steps as at PP=1 inside that ledger, compiling nothing."""
    first, last = served_pp2
    ranks = demo_ledgers(demo_snapshot, 2)
    assert [r["qsa_layers"] for r in served_pp2] == [0, 1]
    assert first["num_blocks"] == last["num_blocks"] and first["block_size"] == last["block_size"] == 1024
    assert not [a for s in first["steps"] for a in s["allocations"]]
    assert first["arena_bytes"] == first["host_rows_bytes"] == 0
    assert not [e.name for e in ranks[0].entries if e.owner.startswith("qsa-offload")]
    by_name = {e.name: e for e in ranks[1].entries}
    load = next(s for s in last["steps"] if s["name"] == "load")
    assert sum(a["bytes"] for a in load["allocations"] if a["outlived"]) == (
        by_name["QSA staging arena"].gpu_startup + by_name["decode-07 row-cache state"].gpu_startup)
    assert last["arena_bytes"] == by_name["QSA staging arena"].gpu_startup
    assert last["host_rows_bytes"] == by_name["QSA K/V host rows"].pinned_host
    assert not outside_the_ledger(last, ranks[1])
    assert not new_variants(last)
    assert [s["name"] for s in serving(last)][-1] == f"decode {MAX_NUM_SEQS} with the long prompt"
