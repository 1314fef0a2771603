"""The patch series: zero-fuzz application to a shadow of the installed vLLM 0.34.0, probes, drift.
(What the series dropped because vLLM 0.34.0 does it: tests/serving/patches/test_absorbed_upstream.py.)"""

import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

from support import SUPPORT_DIR, free_port, run_scenario, two_ranks

import pytest
from click.testing import CliRunner

from flashnext.errors import FlashnextError
from flashnext.serving.patch_series import (apply_series, check_series, diffs, drift_table, installed_vllm_root,
                                           load_series)
from flashnext.serving.patches.series import ABSORBED
from flashnext.tools.cli import main as cli

pytestmark = pytest.mark.slow  # minutes in all on 2 cores: tests/conftest.py sends it to a worker first

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")

# the registry's own agreement tests are tests/serving/patches/test_patch_registry.py
SERIES = [p.id for p in diffs(load_series())]  # what `patches apply` applies: the entries kept as diffs
TOUCHED = sorted({t for p in load_series() for t in p.touches})


def test_check_applies_with_zero_fuzz_and_probes_without_touching_the_install():
    root = installed_vllm_root()
    target = root / "vllm/v1/worker/gpu_worker.py"
    before = target.read_bytes()
    result = CliRunner().invoke(cli, ["patches", "check", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["id"], r["verdict"], r["status"], r["ok"]) for r in rows] == [
        *((p.id, p.verdict, "applies" if p.verdict == "diff" else "registered", True) for p in load_series()),
        *((a.id, "absorbed", "absorbed", True) for a in ABSORBED)]
    assert target.read_bytes() == before


def test_the_drift_table_names_a_drifted_hunk_and_goes_on(tmp_path):
    """A release that moved one hunk: that diff fails by its hunk, is left out, and every other row
    is still reported; the command exits 1 naming what needs porting."""
    fake = _copy_touched(tmp_path)
    worker = fake / "vllm/v1/worker/gpu_worker.py"
    worker.write_text(worker.read_text().replace("        intermediate_tensors = None\n",
                                                 "        intermediate_tensors = None  # drifted\n", 1))
    rows = {r.id: r for r in drift_table(fake, absorbed=())}
    assert rows["decode-03"].status == "fails" and "Hunk #1 FAILED" in rows["decode-03"].detail
    assert not (worker.read_text().count("flashnext decode-03"))  # no hunk of the refused diff left behind
    # the tree holds only the touched files, which is all a diff's probe reads: every other diff applies
    assert {r.status for i, r in rows.items() if i != "decode-03" and r.verdict == "diff"} == {"applies"}
    result = CliRunner().invoke(cli, ["patches", "check", "--vllm", str(fake), "--no-progress"])
    assert result.exit_code == 1 and "need porting to this vllm" in result.output and "decode-03" in result.output


def _copy_touched(tmp_path: Path) -> Path:
    root = installed_vllm_root()
    fake = tmp_path / "site"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text("")
    for rel in {t for p in load_series() for t in p.touches}:
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / rel, fake / rel)
    return fake


def test_a_drifted_hunk_is_named(tmp_path):
    fake = _copy_touched(tmp_path)
    worker = fake / "vllm/v1/worker/gpu_worker.py"
    worker.write_text(worker.read_text().replace("        intermediate_tensors = None\n",
                                                 "        intermediate_tensors = None  # drifted\n", 1))
    with pytest.raises(FlashnextError, match=r"decode-03 does not apply with zero fuzz.*Hunk #1 FAILED"):
        check_series(fake)


def test_the_probe_fails_on_an_unpatched_tree(tmp_path, monkeypatch):
    import flashnext.serving.patch_series as ps

    monkeypatch.setattr(ps, "_apply", lambda patch, root: None)  # as if the patch silently did nothing
    with pytest.raises(FlashnextError, match="probe failed"):
        check_series()


def test_apply_in_place_to_a_copy(tmp_path):
    fake = _copy_touched(tmp_path)
    assert apply_series(fake).ids == [p.id for p in load_series() if p.verdict == "diff"]
    assert "deferred_intermediate_tensors(" in (fake / "vllm/v1/worker/gpu_worker.py").read_text()


def _run_scenario(pythonpath: str | None, extra_env: dict | None, script: str, args: tuple = ()) -> dict:
    return run_scenario(script, args, pythonpath, extra_env)


