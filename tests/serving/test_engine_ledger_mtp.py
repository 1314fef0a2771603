"""Issue 40's serving path with MTP: structured-output requests with MTP drafts, held to the memory
ledger (serving/capacity/ledger.py), on the CPU at PP=1 and 2.

vLLM 0.34.0's own engine classes serve the demo checkpoint with the patched tree and the 3x3090-mtp
profile's switches (support/engine_ledger_mtp_scenario.py): Model Runner V2 (``GPUModelRunner``)
with vLLM's MTP speculator, through start-up (the load with the draft's ``load_eagle_model``,
vLLM's profile run, the KV cache planned and bound, vLLM's kernel warm-up, the capture's stand-in)
and then ``EngineCore.step_with_batch_queue`` with async scheduling, ``AsyncScheduler``,
``StructuredOutputManager`` (xgrammar, over a word-level tokenizer beside the demo) and
``UniProcExecutor``: short structured requests arriving two a step until all MAX_NUM_SEQS verify
their drafts at once (2 x MAX_NUM_SEQS rows), then a long structured prompt in chunks over four
arena windows, the first beside their verify steps. Every step samples through vLLM's grammar
bitmask and rejection sampler and proposes through the draft's forward: flashnext's INT8
embedding (int8-modules, mtp-01), the draft's QSA layer through qsa-offload (decode-07's row cache
at 1..12 rows, ``host_attention`` above), its MoE block through decode-05 at 1..4 tokens. Every
tensor flashnext's code allocates is recorded with its bytes and call site, and every Triton launch
as Triton's cache key for an RTX 3090. The test fails if the load does not allocate exactly the
ledger's entries, if a later start-up step keeps what no entry holds from start-up, if a serving
allocation's site is not one the rank's ledger lists (:data:`SITES`) or an entry's bytes live at
once in a step beyond its serving peak, if anything a step allocates outlives it, or if a Triton
variant launched while serving was not launched during start-up.

The ledger is the 3x3090-mtp profile's at the demo's dimensions (its batch of 512 tokens, its
CUDA graphs of 1, 2 and 4 tokens, one draft token), with 8 sequences at PP=1, so that verify steps
of 6..16 rows run eagerly beside the graphs' 2 and 4, and 4 at PP=2.

What the serve found: int8-modules' embedding dequantizes a step's rows into fp32 scratch (about
ten bytes a weight of the step's rows, 13 MB at the release's 512-token step) that the ledger did
not list; it is its entry "INT8 embedding's rows" now (inside vLLM's profiled peak: the profile
run embeds a step of the budget, through the draft's dummy proposal here).

Stand-ins (named in the scenario too): CUDA streams, events and UVA buffers; the target's forward
(seeded hidden states; its weights but the embedding have no CPU kernel), its LM head's weights
(seeded bf16: the 3090 serves its INT8 words through vLLM's own kernel, which the CPU lacks); the
QSA indexer and the ``reshape_and_cache_flash`` op; the routed experts' kernel; the model layers'
kernels (vLLM's hyper-connection and QSA ops, flashnext's row cache: recorded, not run) and vLLM's
GDN state copies (the target's layers'); the CUDA-graph capture, by vLLM's eager dummy run of each
uniform decode size; the worker process around the runner; vLLM's warm-up only in its greedy
round (its top-k/top-p kernel does not run under Triton's interpreter; the serve is greedy). At
PP=2 (two gloo ranks, vLLM's pipeline groups and joint KV planning) the first rank builds,
profiles and plans with the last and leaves: the last rank serves with the first's hidden states
stood in and without broadcasting its samples back.

Not covered: the target's forward on the MTP path (its QSA layer and MoE block are
test_engine_ledger.py's); the hyper-connection mixers' INT8 projections (decode-04's fused mix and
decode_mma's scratch, in the target's layers; the draft's mixers are BF16, as in the release); the
LM head's INT8 kernel (vLLM's on a 3090); decode-05's steps against vLLM's own MoE path (its
tensors are taken as that path's here; test_engine_ledger.py compares them); more than one draft
token (the profiles draft one).
"""

