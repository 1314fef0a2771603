"""Issue 40: decode_mma's split-K scratch held to the memory ledger (serving/capacity/ledger.py's
"decode_mma split-K scratch"), on the CPU through vLLM's own layers.

vLLM 0.34.0's own ``qwen4_exp`` model for the demo checkpoint with the INT6 bit-plane overlay
applied, built with the patched tree: its shared experts get patch int6-bitplane's
``BitplaneLinearMethod`` through flashnext's registered compressed-tensors config, its
hyper-connection mixers int8-modules' ``Int8LinearMethod``, loaded by the model's own loader and
finished by vLLM's post-load step (which warms the bit-plane kernels); a stand-in for CUDA-graph
capture (one decode step of each of the 3x3090 profile's capture sizes), then decode steps of 1..16
rows through the layers' own call sites: the mixers' ``GatedResidual.mix`` (decode-04's fused mix:
``int8_mma`` with its SiLU epilogue, then its up/gate/mix kernel), the shared experts'
``gate_up_proj`` and ``down_proj`` (``bitplane_matmul``: the GEMV for 1..4 rows, the tensor-core
GEMM for 5..16) (support/engine_ledger_decode_mma_scenario.py). Every tensor flashnext's code
allocates is recorded with its bytes and call site (support/allocations.py), every Triton launch as
Triton's cache key for an RTX 3090 (support/triton_launches.py). Held: the load keeps decode_mma's
split-K counters as the ledger's entry says and nothing else of the kernels'; a serving step
allocates, at flashnext's kernel sites, only the split-K partials of the entry (no more than one
call's bound at once, the bound reached) and the layers' outputs (``[rows, N]`` in the input's dtype,
what vLLM's own linear method returns in their place); nothing outlives a step; no flashnext kernel
variant is launched while serving that start-up did not launch. Without the load's warm-up the
tensor-core kernel compiles at the first 5-row step, and the test says so.

The ledger is the demo's served as the 3x3090 profile's batch with the overlay (a ``Deployment`` of
the demo snapshot and the overlay: the served config.json lists the bit-plane modules).

Stand-ins (named in the scenario too): CUDA as the load's warm-up asks it (``BitplaneLinearMethod``
warms where launching compiles, on CUDA weights; the CPU's are not); CUDA-graph capture (one eager
step of each capture size); the kernels, recorded and not run (their arithmetic is held by
tests/quant/kernels/); the other layers' weights (the quantization config keeps the shared experts'
INT6 group and the mixers' INT8 group only: the CPU has no kernels for the rest).

Not covered: decode-05's fused shared-expert GEMVs (bitplane_gemv's, which allocate their output
only), decode_mma's INT8 GEMM for the mixers with decode-04 off (``VLLM_HC_FUSED_DECODE=0``: the
ledger counts it from the same function), the LM head (vLLM's own kernel on a GPU), and a graph's
pool beside an eager step (no graphs on the CPU: the entry's serving peak counts both).
"""

import dataclasses
import json

import pytest

from support import SUPPORT_DIR, free_port, run_scenario

from flashnext.serving import capacity
from flashnext.serving.capacity import ledger as ledgers
from flashnext.serving.deployment import Deployment
from flashnext.serving.profiles import load_profile

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")

ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
ENTRY = "decode_mma split-K scratch"
OUTPUT = "the layer's output"  # [rows, N]: what vLLM's own linear method returns in its place
# Each flashnext kernel site that allocates while serving, and what it allocates
SITES = {
    "quant/kernels/decode_mma.py:_splitk_partials": "decode_mma.mma_scratch_bytes",
    "quant/kernels/_common.py:splitk_counters": "decode_mma.mma_scratch_bytes",
    "quant/kernels/decode_mma.py:_mma": OUTPUT,
    "quant/kernels/bitplane_gemv.py:bitplane_gemv": OUTPUT,
    "quant/kernels/hc_mix.py:hc_up_gate_mix": OUTPUT,  # the block input, where vLLM's hc_gate_mix puts its own
}
KERNEL_SITES = ("quant/kernels/", "serving/quantization/bitplane.py:apply", "serving/hooks/hc_decode.py:")
MAX_ROWS = 16


@pytest.fixture(scope="module")
def bitplane(demo_snapshot, tmp_path_factory):
    """``(the overlay, the view of the snapshot with it)``."""
    from flashnext.quant.overlays.int6_repack import repack_int6
    from flashnext.quant.overlays.view import apply_overlays

    where = tmp_path_factory.mktemp("bitplane")
    repack_int6(demo_snapshot, where / "overlay")
    apply_overlays(demo_snapshot, [where / "overlay"], where / "view")
    return where / "overlay", where / "view"


