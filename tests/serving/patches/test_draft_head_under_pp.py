"""Patches mtp-01 and mtp-02, and mem-01's placement (vLLM 0.34.0's own since it absorbed that patch:
``ABSORBED`` in serving/patches/series.py), on vLLM 0.34.0's own ``Qwen4ExpForConditionalGeneration``
and ``Qwen4ExpMTP`` for the demo checkpoint, built on the CPU at PP=1 and at PP=2 (two gloo ranks
with vLLM's own pipeline groups), the release's INT8 ``embed_tokens`` and ``lm_head`` loaded through
vLLM's own loaders: the target's ``load_weights``, and for the draft vLLM's ``load_eagle_model``
(the default loader over the snapshot's files, then the drafter's sharing of the target's layers).

What each run does and stands in for is in ``tests/support/pp_ranks_scenario.py``. Values are
checked against the checkpoint's words dequantized by compressed-tensors' own unpacker, never
against the module's storage. On the CPU nothing can be pinned: mtp-02's move to pinned memory
behind UVA views is the H200 test ``tests/serving/hooks/test_host_pool.py``; here the bytes it
would pin are counted from the loaded module and compared with the plan's formula.
"""

import os

import pytest

from support import SUPPORT_DIR, free_port, run_scenario, two_ranks

pytestmark = pytest.mark.slow  # minutes in all on 2 cores: tests/conftest.py sends it to a worker first

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")

