"""Issue 40: the ViT path (vit-first-rank, vit-stream) held to the memory ledger's vision entries
(serving/capacity/ledger.py: "vision tower (resident)", "vit-stream block slots", "vit-stream host
rows"), on the CPU through vLLM's own encoder call site.

vLLM 0.34.0's own Model Runner V2 for the demo checkpoint with the patched tree and vit-stream on:
the model built by ``initialize_model`` (the tower on the CPU), vLLM's post-load step (vit-stream's
``install``: host rows and two device slots), ``GPUModelRunner.load_model`` (its model state's
``EncoderRunner``); then image requests, each made into vLLM's own ``MultiModalKwargsItem`` by the
Qwen3-VL processor's field layout and encoded by ``EncoderRunner.execute_mm_encoder``, the call
site Model Runner V2 encodes a scheduled image with (support/engine_ledger_vision_scenario.py).
Every tensor flashnext's code allocates is recorded with its bytes and call site
(support/allocations.py). Held: the load allocates the slots and the host rows exactly as the
ledger's entries say and nothing else of vit-stream's, and leaves on the device the tower's other
modules, the ledger's resident entry; an image request allocates nothing of vit-stream's own (its
copies go into the slots), only what vLLM's block forward allocates inside vit-stream's wrapper,
none of it outliving the request, and the blocks stay views of the same slots.

Stand-ins (named in the scenario too): the demo's tower has one block, which vit-stream leaves
resident (no more blocks than slots), so the tower is built with five (the config's ``depth``, its
weights drawn from a seed), and the ledger reads the same config.json with five blocks; the image
processor (no tokenizer or processor in the demo: the pixels are drawn, laid out as the processor
lays them out); pageable host rows where the GPU's are pinned (``BlockStream`` pins only for a CUDA
device: the same bytes); CUDA streams and events; vLLM's Triton position-embedding interpolation
(its pure-torch one).

Not held: the encoder's activations against the ledger's estimate ("vision encoder activations",
vLLM's own, inside its profiled peak: vLLM profiles the encoder with its largest image). On the CPU
the blocks' attention is not the GPU's FlashAttention, and a 64-patch image's blocks alone peak at
90,112 B against the estimate's 81,920 B for the whole encoder (reported, not asserted); nor the ViT
linears vLLM's post-load step pins on a GPU (none are quantized here; their entry holds 0 bytes).
"""

import dataclasses
import json
import shutil

import pytest

from support import SUPPORT_DIR, free_port, run_scenario

from flashnext.serving import capacity
from flashnext.serving.capacity import ledger as ledgers
from flashnext.serving.capacity.vision import vision_plan
from flashnext.serving.deployment import Deployment
from flashnext.serving.profiles import load_profile

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")

ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1", "VLLM_VIT_STREAM": "1"}
DEPTH = 5  # blocks: more than vit-stream's two slots
GRIDS = ((1, 8, 8), (1, 8, 8), (1, 4, 16))  # images as patch grids: two alike, then another shape
PIXELS = 64 * 16 * 16  # each image's pixels, the ledger's max_pixels
STREAM = "serving/runtime/block_stream.py:"
VLLMS_BLOCK = STREAM + "streamed_forward"  # vLLM's block forward, run inside vit-stream's wrapper


@pytest.fixture(scope="module")
def five_blocks(demo_snapshot, tmp_path_factory):
    """A copy of the demo snapshot whose config.json has a five-block tower (what the scenario's
    tower is built from), for the ledger to read."""
    where = tmp_path_factory.mktemp("five-blocks") / "snapshot"
    shutil.copytree(demo_snapshot, where)
    config = json.loads((where / "config.json").read_text())
    config["vision_config"]["depth"] = DEPTH
    (where / "config.json").write_text(json.dumps(config))
    return where