# --- ple-mmap, decode-06, ttft-01: vLLM's own runner and scheduler serving the PLE table file ------

def test_ple_file_is_served_by_vllms_runner_through_flashnexts_model_state(patched_tree, demo_snapshot, demo_table):
    """vLLM's GPUModelRunner with the model vLLM's registry resolves (flashnext's, registered by its
    plugin) and its model state (from vLLM's init_model_state), two requests scheduled by vLLM's
    Scheduler with prefix caching (tests/support/ple_model_state_scenario.py names its stand-ins:
    CUDA streams, the forward beyond the PLE layer, the sampler)."""
    script = (SUPPORT_DIR / "ple_model_state_scenario.py").read_text()
    env = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}

    def run(tree, **extra):
        return _run_scenario(tree, {**env, **extra}, script, (str(demo_snapshot), free_port()))

    stock = run(None, VLLM_PLUGINS="")  # vLLM 0.34.0 alone, the table in (CPU) device memory
    assert stock["model_state"] == "vllm.models.qwen4_exp.nvidia.model_state.Qwen4ExpModelState"
    assert stock["backend"] == "Qwen4ExpPLEDeviceEmbedding"
    served = run(str(patched_tree), VLLM_PLE_MMAP_PATH=str(demo_table))
    assert served["model"] == "flashnext.serving.models.qwen4_exp.Qwen4ExpForConditionalGeneration"
    assert served["model_state"] == "flashnext.serving.models.qwen4_exp.FlashnextQwen4ExpModelState"
    assert served["backend"] == "FileBackedPLEEmbedding" and served["weight_is_the_file"]
    steps = served["steps"]
    # vLLM's scheduler: a's prompt in three chunks, then b with its first 1,472 tokens cached
    assert [s["scheduled"] for s in steps] == [s["scheduled"] for s in stock["steps"]] == [
        {"a": 1024}, {"a": 448}, {"a": 28}, {"a": 1, "b": 256}, {"a": 1, "b": 44}, {"b": 1}]
    assert steps[3]["new"] == {"b": 1472} and steps[5]["finished"] == ["a"]
    # the same embeddings as stock at every step, bit for bit, and the staged ids are vLLM's kernel's
    assert [s["ple_sha256"] for s in steps] == [s["ple_sha256"] for s in stock["steps"]]
    assert all(s["ids_are_the_kernels"] for s in steps)
    # ple-mmap: prefill-only steps hash on the host (no copy of the ids from the device); a step
    # with a decode row copies once, its token being the device's
    assert [s["device_copies"] for s in steps] == [0, 0, 0, 1, 1, 1]
    assert [s["prefill_tokens_kept"] for s in steps] == [["a"]] * 3 + [["a", "b"]] * 2 + [["b"]]
    # decode-06: only the small step is advised
    assert [s["advised_layers"] for s in steps] == [0, 0, 0, 0, 0, 1]
    # ttft-01: a's 1,500 tokens in two windows at admission, b's 300 uncached ones in one; each
    # request's advised pages are exactly those its prefill read, and a is cancelled when it finishes
    assert [s["prefetched_windows"] for s in steps] == [2, 0, 0, 1, 0, 0]
    assert served["prefetch_is_what_prefill_read"] == {"a": True, "b": True} and served["cancelled"] == ["a"]

    off = run(str(patched_tree), VLLM_PLE_MMAP_PATH=str(demo_table), VLLM_PLE_DECODE_ADVICE="0",
              VLLM_PLE_PREFETCH="0")
    assert [s["ple_sha256"] for s in off["steps"]] == [s["ple_sha256"] for s in stock["steps"]]
    assert {s["advised_layers"] for s in off["steps"]} == {s["prefetched_windows"] for s in off["steps"]} == {0}
    no_table = run(str(patched_tree), VLLM_PLE_MMAP_PATH="")
    assert no_table["backend"] == "Qwen4ExpPLEDeviceEmbedding" and "device_copies" not in no_table["steps"][0]
    # ple-mmap's layer is refused when flashnext's plugin (whose model state stages it) is left out
    refused = run(str(patched_tree), VLLM_PLE_MMAP_PATH=str(demo_table), VLLM_PLUGINS="")
    assert "VLLM_PLE_MMAP_PATH needs flashnext's vLLM plugin" in refused["refused"]