def demo_shape() -> capacity.ServingShape:
    profile = capacity.ServingShape.from_profile(load_profile("3x3090"))
    return capacity.ServingShape(
        1, 4096, 4_000_000, True, 0, None, True, True, images=False, engram_cpu_offload=False,
        max_num_batched_tokens=profile.max_num_batched_tokens, max_num_seqs=MAX_ROWS,
        cudagraph_capture_sizes=profile.cudagraph_capture_sizes)


def demo_ledger(demo_snapshot, overlay) -> ledgers.RankLedger:
    text = capacity.load_text_config(demo_snapshot)
    shape = demo_shape()
    (rank,) = ledgers.ledger(text, shape, capacity.plan(text, shape),
                             deployment=Deployment(load_profile("3x3090"), demo_snapshot, (overlay,))).ranks
    return rank


def serve(patched_tree, view, warm_up: bool) -> dict:
    script = (SUPPORT_DIR / "engine_ledger_decode_mma_scenario.py").read_text()
    sizes = ",".join(map(str, demo_shape().cudagraph_capture_sizes))
    return run_scenario(script, (str(view), free_port(), sizes, "1" if warm_up else "0"), str(patched_tree), ENV)


@pytest.fixture(scope="module")
def served(patched_tree, bitplane) -> dict:
    return serve(patched_tree, bitplane[1], warm_up=True)


def steps(result: dict, phase: str) -> list[dict]:
    return [s for s in result["steps"] if s["phase"] == phase]


def output_widths(demo_snapshot) -> set[int]:
    """The outputs' widths of the layers the steps run: the mixers' down/inject (the final mixer's low
    rank) and their block input, the shared experts' merged gate/up and down."""
    from flashnext.quant.kernels.hc_mix import mixer_shapes

    text = capacity.load_text_config(demo_snapshot)
    (down, _), _ = mixer_shapes(text.hidden_size, text.hc_count, text.hc_lowrank)
    return {down, text.hc_lowrank, text.hidden_size, 2 * text.shared_expert_intermediate_size}


def outside_the_ledger(result: dict, rank: ledgers.RankLedger, widths: set[int]) -> list[str]:
    """What the serving steps allocate at flashnext's kernel sites that ``rank``'s ledger does not
    hold: a site the test does not know, an entry the ledger lacks, more bytes of it live at once
    than its serving peak, or an output that is not ``[rows, N]`` bf16 of a layer the step ran."""
    entries = {e.source: e for e in rank.entries}
    problems = []
    for step in steps(result, "serving"):
        rows = int(step["name"].split()[1])
        for site, peak in step["peaks"].items():
            if not site.startswith(KERNEL_SITES):
                continue
            source = SITES.get(site)
            if source is None:
                problems.append(f"{step['name']}: {site} allocates, and the test knows no entry for it")
            elif source == OUTPUT:
                problems += [f"{step['name']}: {site} allocates {a['bytes']:,} B, no layer's [{rows}, N] output"
                             for a in step["allocations"] if a["site"] == site and a["bytes"] not in
                             {rows * n * 2 for n in widths}]
            elif source not in entries:
                problems.append(f"{step['name']}: {site} allocates, and the ledger lists no entry for it")
            elif peak > entries[source].gpu_peak:
                problems.append(f"{step['name']}: {peak:,} B of {entries[source].name!r}, whose serving peak "
                                f"is {entries[source].gpu_peak:,} B")
    return problems


def kept(step: dict) -> dict[str, int]:
    out = {}
    for a in step["allocations"]:
        if a["outlived"] and a["site"].startswith("quant/kernels/"):
            out[a["site"]] = out.get(a["site"], 0) + a["bytes"]
    return out


def new_variants(result: dict) -> dict[str, set[str]]:
    """flashnext's Triton variants each serving step launched that no start-up step did (their kernels)."""
    ours = set(result["flashnext_kernels"])
    startup = {k for s in steps(result, "start-up") for k in s["keys"]}
    new = {}
    for step in steps(result, "serving"):
        kernels = {json.loads(k)[0] for k in step["keys"] if k not in startup} & ours
        if kernels:
            new[step["name"]] = kernels
    return new


def test_the_serve_reaches_the_decode_kernels(served):
    """vLLM built the layers with flashnext's methods; decode-04 mixes every step through the
    tensor-core GEMM, the bit-plane layers take the GEMV for 1..4 rows and the GEMM for 5..16 (the
    launch table's default row), and the load warmed the GEMM and the prefill GEMM."""
    assert served["methods"] == ["BitplaneLinearMethod"] and served["mixer_methods"] == ["Int8LinearMethod"]
    load = next(s for s in served["steps"] if s["name"] == "load")
    assert load["launches"] == {"_mma_kernel": 8, "_gemm_kernel": 8}  # 4 shared experts x (gate_up, down)
    by_name = {s["name"]: s for s in served["steps"]}
    for rows in range(1, MAX_ROWS + 1):
        launched = by_name[f"decode {rows}"]["launches"]
        assert launched["_up_gate_mix_kernel"] == 9  # 4 layers x 2 mixers and the final one
        assert launched["_mma_kernel"] == 9 + (8 if rows > 4 else 0)
        assert launched.get("_gemv_kernel", 0) == (8 if rows <= 4 else 0)