def vision_ledger(demo_snapshot, five_blocks) -> ledgers.RankLedger:
    profile = capacity.ServingShape.from_profile(load_profile("3x3090"))
    shape = capacity.ServingShape(1, 4096, 4_000_000, True, 0, None, True, True, images=True, max_pixels=PIXELS,
                                  engram_cpu_offload=False, max_num_batched_tokens=profile.max_num_batched_tokens,
                                  cudagraph_capture_sizes=profile.cudagraph_capture_sizes)
    text = capacity.load_text_config(demo_snapshot)
    plan = dataclasses.replace(capacity.plan(text, shape),
                               vision=vision_plan(capacity.load_vision_config(five_blocks), True, PIXELS))
    (rank,) = ledgers.ledger(text, shape, plan, deployment=Deployment(load_profile("3x3090"), five_blocks)).ranks
    return rank


@pytest.fixture(scope="module")
def served(patched_tree, demo_snapshot) -> dict:
    script = (SUPPORT_DIR / "engine_ledger_vision_scenario.py").read_text()
    grids = ",".join(":".join(map(str, g)) for g in GRIDS)
    return run_scenario(script, (str(demo_snapshot), free_port(), str(DEPTH), grids), str(patched_tree), ENV)


def test_start_up_holds_the_towers_entries(served, demo_snapshot, five_blocks):
    """The load streams the five blocks: vit-stream allocates its two slots and its host rows (the
    ledger's slot entry and host-row entry) and nothing else; the tower's other modules are the
    ledger's resident entry."""
    by_name = {e.name: e for e in vision_ledger(demo_snapshot, five_blocks).entries}
    assert served["blocks"] == DEPTH and served["streamed"]
    load = next(s for s in served["steps"] if s["name"] == "load")
    ours = [a for a in load["allocations"] if a["site"].startswith(STREAM)]
    assert all(a["outlived"] for a in ours) and {a["site"] for a in ours} == {STREAM + "__init__"}
    assert sorted(a["bytes"] for a in ours) == sorted([served["slot_bytes"], served["host_row_bytes"]])
    assert served["slot_bytes"] == by_name["vit-stream block slots"].gpu_startup
    assert by_name["vit-stream block slots"].inside == ledgers.WEIGHTS  # the model's post-load step
    assert served["host_row_bytes"] == by_name["vit-stream host rows"].pinned_host
    assert by_name["vit-stream host rows"].term == "ViT blocks"
    assert served["tower_other_bytes"] == by_name["vision tower (resident)"].gpu_startup


def test_an_image_allocates_nothing_of_vit_streams_own(served):
    """Each image through vLLM's ``execute_mm_encoder``: what flashnext's frames see is vLLM's block
    forward inside vit-stream's wrapper (the copies go into the slots), none of it outlives the
    request, the same for the same image, and the blocks are still views of the same slots."""
    images = [s for s in served["steps"] if s["phase"] == "serving"]
    assert len(images) == len(GRIDS) and served["pixels"] == [PIXELS] * len(GRIDS)
    assert served["embeddings"] == [[64 // 4, 256]] * len(GRIDS)  # 2x2 merged patches, the text width
    for image in images:
        assert {a["site"] for a in image["allocations"]} == {VLLMS_BLOCK}, image["name"]
        assert not [a for a in image["allocations"] if a["outlived"]], image["name"]
    assert images[0]["allocations"] == images[1]["allocations"]
    assert served["slots_kept"]


def test_the_check_finds_a_slot_entry_the_tower_does_not_fill(served, demo_snapshot, five_blocks):
    """Not vacuous: the ledger of a resident tower (vit-stream off) lists no slots and counts every
    block as resident, which the load's allocations are not."""
    profile = capacity.ServingShape.from_profile(load_profile("3x3090"))
    shape = capacity.ServingShape(1, 4096, 4_000_000, True, 0, None, True, True, images=True, vit_stream=False,
                                  max_pixels=PIXELS, engram_cpu_offload=False,
                                  max_num_batched_tokens=profile.max_num_batched_tokens)
    text = capacity.load_text_config(demo_snapshot)
    plan = dataclasses.replace(capacity.plan(text, shape),
                               vision=vision_plan(capacity.load_vision_config(five_blocks), False, PIXELS))
    (resident,) = ledgers.ledger(text, shape, plan, deployment=Deployment(load_profile("3x3090"), five_blocks)).ranks
    by_name = {e.name: e for e in resident.entries}
    assert "vit-stream block slots" not in by_name and "vit-stream host rows" not in by_name
    assert by_name["vision tower (resident)"].gpu_startup != served["tower_other_bytes"]