# --- int8-modules: the release's INT8 embed_tokens and lm_head -------------------------------------

def test_int8_modules_load_and_serve_the_release_tensors(patched_tree, demo_snapshot):
    """vLLM's own demo model and weight loader on the CPU, fed the checkpoint's INT8 tensors
    (int8-modules, and decode-04's fused mix on vLLM's own GatedResidual)."""
    env = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
    script = (SUPPORT_DIR / "int8_modules_scenario.py").read_text()
    run = lambda tree, **extra: _run_scenario(tree, {**env, **extra}, script, (str(demo_snapshot), free_port()))
    refused = "There is no module or parameter named 'embed_tokens"
    stock = run(None)
    assert stock["loaded"] == refused and stock["methods"] == ["UnquantizedEmbeddingMethod"] * 2
    assert stock["hc_loaded"] == "AttributeError"  # the mixers' INT8 words meet a bf16 merged layer
    served = run(str(patched_tree))
    assert served["methods"] == ["Int8EmbeddingMethod"] * 2 and served["loaded"] is True
    assert served["embedding_exact"] and served["logits_shape"] == [3, 4096] and served["logits_error"] <= 2 ** -6
    assert served["weight_bytes_per_row"] == 256  # one byte a weight, as stored
    # the mixers (decode-04 included): the checkpoint's words in place, padding rows zero; the fused
    # mix applies and equals both vLLM's unfused path (switch off) and the torch reference bit for bit
    assert served["hc_loaded"] is True and served["hc_methods"] == ["Int8LinearMethod"]
    assert served["hc_weights_exact"] and served["hc_fused_applies"]
    assert served["hc_fused_equals_unfused"] and served["hc_equals_reference"]
    off = run(str(patched_tree), VLLM_INT8_MODULES="0")
    assert off["loaded"] == refused and off["hc_loaded"] == "AttributeError"


# --- mem-01, mtp-01, mtp-02: tests/serving/patches/test_draft_head_under_pp.py ---------------------


# --- decode-03: the receive deferred past input preparation ----------------------------------------

def test_decode03_overlaps_preparation_with_the_previous_rank():
    """Rank 0 sends after 1.0 s of "forward"; rank 1 "prepares" for 0.6 s. Stock 0.34.0 waits for
    the send before preparing (ready at ~1.6 s: its ``AsyncIntermediateTensors`` defers only the
    tensor wait, not the metadata receive); deferred, it prepares meanwhile (ready at ~1.0 s)."""
    _, deferred = two_ranks({}, "pp_recv_scenario.py")
    assert deferred["deferred"] and deferred["equal"] and deferred["vllms_async_tensors"]
    assert deferred["returned_after_s"] < 0.2 and deferred["forward_ready_after_s"] < 1.4
    _, stock = two_ranks({"VLLM_PP_DEFER_RECV": "0"}, "pp_recv_scenario.py")
    assert not stock["deferred"] and stock["equal"]
    assert stock["returned_after_s"] >= 0.9 and stock["forward_ready_after_s"] >= 1.5


# --- int6-bitplane: the bit-plane overlay served ---------------------------------------------------

def test_int6_bitplane_overlay_is_served(demo_snapshot, tmp_path):
    """vLLM's own demo model on the CPU, with the bit-plane overlay applied, in an unpatched vLLM:
    flashnext's general plugin, loaded by vLLM's own ``load_general_plugins``, registers the
    compressed-tensors config that serves it. (Without it, vLLM's own INT6 scheme refuses the planes
    on shape: tests/quant/overlays/test_repack_int6.py loads them into its own INT6 parameter.)"""
    from flashnext.quant.overlays.int6_repack import repack_int6
    from flashnext.quant.overlays.view import apply_overlays

    repack_int6(demo_snapshot, tmp_path / "overlay")
    apply_overlays(demo_snapshot, [tmp_path / "overlay"], tmp_path / "view")
    env = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
    script = (SUPPORT_DIR / "int6_bitplane_scenario.py").read_text()
    served = _run_scenario(None, env, script, (str(tmp_path / "view"), str(demo_snapshot), free_port()))
    assert served["methods"] == ["BitplaneLinearMethod"] and served["loaded"] is True
    assert served["weight_dtype"] == "torch.uint8"  # the planes as loaded, 3K/4 bytes a row
    assert served["gate_up_error"] <= 2 ** -7  # against the original dense weights; one bf16 rounding
    # switch off: the planes load, then become the original words for vLLM's own INT6 scheme
    assert served["fallback_method"] == ["BitplaneLinearMethod", "CompressedTensorsWNA16", False]
    assert served["fallback_words_equal_original"]