ENV = {"HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
EMBED = ["weight_packed", "weight_scale", "weight_shape"]
# one INT8 head of the demo: 4096 x 256 words, a bf16 scale per 128, the two-int64 shape
HEAD_BYTES = 4096 * 256 + 4096 * 2 * 2 + 16


def pp2(tree, snapshot, **switches) -> list[dict]:
    """Both ranks' results; ``tree`` None: the installed (stock) vLLM."""
    path = [str(tree)] if tree else []
    stock = {} if tree else {"VLLM_PLUGINS": ""}  # vLLM alone: flashnext's plugin left out
    env = {**ENV, **stock, **switches, "PYTHONPATH": os.pathsep.join([*path, str(SUPPORT_DIR.parent)])}
    return two_ranks(env, "pp_ranks_scenario.py", (snapshot, 2))


def pp1(tree, snapshot, **switches) -> dict:
    script = (SUPPORT_DIR / "pp_ranks_scenario.py").read_text()
    return run_scenario(script, ("0", free_port(), str(snapshot), "1"), str(tree) if tree else None,
                        {**ENV, "VLLM_TARGET_DEVICE": "cpu", **({} if tree else {"VLLM_PLUGINS": ""}), **switches})


@pytest.fixture(scope="module")
def patched_pp2(patched_tree, demo_snapshot):
    return pp2(patched_tree, demo_snapshot)


def test_mem01_embed_on_the_first_rank_and_lm_head_on_the_last(demo_snapshot, patched_pp2):
    # stock vLLM 0.34.0 places them itself (PPMissingLayer elsewhere); without int8-modules its
    # bf16 layers then refuse the release's INT8 tensors, each rank only its own module's
    first, last = pp2(None, demo_snapshot)
    assert (first["embed_tokens"], first["lm_head"]) == ("VocabParallelEmbedding", "PPMissingLayer")
    assert (last["embed_tokens"], last["lm_head"]) == ("PPMissingLayer", "ParallelLMHead")
    assert first["methods"] == ["UnquantizedEmbeddingMethod", "-"]
    assert last["methods"] == ["-", "UnquantizedEmbeddingMethod"]
    assert "'embed_tokens.weight_packed'" in first["target_error"] and "'lm_head.weight_packed'" in last["target_error"]
    # the series (no mem-01 in it) places them the same, with int8-modules' INT8 method
    first, last = patched_pp2
    assert (first["embed_tokens"], first["lm_head"]) == ("VocabParallelEmbedding", "PPMissingLayer")
    assert (last["embed_tokens"], last["lm_head"]) == ("PPMissingLayer", "ParallelLMHead")
    assert first["methods"] == ["Int8EmbeddingMethod", "-"] and last["methods"] == ["-", "Int8EmbeddingMethod"]
    # each rank's loader took its own module's INT8 tensors and skipped the other's
    assert first["loaded"] == [f"language_model.model.embed_tokens.{s}" for s in EMBED]
    assert last["loaded"] == [f"language_model.lm_head.{s}" for s in EMBED]
    assert first["head_bytes"] == last["head_bytes"] == HEAD_BYTES


def test_mtp01_mtp02_the_draft_on_the_last_of_two_ranks(patched_tree, demo_snapshot, patched_pp2):
    first, last = patched_pp2
    assert "draft_built" not in first  # Model Runner V2 builds the drafter on the last rank only
    built = last["draft_built"]
    # mtp-01: the draft's own embedding has int8-modules' method and loads the checkpoint's INT8 rows;
    # mtp-02: no lm_head of its own is built or loaded
    assert (built["embed_tokens"], built["lm_head"]) == ("VocabParallelEmbedding", "PPMissingLayer")
    assert built["methods"] == ["Int8EmbeddingMethod", "-"]
    assert built["loaded"] == [f"model.embed_tokens.{s}" for s in EMBED]
    # vLLM's drafter keeps the draft's embedding at PP > 1 and puts the target's lm_head in place
    assert "draft_error" not in last and not last["draft_embed_shared"] and last["draft_lm_head_shared"]
    assert last["draft_embedding_exact"]  # embed_input_ids gives the dequantized checkpoint rows
    # the forward embeds on this rank (global rank 1) and uses those rows: vLLM 0.34.0's draft branches
    # on whether it was handed intermediate tensors, not on the global first rank; it runs through
    assert last["draft_forward_embedded"]
    assert last["draft_forward"] == "ran" and last["draft_output_finite"]
    # mtp-02: what would be pinned (words and scales) is what the plan's formula counts
    assert last["draft_embed_pinned_bytes"] == last["plan_pinned_bytes"] == HEAD_BYTES - 16


def test_the_slim_switch_off_restores_the_draft_lm_head_copy(patched_tree, demo_snapshot):
    _, last = pp2(patched_tree, demo_snapshot, VLLM_MTP_SLIM_DRAFT="0")
    built = last["draft_built"]
    # mtp-02 off: the draft builds and loads an lm_head copy (INT8, mtp-01's method), then vLLM replaces it
    assert (built["embed_tokens"], built["lm_head"]) == ("VocabParallelEmbedding", "ParallelLMHead")
    assert built["loaded"] == sorted([f"lm_head.{s}" for s in EMBED] + [f"model.embed_tokens.{s}" for s in EMBED])
    assert last["draft_lm_head_shared"] and last["draft_embedding_exact"]
    # the forward still embeds on the last rank: that branch is vLLM 0.34.0's, no switch of flashnext's
    assert last["draft_forward_embedded"] and last["draft_forward"] == "ran"


def test_the_draft_at_pp1_shares_the_targets_int8_layers(patched_tree, demo_snapshot):
    """PP=1: vLLM's drafter replaces the draft's embed_tokens and lm_head by the target's, so mtp-02
    builds neither; with its switch off, the copies load the INT8 tensors (mtp-01's methods)."""
    got = pp1(patched_tree, demo_snapshot)
    built = got["draft_built"]
    assert (built["embed_tokens"], built["lm_head"]) == ("PPMissingLayer", "PPMissingLayer") and built["loaded"] == []
    assert "draft_error" not in got and got["draft_embed_shared"] and got["draft_lm_head_shared"]
    assert got["draft_embed_methods"] == ["Int8EmbeddingMethod", "Int8EmbeddingMethod"]
    assert got["draft_embedding_exact"] and got["draft_forward_embedded"] and got["draft_forward"] == "ran"
    got = pp1(patched_tree, demo_snapshot, VLLM_MTP_SLIM_DRAFT="0")
    built = got["draft_built"]
    assert built["methods"] == ["Int8EmbeddingMethod", "Int8EmbeddingMethod"] and len(built["loaded"]) == 6
    assert "draft_error" not in got and got["draft_embed_shared"] and got["draft_lm_head_shared"]
