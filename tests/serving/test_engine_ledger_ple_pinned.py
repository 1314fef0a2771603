"""Issue 40: the PLE table pinned by vLLM (served without a ``--ple-table`` file) held to the memory
ledger (serving/capacity/ledger.py's "PLE table (pinned)"), on the CPU through Model Runner V2.

vLLM 0.34.0's own Model Runner V2 for the demo checkpoint with the patched tree, engram
``cpu_offload`` on and no ``VLLM_PLE_MMAP_PATH`` (what a profile gets without a table file, e.g. one
``plan --write-profile --ple-format bf16`` wrote): vLLM builds ``Qwen4ExpPLEPinnedHostEmbedding``,
whose ``allocate_embedding_weight`` patch host-pool sends to flashnext's exact-size pool; vLLM's
loader fills it, vLLM's own profile run and its scheduler's steps (prefills, decodes, a long prompt
in chunks beside them) read it through vLLM's own lookup kernel and prefetch buffer
(support/engine_ledger_ple_pinned_scenario.py). Held: the pinned bytes held after the load are the
ledger's pinned entry (one exact-size pool, the table in it), and stay so through the profile run and
every step; nothing of flashnext's outlives a step, and what a step allocates under flashnext's code
is its model state's super() call's, vLLM's own; the file path's entries are not this ledger's.

Stand-ins (named in the scenario too): the pool's page-locking (``cudaHostRegister``) and vLLM's
UVA view of the table (the table itself, read by vLLM's kernel under Triton's interpreter), CUDA
streams and events, the runner's UVA buffers, the model's forward but for its PLE layer, the sampler.

Not covered: the pinning itself (the H200's tests/serving/runtime/test_host_pool.py), the table
quantized by ``flashnext ple build --format`` (tests/serving/test_ledger.py holds its allocations to
vLLM's methods), and vLLM's prefetch buffer's bytes, which are vLLM's own (allocated by its profile
run and kept: inside its profiled peak).
"""

import dataclasses

import pytest

from support import SUPPORT_DIR, free_port, run_scenario
from test_engine_ledger import MAX_NUM_SEQS, PLE_ENV, VLLMS_MODEL_STATE, demo_shape, kept, serving

from flashnext.serving import capacity
from flashnext.serving.capacity import ledger as ledgers
from flashnext.serving.deployment import Deployment
from flashnext.serving.profiles import load_profile

pytestmark = pytest.mark.slow  # minutes in all on 2 cores: tests/conftest.py sends it to a worker first

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")

ENTRY = "PLE table (pinned)"


def pinned_ledger(demo_snapshot, exact_host_pool: bool = True) -> ledgers.RankLedger:
    text = capacity.load_text_config(demo_snapshot)
    shape = dataclasses.replace(demo_shape(), engram_cpu_offload=True, exact_host_pool=exact_host_pool)
    (rank,) = ledgers.ledger(text, shape, capacity.plan(text, shape),
                             deployment=Deployment(load_profile("3x3090"), demo_snapshot)).ranks
    return rank


@pytest.fixture(scope="module")
def served(patched_tree, demo_snapshot) -> dict:
    script = (SUPPORT_DIR / "engine_ledger_ple_pinned_scenario.py").read_text()
    args = (str(demo_snapshot), free_port(), str(demo_shape().max_num_batched_tokens), str(MAX_NUM_SEQS))
    return run_scenario(script, args, str(patched_tree), PLE_ENV)


def test_the_pinned_table_is_the_ledgers_entry(served, demo_snapshot):
    """After the load the process holds one exact-size pool, the table vLLM's pinned backend
    allocated and its loader filled, of exactly the ledger's pinned bytes; the profile run, the KV
    cache and every step pin nothing more. The ledger has no entry of the file's path."""
    rank = pinned_ledger(demo_snapshot)
    by_name = {e.name: e for e in rank.entries}
    entry = by_name[ENTRY]
    assert served["backend"] == "Qwen4ExpPLEPinnedHostEmbedding" and served["table_in_a_pool"]
    assert served["pools"] == [served["table_bytes"]] == [entry.pinned_host]
    assert entry.term == "PLE table" and entry.gpu_peak == 0
    assert {s["pooled"] for s in served["steps"]} == {entry.pinned_host}
    assert not {"ple-mmap staged rows", "ple-mmap host staging"} & set(by_name)
    steps = {s["name"]: s for s in served["steps"]}
    load = kept(steps["load"])
    assert load.pop("serving/hooks/moe_decode.py:merge_router_rows") == by_name["decode-05 router rows"].gpu_startup
    assert set(load) == {"serving/models/qwen4_exp.py:__init__"}  # vLLM's model state's buffers
    assert not kept(steps["profile run"]) and not steps["KV cache"]["allocations"]
    # not vacuous: with PyTorch's caching host allocator the ledger says a power of two, which the pool is not
    assert pinned_ledger(demo_snapshot, exact_host_pool=False).entries != rank.entries
    assert {e.name: e for e in pinned_ledger(demo_snapshot, False).entries}[ENTRY].pinned_host != served["pools"][0]


def test_serving_from_the_pinned_table_allocates_nothing_the_ledger_lacks(served):
    """vLLM's scheduler's steps through ``execute_model``'s bookkeeping, the model state's
    ``prepare_inputs`` and the PLE layer's lookup: nothing of flashnext's outlives a step, what a
    step allocates under flashnext's code is vLLM's model state's, the profile run's prefetch buffer
    (vLLM's) serves every step and the table is only read."""
    steps = serving(served)
    assert [s["decodes"] > 0 for s in steps] == [False] + [True] * 7
    assert max(s["tokens"] for s in steps) == 450  # the long prompt's chunk beside two decodes
    for step in steps:
        assert not [a for a in step["allocations"] if a["outlived"]], step["name"]
        assert set(step["peaks"]) <= VLLMS_MODEL_STATE, step["name"]
    assert served["prefetch_buffer_bytes"] and served["prefetch_buffer_kept"] and served["table_unchanged"]