# --- decode-05: a decode step's MoE block routed by one kernel --------------------------------------

def test_decode05_routes_vllms_moe_block_through_the_fused_router(patched_tree, demo_snapshot, tmp_path):
    """vLLM 0.34.0's own MoE block for the demo checkpoint on the CPU, the router under Triton's
    interpreter. The routed experts' kernel is the one thing stood in for (this vLLM build has no
    CPU MoE kernels); it receives what vLLM's router or the fused one chose. Bit-plane mode: the
    shared expert is the INT6 overlay's, through the bit-plane kernels for 1..4 tokens."""
    from flashnext.quant.overlays.int6_repack import repack_int6
    from flashnext.quant.overlays.view import apply_overlays

    env = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
    script = (SUPPORT_DIR / "moe_decode_scenario.py").read_text()
    stock = _run_scenario(None, env, script, (str(demo_snapshot), free_port()))
    assert stock["patched"] is False
    repack_int6(demo_snapshot, tmp_path / "overlay")
    apply_overlays(demo_snapshot, [tmp_path / "overlay"], tmp_path / "view")
    for args in ((str(demo_snapshot),), (str(tmp_path / "view"), "bitplane")):
        patched = _run_scenario(str(patched_tree), env, script, (args[0], free_port(), *args[1:]))
        assert patched["patched"] is True
        if not patched["bitplane"]:  # the switch off is stock vLLM's block, output for output
            assert [r["stock_output"] for r in patched["steps"]] == [r["stock_output"] for r in stock["steps"]]
        else:
            assert patched["shared_expert_method"] == "BitplaneLinearMethod"
        for step in patched["steps"]:
            assert step["fused_path"] is (step["tokens"] <= 4)  # the CUDA-graph sizes only
            assert step["same_experts"]
            # one bf16 step: the interpreter rounds the kernel's logits toward zero, vLLM's CPU GEMM
            # to nearest, and vLLM's CPU router takes its softmax in bf16 (its GPU router in fp32)
            assert step["max_abs_diff"] <= 2 ** -7 * max(step["max_abs"], 1.0)
            if step["fused_path"]:
                assert step["router_logit_max_diff"] <= 2 ** -6 and step["gate_logit_max_diff"] <= 2 ** -6
                # given the kernel's logits, vLLM's own router picks the same experts and weights
                assert step["same_logits_same_experts"] and step["same_logits_max_weight_diff"] <= 2 ** -8
            else:
                assert step["max_abs_diff"] == 0.0