import dataclasses
import json
import os

import pytest

from support import SUPPORT_DIR, free_port, run_scenario, two_ranks

from flashnext.serving import capacity
from flashnext.serving.capacity import ledger as ledgers
from flashnext.serving.capacity.shape import PP_LAYER_PARTITION
from flashnext.serving.deployment import Deployment
from flashnext.serving.profiles import load_profile

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")
pytestmark = pytest.mark.slow

PROFILE = "3x3090-mtp"
KV_BYTES = 4_000_000
# sequences at each pipeline size: at PP=1 verify steps of up to 16 rows; at PP=2, where the
# engine's batch queue takes a batch per stage, a shorter serve of the same kinds of step
MAX_NUM_SEQS = {1: 8, 2: 4}
# The profile's switches, but its layer split (three ranks of the release's 48 layers; the demo has
# four, split evenly) and the CUDA allocator's setting
ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1",
       **{k: v for k, v in load_profile(PROFILE).env.items()
          if k not in (PP_LAYER_PARTITION, "PYTORCH_CUDA_ALLOC_CONF")}}
# vLLM's Triton twin of the reshape_and_cache_flash CUDA op, which stands in for it on the CPU
STAND_IN_KERNELS = {"reshape_and_cache_kernel_flash"}
TOKENS = {"a": 2, "b": 3}  # the scenario's tokenizer's
MAX_TOKENS, LONG_TOKENS = 8, 4  # the scenario's

HOST = "host memory"  # pageable, for the host's part of a launch: the ledger counts device and pinned bytes
# decode-05's shared expert and vLLM's routed experts, called by decode-05: vLLM's path's own tensors
# for the step (test_engine_ledger.py holds them to that path)
VLLM_PATH = "vLLM's MoE path's own tensors"
# flashnext's model state subclass allocates nothing itself: its sites record its super() calls',
# vLLM's own model state's
VLLMS_MODEL_STATE = "vLLM's model state's own tensors"
NOT_ENTRIES = {HOST, VLLM_PATH, VLLMS_MODEL_STATE}
# Each flashnext call site on the MTP path that allocates after the load, and the ``source`` of the
# ledger entry whose sizing function it allocates by (or one of NOT_ENTRIES).
SITES = {
    "serving/quantization/int8.py:embedding": "decode_mma.gathered_rows_bytes",
    "quant/formats/packing.py:unpack_int32": "decode_mma.gathered_rows_bytes",
    "quant/formats/packing.py:dequantize_groups": "decode_mma.gathered_rows_bytes",
    "quant/kernels/qsa_row_cache.py:_partials": "qsa_row_cache.partials_bytes",
    "quant/kernels/qsa_row_cache.py:staged_attention": "qsa_row_cache.staged_scratch",
    "quant/kernels/qsa_row_cache.py:_staged_windows": HOST,
    "quant/kernels/qsa_row_cache.py:_window_remap": HOST,
    "serving/runtime/qsa_offload.py:main_metadata": "runtime/qsa_offload.row_slots_bytes",
    "quant/kernels/moe_route.py:route": "moe_route.route_scratch_bytes",
    "quant/kernels/_common.py:splitk_counters": "moe_route.route_scratch_bytes",
    "serving/hooks/moe_decode.py:_shared_expert": VLLM_PATH,
    "serving/hooks/moe_decode.py:forward": VLLM_PATH,
    "serving/models/qwen4_exp.py:__init__": VLLMS_MODEL_STATE,
    "serving/models/qwen4_exp.py:add_request": VLLMS_MODEL_STATE,
    "serving/models/qwen4_exp.py:prepare_inputs": VLLMS_MODEL_STATE,
}
INT8_ROWS = "INT8 embedding's rows"
# what the load allocates of the checkpoint's own tensors: the INT8 embedding's words, scales and
# shape as int8-modules' method makes them (vLLM's weights; at PP > 1 on the last rank the draft's own)
EMBEDDING_WORDS = "serving/quantization/int8.py:_int8_parameters"
EMBEDDING_BYTES = 4096 * 256 + 4096 * 2 * 2 + 16  # the demo's: its words, a bf16 scale per 128, the shape


