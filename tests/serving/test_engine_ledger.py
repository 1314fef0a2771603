"""Issue 40: the engine held to the memory ledger (serving/capacity/ledger.py), on the CPU at PP=1 and 2.

vLLM 0.34.0's own ``qwen4_exp`` model for the demo checkpoint, with the patched tree and patch
qsa-offload on, goes through start-up (the model built and vLLM's post-load step run over it,
``process_weights_after_loading``: the QSA arena, decode-05's router rows; the KV cache planned by
vLLM's ``get_kv_cache_configs``, allocated and bound by Model Runner V2's ``init_attn_backend`` and
``init_kv_cache``: the host rows and ``RowCache.warm``; then the CUDA-graph capture's stand-in) and
then serves through the offloaded QSA layer's own ``forward`` and ``_run_qsa``, with the metadata
vLLM's ``QSAIndexerMetadataBuilder`` built, and its decoder layer's MoE block (vLLM's
``Qwen4ExpSparseMoeBlock``, patched by decode-05: 1..4-token steps routed by ``moe_route.route``
and handed to vLLM's own ``RoutedExperts.forward_modular``, larger ones down vLLM's path): a
prefill of 16 short prompts, decode steps of 1..16 rows (1..12 through decode-07's row cache,
13..16 through ``host_attention``), and a 3,300-token prompt in chunks of 512 over four arena
windows, each chunk after the first batched with 4, 8, 12 and then 15 decodes
(support/engine_ledger_scenario.py). Every tensor flashnext's code allocates is recorded with its
bytes and call site (support/allocations.py), and every Triton launch as Triton's cache key for an
RTX 3090 (support/triton_launches.py). The test fails if the load does not allocate exactly the
ledger's weights entries, if a later start-up step keeps what no entry holds from start-up, if a
serving allocation's site is not one the rank's ledger lists (:data:`SITES`), if an entry's bytes
live at once in a step (with what earlier steps left alive) exceed its serving peak, if a step
decode-05 takes allocates more than vLLM's own path allocates for it (recorded beside it with
decode-05 off) and the split-K partials of the ledger's entry, or if a Triton variant launched
while serving was not launched during start-up.

The ledger is the demo's, served as the 3x3090 profile's batch (512 tokens a step, CUDA graphs of
1, 2 and 4 tokens) with 16 sequences, so that decode steps of 5..16 rows run eagerly.

The PLE table served from its file (ple-mmap, decode-06, ttft-01;
support/engine_ledger_ple_scenario.py) runs through vLLM's own Model Runner V2: the model built by
``initialize_model`` and vLLM's post-load step, ``GPUModelRunner.load_model`` (flashnext's model
state), vLLM's own profile run (``GPUModelRunner.profile_run``: ``_dummy_run`` of the step budget
through ``execute_model`` and the dummy sampler run), ``initialize_kv_cache``, then steps vLLM's
own ``Scheduler`` makes (two prompts, their decodes, a 1,300-token prompt in chunks beside them),
each through ``execute_model``'s bookkeeping and the model state's ``prepare_inputs``, which
hashes, advises and stages the step's rows. Held: the staged rows at the load and the host staging
buffer at the profile run as the ledger's entries say, both reused, nothing kept by a step, and a
step's other allocations vLLM's own (its model state's; its n-gram kernel's ids, no more than the
profile run made at the same site).

Stand-ins (named in the scenarios too): CUDA-graph capture, by one eager decode step of each
capture size through the layer and block (on a GPU capture runs those steps' kernels, which
compiles their variants); the Triton kernels, recorded and not run but for vLLM's metadata
builder's and decode-05's router (the interpreter takes seconds a query row; what they compute is
held by test_qsa_offload.py and test_ledger.py); the scheduler in the QSA scenario (written-out
requests, blocks and chunks); the layer's and block's weights (seeded; no quantization config: the
CPU has no kernels for it); the QSA indexer and the ``reshape_and_cache_flash`` CUDA op (CUDA-only;
vLLM's Triton twin writes, and its launches are not held: on a GPU it is no Triton kernel); the
routed experts' kernel (this vLLM build has no CPU MoE kernel: its arithmetic in torch, whose
allocations are not counted as flashnext's); in the PLE scenario, CUDA streams and events, UVA
buffers, the model's forward but for its PLE layer, and the sampler's choice of token. At PP=2 (two
gloo ranks, vLLM's own pipeline groups and joint KV planning) each rank is held to its own ledger.

Not covered, and why:

- vLLM's profile run over the QSA layer and the MoE block: the QSA scenario builds no
  ``GPUModelRunner`` (its steps run the layer and block under metadata vLLM's builders make), and
  the profile run that does run (the PLE scenario's) reaches the PLE layer only, as the rest of the
  demo's forward has no CPU kernels. (Its dummy step of 512 tokens would take vLLM's MoE path:
  decode-05 takes 1..4 tokens.)
- EngineCore (its busy loop, executor and ``determine_available_memory``): the QSA scenario's
  steps are written out, the PLE scenario's come from vLLM's ``Scheduler`` without EngineCore
  (test_engine_ledger_mtp.py serves through ``EngineCore.step_with_batch_queue``, without its busy
  loop and ``determine_available_memory``).
- MTP and structured output: test_engine_ledger_mtp.py (a tokenizer beside the demo, vLLM's MTP
  speculator and rejection sampler around the draft's MoE block and QSA layer).
- decode-05's Marlin hand-off: on the CPU ``moe_decode.forward`` aligns only for Marlin experts on
  CUDA, so the alignment buffers are not recorded here (their sizes are vLLM's
  ``moe_align_block_size``'s: tests/quant/kernels/test_moe_route.py).
- The PLE table pinned whole by vLLM's engram ``cpu_offload`` (served without a table file), the
  ViT path (vit-stream's slots and host rows) and decode_mma's split-K scratch (int6-bitplane,
  int8-modules, decode-04): test_engine_ledger_ple_pinned.py, test_engine_ledger_vision.py and
  test_engine_ledger_decode_mma.py hold them, on the same terms.
"""