def test_decode05_hands_marlin_the_alignment_of_exactly_its_step():
    """``fused_marlin_moe`` takes the router's alignment only for the topk_ids it was made for, at the
    block size Marlin chose, without an expert map; once."""
    import torch

    from flashnext.serving.hooks import moe_decode

    assert [moe_decode.marlin_block_size(m, 10, 512) for m in (1, 4, 16)] == [8, 8, 8]
    assert moe_decode.marlin_block_size(4096, 10, 512) == 64
    ids = torch.zeros(2, 10, dtype=torch.int32)
    aligned = (torch.zeros(160, dtype=torch.int32), torch.zeros(20, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    moe_decode._pending_alignment = (ids, 8, 512, aligned)
    assert moe_decode.alignment_for(ids, 8, 512, None) is aligned
    assert moe_decode.alignment_for(ids, 8, 512, None) is None  # used once
    for other in ((ids.clone(), 8, 512, None), (ids, 16, 512, None), (ids, 8, 256, None),
                  (ids, 8, 512, torch.arange(512))):
        moe_decode._pending_alignment = (ids, 8, 512, aligned)
        assert moe_decode.alignment_for(*other) is None


def test_decode05_router_rows_are_the_gate_weights_own_memory(monkeypatch):
    """The block's post-load hook lays the router's and shared gate's weights out as one matrix they
    are views of, so vLLM's own path reads the same memory and a reload that copies into the
    parameters (as vLLM's weight loaders do) is seen by the fused kernel too; one that replaces
    them is merged again by the same hook, which vLLM runs after every load and update. With the
    switch off at load the weights stay as vLLM laid them out, and the fused path stands aside."""
    import torch

    from flashnext.serving.hooks import moe_decode

    def block():
        b = torch.nn.Module()
        b.gate = torch.nn.Linear(16, 8, bias=False, dtype=torch.bfloat16)
        b.shared_expert_gate = torch.nn.Linear(16, 1, bias=False, dtype=torch.bfloat16)
        return b

    b = block()
    want = torch.cat([b.gate.weight.detach(), b.shared_expert_gate.weight.detach()])
    assert moe_decode._router_rows(b) is None
    moe_decode.merge_router_rows(b)
    rows = moe_decode._router_rows(b)
    assert torch.equal(rows, want) and b.gate.weight.data_ptr() == rows.data_ptr()
    moe_decode.merge_router_rows(b)  # vLLM's hook again (a reload): nothing new allocated
    assert moe_decode._router_rows(b) is rows
    b.gate.weight.data.copy_(torch.ones(8, 16))  # a reload in place
    assert torch.equal(moe_decode._router_rows(b)[:8], torch.ones(8, 16))
    b.gate.weight = torch.nn.Parameter(torch.zeros(8, 16, dtype=torch.bfloat16))  # a reload that replaces it
    assert moe_decode._router_rows(b) is None
    moe_decode.merge_router_rows(b)
    assert torch.equal(moe_decode._router_rows(b)[:8], torch.zeros(8, 16))
    monkeypatch.setenv("VLLM_MOE_FUSED_DECODE", "0")
    off = block()
    moe_decode.merge_router_rows(off)
    assert moe_decode._router_rows(off) is None and off.gate.weight.shape == (8, 16)


# --- issue 15: the vision tower on the first pipeline rank only ------------------------------------

def test_vision_tower_only_on_the_first_rank_under_model_runner_v2(patched_tree, demo_snapshot):
    """Two gloo ranks build vLLM 0.34.0's own model for the demo checkpoint at PP=2 and load its
    vision tensors with the model's own loader. The vision part is stock: vLLM already does what
    seed 000 §6 patched: a later rank holds a ``StageMissingLayer`` and loads none of the tower.
    (0.33.0 did so under Model Runner V2 only, and this test also checked V1's resident tower on
    every rank; 0.34.0 removed V1, whose VLLM_USE_V2_MODEL_RUNNER=0 it now refuses.)"""
    env = {"HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(patched_tree), str(SUPPORT_DIR.parent)])}
    first, later = two_ranks(env, "vision_ranks_scenario.py", (demo_snapshot,))
    assert first["visual"] == "Qwen3_VisionTransformer" and first["visual_parameters"] > 0
    assert first["loaded_visual"] == first["checkpoint_visual_tensors"] > 0
    assert later["visual"] == "StageMissingLayer" and later["visual_parameters"] == 0
    assert later["loaded_visual"] == 0  # the tower's tensors are skipped, not refused


def test_vit_stream_runs_vllms_tower_from_two_slots(patched_tree, demo_snapshot):
    """vLLM 0.34.0's own vision tower for the demo checkpoint on the CPU, five blocks, weights from a
    seed; vLLM's model-level post-load hook installs the stream (patch vit-stream)."""
    env = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
    script = (SUPPORT_DIR / "vit_stream_scenario.py").read_text()
    stock = _run_scenario(None, env, script, (str(demo_snapshot), free_port()))
    assert stock["streamed"] is False and stock["device_storages"] == 60 and stock["finite"]
    # `flashnext plan`'s tower sizes are vLLM's modules' (the demo's vision config at 5 blocks)
    from flashnext.serving.capacity import load_vision_config

    vision = load_vision_config(demo_snapshot)
    assert vision.block_bytes() == stock["vllm_block_bytes"] and vision.other_bytes() == stock["vllm_other_bytes"]
    patched = _run_scenario(str(patched_tree), env, script, (str(demo_snapshot), free_port()))
    assert patched["streamed"] and patched["device_storages"] == 1  # every block's weights in the slots
    assert patched["device_bytes"] < 0.5 * patched["resident_block_bytes"]  # two slots for five blocks
    assert patched["bit_identical"] and patched["finite"]  # three runs of two images, as resident
    off = _run_scenario(str(patched_tree), {**env, "VLLM_VIT_STREAM": "0"}, script, (str(demo_snapshot), free_port()))
    assert off["streamed"] is False and off["device_storages"] == 60 and off["bit_identical"]


# --- `patches apply`: all or nothing, recorded, revertible (issue 26) --------------------------------

def _tree(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` with its mode, for byte-identity."""
    from support.hostile import tree_state

    return tree_state(root, modes=True)


def _apply_cli(fake: Path, *extra: str):
    from support.hostile import invoke_expecting_one_line

    result = CliRunner().invoke(cli, ["patches", "apply", "--target", str(fake), *extra])
    if result.exit_code != 0:
        _, line = invoke_expecting_one_line(["patches", "apply", "--target", str(fake), *extra])
        return result, line
    return result, result.output


@pytest.fixture
def fake_site(tmp_path) -> Path:
    fake = _copy_touched(tmp_path)
    os.chmod(fake / "vllm/models/qwen4_exp/nvidia/model.py", 0o600)  # a mode apply and revert keep
    return fake


@pytest.mark.parametrize("k", range(1, len(SERIES)))
def test_apply_interrupted_after_patch_k_leaves_the_target_unchanged(k, fake_site, monkeypatch):
    import flashnext.serving.patch_series as ps

    before = _tree(fake_site.parent)
    real, calls = ps._apply, []

    def interrupted(patch, root):
        if len(calls) == k:
            raise KeyboardInterrupt
        calls.append(patch.id)
        real(patch, root)

    with monkeypatch.context() as m:
        m.setattr(ps, "_apply", interrupted)
        result = CliRunner().invoke(cli, ["patches", "apply", "--target", str(fake_site)])
    assert result.exit_code == 130 and calls == SERIES[:k]
    assert _tree(fake_site.parent) == before
    result, out = _apply_cli(fake_site)
    assert result.exit_code == 0 and out.splitlines() == [f"applied {p}" for p in SERIES], out


@pytest.mark.parametrize("k", [0, len(TOUCHED) // 2, len(TOUCHED) - 1])  # the first, a middle and the last file
def test_apply_stopped_during_its_swap_puts_every_file_back(k, fake_site, monkeypatch):
    import flashnext.serving.patch_series as ps

    before = _tree(fake_site.parent)
    real, swapped = ps._swap_in, []

    def stopped(target, rel, data, mode):
        if len(swapped) == k:
            raise KeyboardInterrupt
        real(target, rel, data, mode)
        swapped.append(rel)

    with monkeypatch.context() as m:
        m.setattr(ps, "_swap_in", stopped)
        assert CliRunner().invoke(cli, ["patches", "apply", "--target", str(fake_site)]).exit_code == 130
    assert len(swapped) == k and _tree(fake_site.parent) == before
    assert _apply_cli(fake_site)[0].exit_code == 0


KILLED_DURING_SWAP = textwrap.dedent('''
    import os, signal, sys
    from pathlib import Path
    import flashnext.serving.patch_series as ps
    real, swapped = ps._swap_in, []
    def killed(target, rel, data, mode):
        if len(swapped) == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)  # no handler, no rollback: as a power cut
        real(target, rel, data, mode)
        swapped.append(rel)
    ps._swap_in = killed
    ps.apply_series(Path(sys.argv[1]))
''')


@pytest.mark.parametrize("then", ["revert", "rerun"])
def test_apply_killed_during_its_swap_is_reverted_or_finished(then, fake_site, tmp_path):
    import subprocess

    clean = _copy_touched(tmp_path / "clean")
    os.chmod(clean / "vllm/models/qwen4_exp/nvidia/model.py", 0o600)
    apply_series(clean)
    before = _tree(fake_site.parent)
    killed = subprocess.run([sys.executable, "-c", KILLED_DURING_SWAP, str(fake_site), "5"], capture_output=True)
    assert killed.returncode == -9, killed.stderr
    assert _tree(fake_site.parent) != before  # half patched, with its record
    if then == "revert":
        result, out = _apply_cli(fake_site, "--revert")
        assert result.exit_code == 0 and "reverted" in out, out
        assert _tree(fake_site.parent) == before
    else:
        result, out = _apply_cli(fake_site)
        assert result.exit_code == 0 and out.splitlines()[-1] == f"applied {load_series()[-1].id}", out
        record = ".flashnext-vllm-patches/record.json"
        without = lambda tree: {k: v for k, v in tree.items() if k != record}
        assert without(_tree(fake_site)) == without(_tree(clean))  # the originals kept included
        hashes = lambda site: {rel: (f["original_sha256"], f["patched_sha256"])
                               for rel, f in json.loads((site / record).read_text())["files"].items()}
        assert hashes(fake_site) == hashes(clean)
        assert "already patched" in _apply_cli(fake_site)[1]


def test_a_rerun_on_a_patched_tree_says_so_and_revert_restores_it_byte_for_byte(fake_site):
    before = _tree(fake_site.parent)
    mtimes = {rel: (fake_site / rel).stat().st_mtime_ns for p in load_series() for rel in p.touches}
    assert _apply_cli(fake_site)[0].exit_code == 0
    patched = _tree(fake_site.parent)
    assert patched != before and (fake_site / ".flashnext-vllm-patches" / "record.json").is_file()
    result, out = _apply_cli(fake_site)
    assert result.exit_code == 0 and out.startswith("already patched:") and len(out.splitlines()) == 1, out
    assert _tree(fake_site.parent) == patched
    result, out = _apply_cli(fake_site, "--revert")
    assert result.exit_code == 0, out
    assert _tree(fake_site.parent) == before
    assert {rel: (fake_site / rel).stat().st_mtime_ns for rel in mtimes} == mtimes  # cached bytecode valid again
    result, line = _apply_cli(fake_site, "--revert")
    assert result.exit_code == 1 and "nothing to revert" in line


def test_a_file_changed_after_apply_is_refused_by_a_rerun_and_by_revert(fake_site):
    assert _apply_cli(fake_site)[0].exit_code == 0
    edited = fake_site / "vllm/models/qwen4_exp/nvidia/model.py"
    edited.write_text(edited.read_text() + "# a local edit\n")
    before = _tree(fake_site.parent)
    for extra in ((), ("--revert",)):
        result, line = _apply_cli(fake_site, *extra)
        assert result.exit_code == 1 and "changed since `flashnext patches apply` patched it" in line, line
        assert _tree(fake_site.parent) == before


def test_a_touched_file_that_no_longer_compiles_is_one_line_and_changes_nothing(fake_site):
    broken = fake_site / "vllm/v1/worker/gpu_worker.py"
    broken.write_text(broken.read_text() + "\ndef broken(:\n    pass\n")
    before = _tree(fake_site.parent)
    result, line = _apply_cli(fake_site)
    assert result.exit_code == 1 and "gpu_worker.py no longer compiles: SyntaxError" in line, line
    assert _tree(fake_site.parent) == before


def test_a_tree_patched_without_a_record_is_named(fake_site):
    import flashnext.serving.patch_series as ps

    for patch in diffs(load_series()):  # as an older flashnext left it: patched in place, nothing kept
        ps._apply(patch, fake_site)
    before = _tree(fake_site.parent)
    result, line = _apply_cli(fake_site)
    assert result.exit_code == 1 and "has no record of flashnext's" in line, line
    assert _tree(fake_site.parent) == before


def test_apply_needs_a_vllm_under_its_target(tmp_path):
    result, line = _apply_cli(tmp_path)
    assert result.exit_code == 1 and "no vllm package there" in line


KILLED_WHILE_STAGING = textwrap.dedent('''
    import os, signal, sys
    from pathlib import Path
    import flashnext.serving.patch_series as ps
    real, applied = ps._apply, []
    def killed(patch, root):
        if len(applied) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        real(patch, root)
        applied.append(patch.id)
    ps._apply = killed
    ps.apply_series(Path(sys.argv[1]))
''')


def test_what_an_apply_killed_while_staging_left_is_removed_by_the_rerun(fake_site):
    import subprocess

    vllm_before = _tree(fake_site / "vllm")
    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_STAGING, str(fake_site)], capture_output=True)
    assert killed.returncode == -9, killed.stderr
    assert _tree(fake_site / "vllm") == vllm_before and list(fake_site.glob(".flashnext-vllm-patches.stage-*"))
    assert _apply_cli(fake_site)[0].exit_code == 0
    assert sorted(p.name for p in fake_site.iterdir()) == [".flashnext-vllm-patches", "vllm"]
