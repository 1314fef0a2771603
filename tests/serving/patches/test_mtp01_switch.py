"""Patch mtp-01's switch. vLLM 0.34.0 fixed the draft's forward branch that ``VLLM_MTP_PP`` used to
turn back to stock (``ABSORBED`` in serving/patches/series.py), so the switch now turns off what is
left of the patch: the INT8 method of the draft's ``embed_tokens`` and ``lm_head``. Driven through
vLLM's own ``load_eagle_model`` on the last of two gloo ranks (tests/support/pp_ranks_scenario.py
says what it stands in for); the switch on is tests/serving/patches/test_draft_head_under_pp.py."""

import os

import pytest

from support import SUPPORT_DIR, two_ranks

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")


def test_mtp01_off_builds_the_draft_embedding_as_stock_and_vllm_refuses_the_int8_rows(patched_tree, demo_snapshot):
    env = {"HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1", "VLLM_MTP_PP": "0",
           "PYTHONPATH": os.pathsep.join([str(patched_tree), str(SUPPORT_DIR.parent)])}
    first, last = two_ranks(env, "pp_ranks_scenario.py", (demo_snapshot, 2))
    # the target's INT8 layers are int8-modules', which this switch leaves on
    assert first["methods"] == ["Int8EmbeddingMethod", "-"] and last["methods"] == ["-", "Int8EmbeddingMethod"]
    # the draft's own embedding is vLLM's unquantized one again, so vLLM's loader stops at the
    # checkpoint's INT8 words, as stock 0.34.0's does (seed 000 §7)
    assert "embed_tokens.weight_packed" in last["draft_error"], last["draft_error"]
    assert "methods" not in last["draft_built"]  # refused while loading, before anything was recorded