import dataclasses
import json
import os

import pytest

from support import SUPPORT_DIR, free_port, run_scenario, two_ranks

from flashnext.serving import capacity
from flashnext.serving.capacity import ledger as ledgers
from flashnext.serving.deployment import Deployment
from flashnext.serving.profiles import load_profile

pytestmark = pytest.mark.slow  # minutes in all on 2 cores: tests/conftest.py sends it to a worker first

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")

KV_BYTES = 4_000_000
MAX_NUM_SEQS = 16
ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1", "VLLM_QSA_KV_OFFLOAD": "1"}
# vLLM's Triton twin of the reshape_and_cache_flash CUDA op, which stands in for it on the CPU
STAND_IN_KERNELS = {"reshape_and_cache_kernel_flash"}

HOST = "host memory"  # pageable, for the host's part of a launch: the ledger counts device and pinned bytes
# decode-05's shared expert (vLLM's own gate_up_proj, act_fn and down_proj, its gate and the sum, as
# vLLM's Qwen2MoeMLP and runner compute them) and vLLM's routed experts, called by decode-05: what
# vLLM's path allocates for the step in their place. The serve records that path for each step
# decode-05 takes; test_decode05_allocates_what_vllms_path_would_and_its_scratch holds it.
VLLM_PATH = "vLLM's MoE path's own tensors"
NOT_ENTRIES = {HOST, VLLM_PATH}
# Each flashnext call site that allocates after the load, and the ``source`` of the ledger entry
# whose sizing function it allocates by (or one of NOT_ENTRIES).
SITES = {
    "quant/kernels/qsa_row_cache.py:_partials": "qsa_row_cache.partials_bytes",
    "quant/kernels/qsa_row_cache.py:staged_attention": "qsa_row_cache.staged_scratch",
    "quant/kernels/qsa_row_cache.py:_staged_windows": HOST,
    "quant/kernels/qsa_row_cache.py:_window_remap": HOST,
    "serving/runtime/qsa_offload.py:main_metadata": "runtime/qsa_offload.row_slots_bytes",
    "serving/hooks/moe_decode.py:merge_router_rows": "hooks/moe_decode.router_rows_shape",
    # its logits and top-k stand where vLLM's router puts its own; its split-K partials are the entry's
    "quant/kernels/moe_route.py:route": "moe_route.route_scratch_bytes",
    "quant/kernels/_common.py:splitk_counters": "moe_route.route_scratch_bytes",  # route's, at its first launch
    "serving/hooks/moe_decode.py:_shared_expert": VLLM_PATH,
    "serving/hooks/moe_decode.py:forward": VLLM_PATH,
}
DECODE05 = ("quant/kernels/moe_route.py:", "serving/hooks/moe_decode.py:")
EXPERTS, TOP_K = 8, 2  # the demo's


