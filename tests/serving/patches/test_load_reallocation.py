"""Seed 000 §3.5 (issue 40, item 10): the layers flashnext's methods keep as loaded, int8-modules'
hyper-connection mixers and the bit-plane overlay's shared experts, each allocate their weights and
scales once after loading and free the loaded ones, as vLLM's kernels' repacks do for the other
layers (``flashnext.serving.quantization.load_pattern``; docs/serving.md, the memory ledger, says
why the overlay's layout does not make this moot, with the release's numbers)."""

import pytest

from support import SUPPORT_DIR, free_port, run_scenario

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")

ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}


@pytest.fixture(scope="module")
def bitplane_view(demo_snapshot, tmp_path_factory):
    from flashnext.quant.overlays.int6_repack import repack_int6
    from flashnext.quant.overlays.view import apply_overlays

    root = tmp_path_factory.mktemp("bitplane")
    repack_int6(demo_snapshot, root / "overlay")
    apply_overlays(demo_snapshot, [root / "overlay"], root / "view")
    return root / "view"


def test_vllms_post_load_step_reallocates_each_kept_layer_once(patched_tree, bitplane_view):
    """vLLM's own model for the demo checkpoint with the overlay applied, loaded by vLLM's loader,
    then vLLM's own post-load step, every allocation and free in it counted: each mixer projection
    (4 layers x 2 mixers x 2, and the final mixer's 2) and each bit-plane projection (4 layers x
    gate_up and down) allocates one region of each tensor's size, weights then scales, and frees
    the loaded one; the contents stay."""
    script = (SUPPORT_DIR / "load_reallocation_scenario.py").read_text()
    out = run_scenario(script, (str(bitplane_view), free_port()), str(patched_tree), ENV)
    assert out["layers"] == {"BitplaneLinearMethod": 8, "Int8LinearMethod": 18}
    assert out["each_allocated_then_freed_once"] and out["allocations"] == out["frees"] == 2 * (8 + 18)
    assert out["contents_and_sizes_kept"] and out["new_regions"]
    # the demo's sizes: per layer, the mixers' words 2 x (80 x 1,024 + 1,024 x 64) B and scales
    # 2 x (80 x 16 + 1,024) x 2 B, the planes 256 x 192 + 256 x 96 B and scales (256 x 4 + 256 x 2) x 2 B
    mixers = 2 * (80 * 1024 + 1024 * 64) + 2 * (80 * 16 + 1024) * 2
    planes = 256 * 192 + 256 * 96 + (256 * 4 + 256 * 2) * 2
    final_mixer = 64 * 1024 + 1024 * 64 + (64 * 16 + 1024) * 2
    assert out["bytes_reallocated"] == 4 * (mixers + planes) + final_mixer