def mtp_shape(world: int) -> capacity.ServingShape:
    """The 3x3090-mtp profile as the demo is served here: its switches, batch, CUDA graphs and
    draft tokens; the demo's length, KV memory and pipeline; no images; the PLE table in device
    memory (vLLM's, as in test_engine_ledger.py)."""
    return dataclasses.replace(
        capacity.ServingShape.from_profile(load_profile(PROFILE)), pipeline_parallel_size=world, max_model_len=4096,
        kv_cache_memory_bytes=KV_BYTES, layer_partition=None, images=False, engram_cpu_offload=False,
        max_num_seqs=MAX_NUM_SEQS[world])


def mtp_ledgers(demo_snapshot, world: int) -> list[ledgers.RankLedger]:
    text = capacity.load_text_config(demo_snapshot)
    shape = mtp_shape(world)
    return ledgers.ledger(text, shape, capacity.plan(text, shape),
                          deployment=Deployment(load_profile(PROFILE), demo_snapshot)).ranks


def scenario_args(demo_snapshot, model_dir, world: int) -> tuple:
    """engine_ledger_mtp_scenario.py's arguments after RANK and PORT."""
    shape = mtp_shape(world)
    return (world, demo_snapshot, model_dir, KV_BYTES, shape.max_num_batched_tokens, MAX_NUM_SEQS[world],
            ",".join(map(str, shape.cudagraph_capture_sizes)))


@pytest.fixture(scope="module")
def served(patched_tree, demo_snapshot, tmp_path_factory) -> dict:
    script = (SUPPORT_DIR / "engine_ledger_mtp_scenario.py").read_text()
    model_dir = tmp_path_factory.mktemp("mtp-pp1") / "model"
    args = ("0", free_port(), *map(str, scenario_args(demo_snapshot, model_dir, 1)))
    return run_scenario(script, args, str(patched_tree), ENV)


@pytest.fixture(scope="module")
def served_pp2(patched_tree, demo_snapshot, tmp_path_factory) -> list[dict]:
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(patched_tree), str(SUPPORT_DIR.parent)])}
    model_dir = tmp_path_factory.mktemp("mtp-pp2") / "model"
    return two_ranks(env, "engine_ledger_mtp_scenario.py", scenario_args(demo_snapshot, model_dir, 2))


def serving(result: dict) -> list[dict]:
    return [s for s in result["steps"] if s["phase"] == "serving" and s["tokens"]]


def kept(step: dict) -> dict[str, int]:
    """The bytes of each site's allocations in ``step`` that outlived it."""
    out = {}
    for a in step["allocations"]:
        if a["outlived"]:
            out[a["site"]] = out.get(a["site"], 0) + a["bytes"]
    return out


def outside_the_ledger(result: dict, rank: ledgers.RankLedger) -> list[str]:
    """What the serving steps allocated that ``rank``'s ledger does not hold: a site it does not
    list, or an entry's bytes live at once in a step beyond its serving peak (each site at its
    peak in the step: the INT8 embedding's three sites' peaks fall together)."""
    entries = {e.source: e for e in rank.entries}
    problems = []
    for step in serving(result):
        live = {}
        for site, peak in step["peaks"].items():
            source = SITES.get(site)
            if source is None or (source not in NOT_ENTRIES and source not in entries):
                problems.append(f"{step['name']}: {site} allocates, and the ledger lists no entry for it")
            elif source not in NOT_ENTRIES:
                live[source] = live.get(source, 0) + peak
        problems += [f"{step['name']}: {n:,} B of {entries[s].name!r}, whose serving peak is {entries[s].gpu_peak:,} B"
                     for s, n in live.items() if n > entries[s].gpu_peak]
    return problems