def demo_shape(world: int = 1) -> capacity.ServingShape:
    profile = capacity.ServingShape.from_profile(load_profile("3x3090"))
    return capacity.ServingShape(
        world, 4096, KV_BYTES, True, 0, None, True, True, images=False, engram_cpu_offload=False,
        max_num_batched_tokens=profile.max_num_batched_tokens, max_num_seqs=MAX_NUM_SEQS,
        cudagraph_capture_sizes=profile.cudagraph_capture_sizes)


def demo_ledgers(demo_snapshot, world: int = 1) -> list[ledgers.RankLedger]:
    text = capacity.load_text_config(demo_snapshot)
    shape = demo_shape(world)
    return ledgers.ledger(text, shape, capacity.plan(text, shape),
                          deployment=Deployment(load_profile("3x3090"), demo_snapshot)).ranks


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
            if source is None or (source not in NOT_ENTRIES and source not in entries):
                problems.append(f"{step['name']}: {site} allocates, and the ledger lists no entry for it")
            elif source not in NOT_ENTRIES:
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


def kept(step: dict) -> dict[str, int]:
    """The bytes of each site's allocations in ``step`` that outlived it."""
    out = {}
    for a in step["allocations"]:
        if a["outlived"]:
            out[a["site"]] = out.get(a["site"], 0) + a["bytes"]
    return out


def kept_after_the_load(result: dict, rank: ledgers.RankLedger) -> list[str]:
    """What start-up steps after the load (the KV cache, the capture) keep that ``rank``'s ledger
    does not hold from start-up: a site it lists no entry for, an entry inside vLLM's weights
    (allocated after the load, it is outside them), or more than the entry's start-up bytes."""
    entries = {e.source: e for e in rank.entries}
    problems, held = [], {}
    for step in result["steps"]:
        if step["phase"] != "start-up" or step["name"] == "load":
            continue
        for site, n in kept(step).items():
            entry = entries.get(SITES.get(site))
            if entry is None:
                problems.append(f"{step['name']}: {site} keeps {n:,} B, and the ledger lists no entry for it")
            elif entry.inside == ledgers.WEIGHTS:
                problems.append(f"{step['name']}: {site} keeps {n:,} B of {entry.name!r}, which the ledger "
                                "has allocated at the load, inside vLLM's weights")
            else:
                held[entry.name] = held.get(entry.name, 0) + n
    by_name = {e.name: e for e in rank.entries}
    return problems + [f"{name}: {n:,} B kept from start-up, the ledger's {by_name[name].gpu_startup:,} B"
                       for name, n in held.items() if n > by_name[name].gpu_startup]