def test_start_up_keeps_the_counters_the_ledger_says(served, demo_snapshot, bitplane):
    """The load (vLLM's post-load step warming the bit-plane kernels) keeps decode_mma's split-K
    counters, the entry's kept bytes, and nothing else of the kernels'; the capture's steps keep
    nothing; the entry's start-up bytes are those and one call's partials in the graphs' pool."""
    from flashnext.quant.kernels.decode_mma import mma_scratch_bytes

    (entry,) = [e for e in demo_ledger(demo_snapshot, bitplane[0]).entries if e.name == ENTRY]
    partials, counters = mma_scratch_bytes("hc_down_inject", 80, 1024, 64)  # the demo's mixers: 68 rows padded
    assert partials == 16 * 16 * 80 * 4 and counters == 4 * 1024
    assert entry.gpu_startup == counters + partials and entry.gpu_peak == counters + 2 * partials
    assert entry.owner == "decode-04, int6-bitplane (decode_mma)" and entry.inside == ledgers.NONE
    load = next(s for s in served["steps"] if s["name"] == "load")
    assert kept(load) == {"quant/kernels/_common.py:splitk_counters": counters}
    assert served["counters"] == served["counters_after"] == {"decode_mma": counters}
    assert not any(kept(s) for s in steps(served, "start-up") if s["name"] != "load")


def test_every_serving_allocation_is_the_ledgers_or_the_layers_output(served, demo_snapshot, bitplane):
    rank = demo_ledger(demo_snapshot, bitplane[0])
    widths = output_widths(demo_snapshot)
    assert not outside_the_ledger(served, rank, widths)
    serving = steps(served, "serving")
    assert len(serving) == MAX_ROWS
    assert not [a for s in serving for a in s["allocations"] if a["outlived"]]  # nothing a step leaves behind
    # no more than one call's partials live at once, and every step reaches the bound (the mixers')
    (entry,) = [e for e in rank.entries if e.name == ENTRY]
    bound = entry.gpu_peak - entry.gpu_startup
    assert {s["peaks"]["quant/kernels/decode_mma.py:_splitk_partials"] for s in serving} == {bound}


def test_nothing_compiles_while_serving(served):
    assert {"_mma_kernel", "_gemv_kernel", "_up_gate_mix_kernel", "_gemm_kernel"} <= set(served["flashnext_kernels"])
    assert not new_variants(served)


def test_the_check_finds_an_entry_missing_or_too_small(served, demo_snapshot, bitplane):
    """Not vacuous: the same serve against the ledger without the entry (as before it), or with its
    serving peak at one call's partials less, fails at every step."""
    rank = demo_ledger(demo_snapshot, bitplane[0])
    widths = output_widths(demo_snapshot)
    without = ledgers.RankLedger(0, [e for e in rank.entries if e.name != ENTRY])
    problems = outside_the_ledger(served, without, widths)
    assert len(problems) == MAX_ROWS and all("_splitk_partials allocates, and the ledger lists no entry" in p
                                             for p in problems)
    (entry,) = [e for e in rank.entries if e.name == ENTRY]
    small = ledgers.RankLedger(0, [dataclasses.replace(e, gpu_peak=e.gpu_peak // 4) if e.name == ENTRY else e
                                   for e in rank.entries])
    assert len(outside_the_ledger(served, small, widths)) == MAX_ROWS
    assert outside_the_ledger(served, rank, widths - {80})  # an output no layer of the step gives: [rows, 80]


def test_without_the_warm_up_the_tensor_core_kernel_compiles_while_serving(patched_tree, bitplane):
    """The load without ``warm_bitplane_matmul`` (what the CPU's weights give without the stand-in):
    the bit-plane layers' tensor-core GEMM is first launched at the first 5-row step, after
    start-up, and its counters (shared with the mixers', already there) are not the load's."""
    result = serve(patched_tree, bitplane[1], warm_up=False)
    new = new_variants(result)
    assert set(new) == {f"decode {rows}" for rows in range(5, MAX_ROWS + 1)}
    assert all(kernels == {"_mma_kernel"} for kernels in new.values())
    load = next(s for s in result["steps"] if s["name"] == "load")
    assert not kept(load) and load["launches"] == {}
    capture = next(s for s in result["steps"] if s["name"] == "capture 1")
    assert kept(capture) == {"quant/kernels/_common.py:splitk_counters": 4 * 1024}