def kept_after_the_load(result: dict, rank: ledgers.RankLedger) -> list[str]:
    """What start-up steps after the load (the profile run, the KV cache, the warm-up, the capture)
    keep that ``rank``'s ledger does not hold from start-up: a site it lists no entry for, an entry
    inside vLLM's weights, or more than the entry's start-up bytes."""
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


def new_variants(result: dict) -> dict[str, set[str]]:
    """The Triton variants each serving step launched that none did before the serve (their kernels)."""
    startup = set(result["startup_keys"])
    new = {}
    for step in serving(result):
        kernels = {json.loads(k)[0] for k in step["keys"] if k not in startup} - STAND_IN_KERNELS
        if kernels:
            new[step["name"]] = kernels
    return new


def answer(req_id: str) -> list[int]:
    """What a request's grammar accepts: even ids and the long prompt "ab" repeated, odd ones "ba"."""
    first, second = ("a", "b") if req_id == "long" or int(req_id) % 2 == 0 else ("b", "a")
    return [TOKENS[first], TOKENS[second]] * ((LONG_TOKENS if req_id == "long" else MAX_TOKENS) // 2)


def test_structured_requests_are_served_with_mtp_drafts(served):
    """vLLM's engine serves what the test claims: async scheduling with its batch queue, every
    request's text what its grammar accepts (the target's seeded logits prefer other tokens: the
    grammar bitmask decides, through the rejection sampler's verification of each draft), verify
    steps of 2 and 16 rows, prefills beside decodes, the long prompt's chunks over four windows."""
    assert (served["scheduler"], served["batch_queue_size"]) == ("AsyncScheduler", 2)
    assert served["capture_sizes"] == [2, 4]  # the profile's sizes that hold whole decode steps (1 + 1 draft)
    assert served["finished"] == dict.fromkeys([*map(str, range(MAX_NUM_SEQS[1])), "long"], "length")
    assert served["texts"] == {r: answer(r) for r in served["finished"]}
    # PP=1: the draft shares the target's INT8 embedding (mtp-02 builds none) and LM head
    assert served["draft_embedding"] == {"shared": True, "method": "Int8EmbeddingMethod", "lm_head_shared": True}
    steps = serving(served)
    for step in steps:
        # vLLM's bitmask over each structured request's positions (its draft's and the bonus'), its
        # rejection sampler wherever a draft is verified, and the draft's QSA metadata every step
        assert step["launches"].get("_apply_grammar_bitmask_kernel") == (1 if step["structured_rows"] else None)
        assert step["launches"].get("_rejection_kernel") == (1 if step["drafts"] else None), step["name"]
        assert step["launches"]["_build_qsa_metadata_kernel"] == 2, step["name"]
    verify = {s["tokens"] for s in steps if s["drafts"] == s["requests"]}
    assert {2, 2 * MAX_NUM_SEQS[1]} <= verify
    full = [s for s in steps if s["tokens"] == 2 * MAX_NUM_SEQS[1]]
    assert all(s["structured_rows"] == 2 * MAX_NUM_SEQS[1] for s in full)
    # decode-07 at up to 12 rows (its plan), host_attention above; decode-05 at 1..4 tokens
    assert all("_plan_kernel" not in s["launches"] for s in full)
    assert all(s["launches"].get("_plan_kernel") == 1 and s["launches"].get("_route_kernel") == 1
               for s in steps if s["tokens"] == 2)
    chunks = [s for s in steps if s["tokens"] == 512]
    assert len(chunks) == 3 and chunks[0]["drafts"]  # the long prompt's first chunk beside verify steps
    # its last chunk, alone, attends over its four blocks of 560, a window each of the one-block
    # arena, their partial results folded
    last_chunk = [s for s in steps if s["tokens"] > 2 * s["requests"]][-1]
    assert served["block_size"] == 560 and last_chunk["requests"] == 1
    assert (last_chunk["launches"]["_attention_kernel"], last_chunk["launches"]["_fold_kernel"]) == (4, 3)


def test_mtp_start_up_holds_what_the_ledger_says(served, demo_snapshot):
    """The load allocates the QSA arena and row-cache state (the target's and the draft's QSA
    layer), decode-05's router rows (four MoE blocks and the draft's) and the checkpoint's INT8
    embedding (vLLM's weights, int8-modules' layout, which the draft shares) exactly; the later
    start-up steps keep only what the ledger holds from start-up (decode-05's split-K counters, at
    the warm-up's first fused step)."""
    (rank,) = mtp_ledgers(demo_snapshot, 1)
    by_name = {e.name: e for e in rank.entries}
    load = next(s for s in served["steps"] if s["name"] == "load")
    load = kept(load)
    assert load.pop("quant/kernels/qsa_row_cache.py:__init__") == (
        by_name["QSA staging arena"].gpu_startup + by_name["decode-07 row-cache state"].gpu_startup)
    assert load.pop("serving/hooks/moe_decode.py:merge_router_rows") == by_name["decode-05 router rows"].gpu_startup
    assert load.pop(EMBEDDING_WORDS) == EMBEDDING_BYTES
    assert set(load) == {"serving/models/qwen4_exp.py:__init__"}  # vLLM's model state's buffers
    assert (served["qsa_layers"], served["draft_qsa_layers"], served["moe_blocks"]) == (1, 1, 5)
    assert by_name["decode-05 router rows"].gpu_startup == 5 * 9 * 256 * 2
    assert served["arena_bytes"] == by_name["QSA staging arena"].gpu_startup
    assert served["host_rows_bytes"] == by_name["QSA K/V host rows"].pinned_host
    text = capacity.load_text_config(demo_snapshot)
    plan = capacity.plan(text, mtp_shape(1))
    assert (served["num_blocks"], served["block_size"]) == (plan.blocks, plan.block_size)
    assert not kept_after_the_load(served, rank)
    later = [kept(s) for s in served["steps"] if s["phase"] == "start-up" and s["name"] != "load"]
    assert [k for k in later if k] == [{"quant/kernels/_common.py:splitk_counters": 4 * 1024}]


def test_every_mtp_serving_allocation_is_in_the_ledger(served, demo_snapshot):
    """Each serving step's allocations are the ledger's, within each entry's serving peak, and
    none outlives its step. The INT8 embedding's rows reach their entry at a full chunk, as the
    profile run's dummy proposal did: inside vLLM's profiled peak."""
    (rank,) = mtp_ledgers(demo_snapshot, 1)
    assert not outside_the_ledger(served, rank)
    steps = serving(served)
    assert not [s["name"] for s in steps if kept(s)]
    entries = {e.source: e for e in rank.entries}
    peak = {}
    for step in [*steps, next(s for s in served["steps"] if s["name"] == "profile run")]:
        by_source = {}
        for site, n in step["peaks"].items():
            by_source[SITES[site]] = by_source.get(SITES[site], 0) + n
        for source, n in by_source.items():
            peak.setdefault(source, {})[step["name"]] = n
    rows = entries["decode_mma.gathered_rows_bytes"]
    assert (rows.name, rows.inside) == (INT8_ROWS, ledgers.PROFILED_PEAK)
    assert max(peak[rows.source].values()) == peak[rows.source]["profile run"] == rows.gpu_peak == 1_316_864
    assert max(peak["qsa_row_cache.partials_bytes"].values()) == 16 * 16 * 4 * 65 * 4  # 16 rows, eagerly
    assert max(peak["qsa_row_cache.staged_scratch"].values()) == entries["qsa_row_cache.staged_scratch"].gpu_peak


def test_nothing_compiles_while_serving_with_mtp(served):
    assert not new_variants(served)


def test_the_mtp_check_finds_what_the_ledger_lacks(served, demo_snapshot):
    """Not vacuous: the ledger before the INT8 embedding's rows fails every step (each embeds its
    tokens, the draft's proposal); one whose decode-07 partials hold the CUDA graphs' 4 rows and
    4 eager ones (the profile's 2 sequences' verify steps) fails the verify steps of more rows."""
    (rank,) = mtp_ledgers(demo_snapshot, 1)
    without = ledgers.RankLedger(0, [e for e in rank.entries if e.name != INT8_ROWS])
    problems = outside_the_ledger(served, without)
    assert len(problems) == 3 * len(serving(served)) and all("lists no entry" in p for p in problems)
    graphs_and_four = 2 * 16 * 4 * 4 * 65 * 4  # splits x rows x heads x (64 + 1) fp32, twice
    short = ledgers.RankLedger(0, [dataclasses.replace(e, gpu_peak=graphs_and_four) if e.name == "decode-07 partials"
                                   else e for e in rank.entries])
    problems = outside_the_ledger(served, short)
    failing = {s["name"] for s in serving(served) if any(p.startswith(s["name"] + ": ") for p in problems)}
    verify = {s["name"] for s in serving(served) if s["drafts"] == s["requests"] and s["tokens"] > 8}
    assert failing == verify and len(verify) >= 4


def test_each_rank_at_pp2_with_mtp_holds_its_own_ledger(served_pp2, demo_snapshot):
    """PP=2 over gloo: the first rank (two GDN layers, the target's INT8 embedding) allocates at
    the load its router rows and its embedding, and its ledger lists no QSA or draft entry; the
    last rank (the target's QSA layer and the draft) allocates the arena and row-cache state of
    both QSA layers, three blocks' router rows and the draft's own INT8 embedding (mtp-01; the
    bytes mtp-02 pins on a GPU: the ledger's "MTP draft embedding" and the 16-byte shape), then
    serves structured requests with drafts inside its ledger, compiling nothing."""
    first, last = served_pp2
    ranks = mtp_ledgers(demo_snapshot, 2)
    assert (first["qsa_layers"], first["moe_blocks"], first["arena_bytes"]) == (0, 2, 0)
    load = kept(first["steps"][0])
    assert load.pop("serving/hooks/moe_decode.py:merge_router_rows") == 2 * 9 * 256 * 2 == next(
        e.gpu_startup for e in ranks[0].entries if e.name == "decode-05 router rows")
    assert load.pop(EMBEDDING_WORDS) == EMBEDDING_BYTES and set(load) == {"serving/models/qwen4_exp.py:__init__"}
    assert not [e.name for e in ranks[0].entries if e.owner.startswith("qsa-offload") or "mtp" in e.owner]
    assert not kept_after_the_load(first, ranks[0])

    by_name = {e.name: e for e in ranks[1].entries}
    assert (last["qsa_layers"], last["draft_qsa_layers"], last["moe_blocks"]) == (1, 1, 3)
    assert last["draft_embedding"] == {"shared": False, "method": "Int8EmbeddingMethod", "lm_head_shared": True}
    load = kept(last["steps"][0])
    assert load.pop("quant/kernels/qsa_row_cache.py:__init__") == (
        by_name["QSA staging arena"].gpu_startup + by_name["decode-07 row-cache state"].gpu_startup)
    assert load.pop("serving/hooks/moe_decode.py:merge_router_rows") == by_name["decode-05 router rows"].gpu_startup
    assert load.pop(EMBEDDING_WORDS) == EMBEDDING_BYTES == by_name["MTP draft embedding"].pinned_host + 16
    assert set(load) == {"serving/models/qwen4_exp.py:__init__"}
    assert by_name["decode-05 router rows"].gpu_startup == 3 * 9 * 256 * 2
    assert last["host_rows_bytes"] == by_name["QSA K/V host rows"].pinned_host
    assert first["num_blocks"] == last["num_blocks"] and first["block_size"] == last["block_size"] == 560
    assert not kept_after_the_load(last, ranks[1])
    assert last["finished"] == dict.fromkeys([*map(str, range(MAX_NUM_SEQS[2])), "long"], "length")
    assert last["texts"] == {r: answer(r) for r in last["finished"]}
    assert not outside_the_ledger(last, ranks[1])
    assert not [s["name"] for s in serving(last) if kept(s)]
    assert any(s["drafts"] and s["structured_rows"] for s in serving(last))
    assert not new_variants(last)