def test_start_up_holds_what_the_ledger_says(served, demo_snapshot):
    """The load (the model built, then vLLM's post-load step) allocates the QSA arena and row-cache
    state and decode-05's router rows, exactly as the ledger's weights entries say; what the later
    start-up steps keep (decode-05's split-K counters, at the capture's first fused step) the ledger
    holds from start-up, outside vLLM's numbers."""
    rank = demo_ledger(demo_snapshot)
    by_name = {e.name: e for e in rank.entries}
    load = next(s for s in served["steps"] if s["name"] == "load")
    assert {a["site"] for a in load["allocations"]} == {"quant/kernels/qsa_row_cache.py:__init__",
                                                         "serving/hooks/moe_decode.py:merge_router_rows"}
    assert kept(load) == {
        "quant/kernels/qsa_row_cache.py:__init__":
            by_name["QSA staging arena"].gpu_startup + by_name["decode-07 row-cache state"].gpu_startup,
        "serving/hooks/moe_decode.py:merge_router_rows": by_name["decode-05 router rows"].gpu_startup}
    assert served["moe_blocks"] == 4 and by_name["decode-05 router rows"].inside == ledgers.WEIGHTS
    assert served["arena_bytes"] == by_name["QSA staging arena"].gpu_startup
    assert served["host_rows_bytes"] == by_name["QSA K/V host rows"].pinned_host
    assert not kept_after_the_load(served, rank)
    capture = next(s for s in served["steps"] if s["name"] == "capture 1")
    assert kept(capture) == {"quant/kernels/_common.py:splitk_counters": 4 * 1024}


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


def test_decode05_allocates_what_vllms_path_would_and_its_scratch(served, demo_snapshot):
    """decode-05 takes the steps of 1..4 tokens (the capture's, decode 1..4) in vLLM's own MoE block
    (the patched ``Qwen4ExpSparseMoeBlock.forward``, the routed experts' ``forward_modular``); 5..16
    tokens and the prefills run vLLM's path, which allocates nothing of flashnext's. In each step it
    takes, its code allocates what vLLM's own path allocates for the same step (recorded by the serve
    with decode-05 off), and beyond it no more than the split-K partials of the ledger's scratch
    entry: ``route`` allocates exactly those and its logits and top-k, which stand in place of
    vLLM's router's. The router rows are not made again (test_start_up_holds_what_the_ledger_says)."""
    from flashnext.quant.kernels.moe_route import route_scratch_bytes

    rank = demo_ledger(demo_snapshot)
    (scratch,) = [e for e in rank.entries if e.source == "moe_route.route_scratch_bytes"]
    partials, counters = route_scratch_bytes(EXPERTS, 256)
    assert scratch.gpu_peak == partials + counters == 2 * 16 * (EXPERTS + 1) * 4 + 4 * 1024  # two K steps of 128
    fused = [s["name"] for s in served["steps"] if s["launches"].get("_route_kernel")]
    assert fused == ["capture 1", "capture 2", "capture 4", "decode 1", "decode 2", "decode 3", "decode 4"]
    for step in serving(served):
        if step["name"] not in fused:
            assert not [site for site in step["peaks"] if site.startswith(DECODE05)], step["name"]
            continue
        tokens = int(step["name"].split()[1])
        assert step["peaks"]["quant/kernels/moe_route.py:route"] == (
            partials + tokens * (EXPERTS + 1) * 2 + tokens * TOP_K * (4 + 4))  # bf16 logits, int32 ids, fp32 weights
        ours = sum(a["bytes"] for a in step["allocations"] if a["site"].startswith(DECODE05))
        vllms = sum(a["bytes"] for a in step["vllm_path"]["allocations"])
        assert vllms < ours <= vllms + partials, (step["name"], ours, vllms)


def test_nothing_compiles_while_serving(served):
    assert not new_variants(served)


def test_the_check_finds_bytes_beyond_an_entry_and_sites_it_lacks(served, demo_snapshot):
    """Not vacuous: the same serve against a ledger whose decode-07 partials hold the row cache's
    12 rows (not the eager 13..16-row steps'), or that has no entry for the row slots or decode-05's
    split-K scratch, fails."""
    rank = demo_ledger(demo_snapshot)
    twelve_rows = 16 * 12 * 4 * 65 * 4
    short = ledgers.RankLedger(0, [dataclasses.replace(e, gpu_peak=twelve_rows) if e.name == "decode-07 partials"
                                   else e for e in rank.entries])
    assert [p.split(":")[0] for p in outside_the_ledger(served, short)] == [
        "decode 13", "decode 14", "decode 15", "decode 16", "decode 16 with the long prompt"]
    without = ledgers.RankLedger(0, [e for e in rank.entries if e.name != "QSA row slots"])
    problems = outside_the_ledger(served, without)
    assert len(problems) == len(serving(served)) and all("main_metadata allocates" in p for p in problems)
    # the ledger before decode-05's split-K scratch: the fused steps' partials, the counters the capture keeps
    without = ledgers.RankLedger(0, [e for e in rank.entries if e.name != "decode-05 split-K scratch"])
    assert [p.split(":")[0] for p in outside_the_ledger(served, without)] == [f"decode {n}" for n in range(1, 5)]
    assert [p.split(":")[0] for p in kept_after_the_load(served, without)] == ["capture 1"]


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
    assert [r["qsa_layers"] for r in served_pp2] == [0, 1] and [r["moe_blocks"] for r in served_pp2] == [2, 2]
    assert first["num_blocks"] == last["num_blocks"] and first["block_size"] == last["block_size"] == 1024
    (load,) = [s for s in first["steps"] if s["allocations"]]  # its two MoE blocks' router rows, no more
    router_rows = next(e.gpu_startup for e in ranks[0].entries if e.name == "decode-05 router rows")
    assert router_rows == 2 * (EXPERTS + 1) * 256 * 2 and len(load["allocations"]) == 2
    assert load["name"] == "load" and kept(load) == {"serving/hooks/moe_decode.py:merge_router_rows": router_rows}
    assert first["arena_bytes"] == first["host_rows_bytes"] == 0
    assert not [e.name for e in ranks[0].entries if e.owner.startswith("qsa-offload")]
    by_name = {e.name: e for e in ranks[1].entries}
    load = next(s for s in last["steps"] if s["name"] == "load")
    assert kept(load) == {
        "quant/kernels/qsa_row_cache.py:__init__":
            by_name["QSA staging arena"].gpu_startup + by_name["decode-07 row-cache state"].gpu_startup,
        "serving/hooks/moe_decode.py:merge_router_rows": by_name["decode-05 router rows"].gpu_startup}
    assert not kept_after_the_load(last, ranks[1])
    assert last["arena_bytes"] == by_name["QSA staging arena"].gpu_startup
    assert last["host_rows_bytes"] == by_name["QSA K/V host rows"].pinned_host
    assert not outside_the_ledger(last, ranks[1])
    assert not new_variants(last)
    assert [s["name"] for s in serving(last)][-1] == f"decode {MAX_NUM_SEQS} with the long prompt"


# --- the PLE table served from its file (ple-mmap, decode-06, ttft-01) ---------------------------------

PLE_ENV = {**{k: v for k, v in ENV.items() if k != "VLLM_QSA_KV_OFFLOAD"}}
# vLLM's n-gram hash kernel over the step and the ids' host copy (PleFileServing.ngram_ids, for a
# step with a decode row: the host cannot hash a token sampled on the device); Python 3.12 inlines
# the comprehension into the method
NGRAM_IDS = {"serving/runtime/ple_file.py:<listcomp>", "serving/runtime/ple_file.py:ngram_ids"}
# flashnext's model state subclass allocates nothing itself (its PLE work runs in runtime/ple_file.py,
# an inner frame): what these sites record is its super() call's, vLLM's own model state's
VLLMS_MODEL_STATE = {"serving/models/qwen4_exp.py:" + m for m in ("__init__", "add_request", "prepare_inputs")}


def ple_ledger(demo_snapshot) -> ledgers.RankLedger:
    text = capacity.load_text_config(demo_snapshot)
    shape = dataclasses.replace(demo_shape(), ple_table_file=True)
    (rank,) = ledgers.ledger(text, shape, capacity.plan(text, shape),
                             deployment=Deployment(load_profile("3x3090"), demo_snapshot)).ranks
    return rank


@pytest.fixture(scope="module")
def served_ple(patched_tree, demo_snapshot, demo_table) -> dict:
    script = (SUPPORT_DIR / "engine_ledger_ple_scenario.py").read_text()
    args = (str(demo_snapshot), free_port(), str(demo_shape().max_num_batched_tokens), str(MAX_NUM_SEQS))
    return run_scenario(script, args, str(patched_tree), {**PLE_ENV, "VLLM_PLE_MMAP_PATH": str(demo_table)})


def test_ple_file_start_up_holds_what_the_ledger_says(served_ple, demo_snapshot, demo_table):
    """vLLM's own Model Runner V2 (support/engine_ledger_ple_scenario.py): the model built and its
    post-load step allocate ple-mmap's staged rows and decode-05's router rows as the ledger's
    weights entries say; vLLM's own profile run (``GPUModelRunner.profile_run``, its dummy step of
    the step budget through ``execute_model`` and flashnext's model state) makes the host staging
    buffer, the ledger's pinned entry as PyTorch's caching host allocator rounds it (the CPU does
    not pin: the bytes are the same)."""
    from flashnext.serving.capacity.rules import next_power_of_two

    by_name = {e.name: e for e in ple_ledger(demo_snapshot).entries}
    assert served_ple["backend"] == "FileBackedPLEEmbedding"
    steps = {s["name"]: s for s in served_ple["steps"]}
    load = kept(steps["load"])
    assert load.pop("serving/runtime/ple_file.py:__init__") == served_ple["staged_rows_bytes"] == (
        by_name["ple-mmap staged rows"].gpu_startup)
    assert load.pop("serving/hooks/moe_decode.py:merge_router_rows") == by_name["decode-05 router rows"].gpu_startup
    # the table's mapping (the page cache: neither device nor pinned memory), and vLLM's model state's buffers
    assert load.pop("quant/ple/mapped.py:as_tensor") == demo_table.stat().st_size
    assert set(load) == {"serving/models/qwen4_exp.py:__init__"}
    assert kept(steps["profile run"]) == {"serving/runtime/ple_file.py:stage": served_ple["host_staging_bytes"]}
    assert next_power_of_two(served_ple["host_staging_bytes"]) == by_name["ple-mmap host staging"].pinned_host
    assert not steps["KV cache"]["allocations"]


def test_ple_file_serving_allocates_nothing_the_ledger_lacks(served_ple):
    """vLLM's scheduler's steps (prefills, decodes, a long prompt's chunks beside them), each through
    ``execute_model``'s bookkeeping and flashnext's model state's ``prepare_inputs``, which hashes,
    advises and stages the step's rows: the staged rows and the host staging buffer are reused,
    nothing outlives a step, and what a step allocates is vLLM's own: its model state's, and its
    n-gram hash kernel's ids for a step with a decode row, no more than vLLM's profile run made at
    the same site for its step of the whole budget (so inside vLLM's profiled peak)."""
    steps = served_ple["steps"]
    profile = next(s for s in steps if s["name"] == "profile run")["peaks"]
    serving_steps = serving(served_ple)
    assert [s["decodes"] > 0 for s in serving_steps] == [False] + [True] * 7
    assert max(s["tokens"] for s in serving_steps) == 450  # the long prompt's chunk beside two decodes
    for step in serving_steps:
        assert not [a for a in step["allocations"] if a["outlived"]], step["name"]
        assert set(step["peaks"]) <= NGRAM_IDS | VLLMS_MODEL_STATE, step["name"]
        ids = {site: n for site, n in step["peaks"].items() if site in NGRAM_IDS}
        assert bool(ids) == (step["decodes"] > 0), step["name"]  # a prefill-only step is hashed on the host
        for site, n in ids.items():
            assert n <= profile[site], step["name"]
        if "serving/models/qwen4_exp.py:prepare_inputs" in step["peaks"]:
            assert step["peaks"]["serving/models/qwen4_exp.py:prepare_inputs"] <= profile[
                "serving/models/qwen4_exp.py:prepare_inputs"]
    assert served_ple["staging_kept"]  # the profile run's host staging buffer, every step
