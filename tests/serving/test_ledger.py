"""Issue 40: the memory ledger (serving/capacity/ledger.py), the staged prefill within its arena, and
the plan's KV cache specs against the ones the layers vLLM builds state (item 9).

- docs/serving.md's ledger tables are what the code computes, and `plan` prints and emits it;
- each entry is the size its allocation site allocates (the sites' own sizing functions, asked
  here of tensors built at the ledger's shapes on the meta device);
- the preflight's pinned terms are the ledger's host entries;
- a staged prefill whose context spans many windows keeps its scratch in the arena's last block and
  matches the torch reference (Triton's interpreter here; on a GPU, ``-m gpu``, it allocates no
  device memory at all);
- vLLM's own model, built at the release's dimensions at PP=2 with the patched tree (two gloo ranks,
  meta device), lays out exactly the specs, block size, blocks and block bytes the plan does.
"""

import dataclasses
import json
import os
import re

import pytest
import torch
from click.testing import CliRunner

from support import ROOT, SUPPORT_DIR, two_ranks

from flashnext.serving import capacity
from flashnext.serving.capacity import ledger as ledgers
from flashnext.serving.profiles import load_profile
from flashnext.tools.cli import main as cli

pytest.importorskip("vllm.v1.core.kv_cache_planning", reason="vLLM 0.34.0 is installed by .ci/run")

PROFILES = ("3x3090", "3x3090-mtp")


def ledger_of(name: str) -> ledgers.Ledger:
    profile = load_profile(name)
    return ledgers.profile_ledger(profile, capacity.plan_profile(profile))


def entry(rank: ledgers.RankLedger, name: str) -> ledgers.LedgerEntry:
    (found,) = [e for e in rank.entries if e.name == name]
    return found


# --- the ledger as docs/serving.md and `plan` show it ----------------------------------------------

@pytest.mark.parametrize("name", PROFILES)
def test_the_docs_show_the_ledger_the_code_computes(name):
    doc = (ROOT / "docs" / "serving.md").read_text()
    shown = re.search(rf"<!-- ledger: {re.escape(name)} -->\n(.*?)\n<!-- /ledger -->", doc, re.S)
    assert shown, f"docs/serving.md has no ledger table of {name}"
    assert shown.group(1) == ledgers.markdown(ledger_of(name))


def test_plan_prints_the_ledger_and_emits_it_in_json():
    text = CliRunner().invoke(cli, ["plan", "--profile", "3x3090-mtp", "--ledger"])
    assert text.exit_code == 0, text.output
    assert "memory ledger" in text.stdout and "  | decode-05 router rows |" in text.stdout
    assert all(line in text.stdout for line in ledgers.markdown(ledger_of("3x3090-mtp")).splitlines() if line)
    # without --ledger the VRAM table's flashnext column stands for it (issue 41: one table at a glance)
    short = CliRunner().invoke(cli, ["plan", "--profile", "3x3090-mtp"])
    assert short.exit_code == 0 and "memory ledger (MiB" not in short.stdout and "| decode-05" not in short.stdout
    assert "`--ledger`" in short.stdout
    out = CliRunner().invoke(cli, ["plan", "--profile", "3x3090-mtp", "--json"])
    assert json.loads(out.stdout)["ledger"] == ledger_of("3x3090-mtp").to_json()
    rig = CliRunner().invoke(cli, ["plan", "--gpus", "3", "--gpu-memory", "24", "--host-ram", "125", "--mtp", "--json"])
    assert [r["rank"] for r in json.loads(rig.stdout)["ledger"]["ranks"]] == [0, 1, 2]


@pytest.mark.parametrize("name", PROFILES)
def test_the_release_at_the_seeds_rig(name):
    """What each rank holds, in the numbers docs/serving.md reads against the seed's 24-34 MiB."""
    result = ledger_of(name)
    mtp = name.endswith("-mtp")
    for rank in result.ranks:
        blocks = 16 if rank.rank != 1 or not mtp else 17  # 16/17/15 plus the draft's MoE block on rank 2
        router = entry(rank, "decode-05 router rows")
        assert router.gpu_startup == router.gpu_peak == blocks * 513 * 2560 * 2 and router.inside == ledgers.WEIGHTS
        partials = entry(rank, "decode-07 partials")  # 4 rows (4 x 1, or 2 x (1 + 1)) in the graphs' pool
        assert partials.gpu_peak == 16 * 4 * 24 * 257 * 4 and partials.inside == ledgers.NONE
        # under the seed's least headroom (24 MiB): the router rows (40 MiB) moved to load, issue 40 item 3
        assert rank.gpu_outside_vllm < 24 * 2**20
        arena = entry(rank, "QSA staging arena")
        rows = (5 * 9_776) if mtp else (4 * 12_144)
        assert arena.gpu_startup == rows * 2048 and arena.inside == ledgers.WEIGHTS
        scratch = entry(rank, "staged-prefill scratch")  # one block of the arena
        assert scratch.within == "QSA staging arena" and scratch.gpu_peak == rows // (5 if mtp else 4) * 2048
    first, last = result.ranks[0], result.ranks[-1]
    assert entry(first, "vit-stream block slots").gpu_startup == 2 * 30_479_104
    assert entry(first, "ple-mmap staged rows").gpu_startup == 512 * 16 * 160 * 2
    drafts = [e.pinned_host for e in last.entries if e.name == "MTP draft embedding"]
    assert drafts == ([248_320 * (2_560 + 20 * 2)] if mtp else [])  # INT8 rows and bf16 scales a group of 128


# --- each entry is what its allocation site allocates ------------------------------------------------

def test_the_entries_are_what_the_allocation_sites_allocate():
    from flashnext.quant.kernels import configs
    from flashnext.quant.kernels import qsa_row_cache as rc
    from flashnext.serving.hooks import moe_decode

    text = capacity.load_text_config()
    for name in PROFILES:
        p = capacity.plan_profile(load_profile(name))
        result = ledger_of(name)
        blocks = capacity.qsa_arena_blocks(p.qsa_layers_per_rank)
        for rank, layers in zip(result.ranks, p.qsa_layers_per_rank):
            cache = rc.RowCache(layers, blocks, p.block_size, text.num_key_value_heads, text.head_dim,
                                torch.bfloat16, "meta")
            assert entry(rank, "QSA staging arena").gpu_peak == cache.nbytes
            assert entry(rank, "decode-07 row-cache state").gpu_peak == cache.state_nbytes
            q = torch.empty(4, text.num_attention_heads, text.head_dim, dtype=torch.bfloat16, device="meta")
            partials = rc._partials(configs.default_config("qsa_attention").splits, q)
            assert entry(rank, "decode-07 partials").gpu_peak == sum(t.numel() * t.element_size() for t in partials)
    # decode-05: the matrix merge_router_rows makes of a block's router and shared gate
    with torch.device("meta"):
        block = torch.nn.Module()
        block.gate = torch.nn.Linear(text.hidden_size, text.num_experts, bias=False, dtype=torch.bfloat16)
        block.shared_expert_gate = torch.nn.Linear(text.hidden_size, 1, bias=False, dtype=torch.bfloat16)
        moe_decode.merge_router_rows(block)
        rows = moe_decode._router_rows(block)
    per_block = rows.numel() * rows.element_size()
    assert tuple(rows.shape) == moe_decode.router_rows_shape(text.num_experts, text.hidden_size)
    assert entry(ledger_of("3x3090").ranks[0], "decode-05 router rows").gpu_peak == 16 * per_block


def test_the_preflights_terms_are_the_ledgers_host_entries():
    for name in PROFILES:
        profile = load_profile(name)
        p = capacity.plan_profile(profile)
        shape = capacity.ServingShape.from_profile(profile)
        for ple_format in (None, "file", "nvfp4"):
            terms = ledgers.pinned_host_terms(shape, p, ple_format=ple_format)
            result = ledgers.ledger(capacity.load_text_config(), shape, p, ple_format=ple_format)
            counted = {}
            for rank in result.ranks:
                for e in rank.entries:
                    if e.term:
                        counted[e.term] = counted.get(e.term, 0) + e.pinned_host
            assert {t.name: t.bytes for t in terms} == counted
            assert counted["QSA K/V"] == p.pinned_host_bytes_needed
            # without --ple-table (None) vLLM's engram offload pins the table, as pinned in a format
            assert ("PLE table" in counted) == (ple_format != "file")


# --- the staged prefill within its arena --------------------------------------------------------------

def staged_case(seed: int, device: str, block_size: int, head_dim: int, q_heads: int, arena_blocks: int,
                rows_per_request: int, contexts: list[int], tables: list[list[int]], num_blocks: int, topk: int):
    from flashnext.quant.kernels import qsa_row_cache as rc

    g = torch.Generator().manual_seed(seed)
    kv_heads = 2
    host = torch.randn(num_blocks, block_size, kv_heads, 2 * head_dim, generator=g).to(torch.bfloat16)
    if device == "cuda":
        from flashnext.serving.runtime.host_pool import uva_view

        pinned = host.pin_memory()
        host_kv = uva_view(pinned)
    else:
        pinned = host_kv = host
    rows = rows_per_request * len(contexts)
    token_to_req = torch.arange(len(contexts), dtype=torch.int32).repeat_interleave(rows_per_request)
    indices = torch.full((rows, topk + 1), -1, dtype=torch.int32)
    for r in range(rows):
        context = contexts[token_to_req[r]]
        count = min(topk, context)
        indices[r, :count] = torch.randperm(context, generator=g)[:count].int()
        indices[r, -1] = count
    q = torch.randn(rows, q_heads, head_dim, generator=g).to(torch.bfloat16)
    gate = torch.randn(rows, q_heads, head_dim, generator=g).to(torch.bfloat16)
    table = torch.tensor(tables, dtype=torch.int32)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    cache = rc.RowCache(3, arena_blocks, block_size, kv_heads, head_dim, torch.bfloat16, device)
    moved = [t.to(device) for t in (q, indices, table, token_to_req, seq_lens, gate)]
    return cache, host_kv, pinned, moved


def test_a_staged_prefill_over_many_windows_keeps_its_scratch_in_the_arena():
    from flashnext.quant.kernels import qsa_row_cache as rc
    from flashnext.quant.kernels import reference
    from flashnext.quant.kernels.configs import AttentionConfig

    # 100 query rows over 10 blocks of 64 tokens: the state and a chunk take 6 of the 8 arena blocks,
    # leaving windows of 2 blocks (5 windows) and chunks of 84 rows (2 a window)
    cache, host_kv, _, (q, indices, table, token_to_req, seq_lens, gate) = staged_case(
        5, "cpu", 64, 32, 4, 8, 50, [300, 250], [[3, 7, 1, 10, 2], [5, 0, 9, 11, 3]], 12, 96)
    scratch = rc.staged_scratch(100, 4, 32, 8, cache.arena[0].numel() * 2, 12, table.numel())
    assert scratch.in_arena and (scratch.window_blocks, scratch.chunks) == (2, 2)
    assert scratch.nbytes == 6 * cache.arena[0].numel() * 2
    cache.tags.fill_(3)
    out = torch.empty_like(q)
    got = cache.staged(q, host_kv, indices, table, token_to_req, seq_lens, gate, out,
                       config=AttentionConfig(block=16, splits=2, warps=2, stages=1))
    assert got is out
    ref = reference.reference_attention(q, host_kv, indices, table, token_to_req, gate)
    assert (got.float() - ref.float()).abs().max() <= 2 ** -6
    assert (cache.tags == rc.EMPTY_TAG).all()  # the arena was overwritten: every cached row dropped


@pytest.mark.gpu
def test_a_staged_prefill_allocates_no_device_memory():
    """The release's QSA layer (24 query heads, 2 KV heads of 256) with MTP's arena (5 x 9,776 rows),
    a 512-token chunk of a request whose context spans 11 blocks (3 windows of 4): PyTorch's
    allocator hands out nothing during the step."""
    from flashnext.quant.kernels import qsa_row_cache as rc
    from flashnext.quant.kernels import reference

    contexts = [11 * 9_776 - 100]
    cache, host_kv, pinned, (q, indices, table, token_to_req, seq_lens, gate) = staged_case(
        6, "cuda", 9_776, 256, 24, 5, 512, contexts, [list(range(11))], 11, 2048)
    out = torch.empty_like(q)
    cache.staged(q, host_kv, indices, table, token_to_req, seq_lens, gate, out)  # compiles the kernels
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = cache.staged(q, host_kv, indices, table, token_to_req, seq_lens, gate, out)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == before == torch.cuda.memory_allocated()
    ref = reference.reference_attention(q, host_kv, indices, table, token_to_req, gate)
    assert (got.float() - ref.float()).abs().max() <= 2 ** -5
    scratch = rc.staged_scratch(512, 24, 256, 5, 9_776 * 2048, 11, table.numel())
    assert scratch.in_arena and scratch.window_blocks == 4


# --- item 9: the specs of the layers vLLM builds -------------------------------------------------------

SPECS_SCENARIO = r'''
"""One rank of a PP=WORLD gloo group: vLLM's own qwen4_exp model (and on the last rank its MTP draft)
built for SNAPSHOT on the meta device, its block size aligned and its KV cache specs taken as Model
Runner V2 takes them (get_kv_cache_spec); rank 0 lays out every rank's specs with the engine core's
own planner (resolve_kv_cache_layout, get_global_kv_cache_groups, get_kv_cache_configs). Prints JSON.
Stood in for: the quantization config (dropped: the specs do not read it, the CPU has no kernels for
it); and, on the last rank, what patch qsa-offload asks of the
draft's model class (recorded first, then answered with the target's state specs)."""
import dataclasses, json, sys
import torch
from vllm.config import CacheConfig, replace, set_current_vllm_config
from vllm.distributed import get_pp_group

from support.vllm_demo import demo_vllm, plan_kv_caches

rank, port, snapshot, world, kv_bytes = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])


def drop_quantization(config):
    config.__dict__.pop("quantization_config", None)
    return config


def described(spec) -> dict:
    fields = {f.name: str(getattr(spec, f.name)) for f in dataclasses.fields(spec) if f.name != "is_draft"}
    return {"type": type(spec).__name__, "page_size_bytes": spec.page_size_bytes, **fields}


out = {"rank": rank}
with demo_vllm(snapshot, port, drop_quantization, CacheConfig(mamba_cache_mode="align", enable_prefix_caching=True),
               mtp=True, rank=rank, world=world, max_model_len=262144) as (config, qsa):
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models import ModelRegistry

    model_config, speculative = config.model_config, config.speculative_config
    with torch.device("meta"):
        initialize_model(vllm_config=config)
        if get_pp_group().is_last_rank:
            from flashnext.serving.hooks import qsa_offload as offload_hook

            draft_view = replace(config, model_config=speculative.draft_model_config)  # what its layers see
            try:
                offload_hook._offload_inputs(draft_view)
                out["draft_offload_inputs"] = "ok"
            except Exception as error:
                out["draft_offload_inputs"] = f"{type(error).__name__}: {error}"[:200]
                draft_cls, _ = ModelRegistry.resolve_model_cls(speculative.draft_model_config.architecture,
                                                               model_config=speculative.draft_model_config)
                target_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
                draft_cls.get_mamba_specs_from_config = target_cls.get_mamba_specs_from_config
            draft_config = speculative.apply_draft_overrides(config)
            with set_current_vllm_config(draft_config):
                initialize_model(vllm_config=draft_config, model_config=speculative.draft_model_config)
    from vllm.platforms.interface import Platform

    Platform._align_hybrid_block_size(config, qsa.Qwen4ExpQSABackend)
    out["block_size"] = config.cache_config.block_size
    specs, _, layout, configs, groups = plan_kv_caches(config, kv_bytes)
    out["specs"] = {name: described(spec) for name, spec in specs.items()}
    if rank == 0:
        out["num_blocks"] = [c.num_blocks for c in configs]
        out["block_bytes"] = [sorted({t.block_stride for t in c.kv_cache_tensors}) for c in configs]
        out["groups"] = sorted(sorted(g.layer_names) for g in groups)
print(json.dumps(out))
'''

KV_BYTES = 550_000_000


def release_config(demo_snapshot, tmp_path) -> str:
    """A snapshot directory with the release's config.json: the pinned manifest's text and vision
    configs; the keys it does not pin (none of which a KV cache spec reads: the gate's activation,
    norm epsilon, token ids) taken from the demo checkpoint's config."""
    manifest = capacity.base_manifest()
    demo = json.loads((demo_snapshot / "config.json").read_text())
    text = {**{k: v for k, v in demo["text_config"].items() if k not in ("layer_types", "bos_token_id")},
            **manifest["text_config"]}
    config = {**{k: v for k, v in demo.items() if k != "quantization_config"}, "text_config": text,
              "vision_config": manifest["vision_config"], "architectures": [manifest["architecture"]]}
    path = tmp_path / "release"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def built_pp2(patched_tree, demo_snapshot, tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("specs")
    script = tmp / "specs_scenario.py"
    script.write_text(SPECS_SCENARIO)
    env = {"HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1", "VLLM_QSA_KV_OFFLOAD": "1", "VLLM_VIT_STREAM": "0",
           "PYTHONPATH": os.pathsep.join([str(patched_tree), str(SUPPORT_DIR.parent)])}
    return two_ranks(env, str(script), (release_config(demo_snapshot, tmp), 2, KV_BYTES))


def comparable(spec) -> dict:
    fields = {f.name: str(getattr(spec, f.name)) for f in dataclasses.fields(spec) if f.name != "is_draft"}
    return {"type": type(spec).__name__, "page_size_bytes": spec.page_size_bytes, **fields}


@pytest.mark.slow
def test_the_plan_lays_out_the_specs_vllms_layers_state_at_pp2(built_pp2):
    """Item 9: at the release's dimensions with MTP at PP=2, each layer's spec (the compressed key at
    64 B/token, the ring, the state pages), the block size, the blocks and each rank's block bytes
    are the engine's own, not the plan's copy of them."""
    text = capacity.load_text_config()
    shape = capacity.ServingShape(pipeline_parallel_size=2, max_model_len=262_144, kv_cache_memory_bytes=KV_BYTES,
                                  prefix_caching=True, num_speculative_tokens=1, layer_partition=None,
                                  qsa_kv_offload=True, exact_host_pool=True)
    layout = capacity.kv_cache_layout(text, shape)
    p = capacity.plan(text, shape)
    first = built_pp2[0]
    for built, planned in zip(built_pp2, layout.rank_specs):
        engine = {name.removeprefix("language_model."): spec for name, spec in built["specs"].items()}
        assert engine == {name: comparable(spec) for name, spec in planned.items()}
        assert built["block_size"] == p.block_size == 6_976  # 7 QSA layers (the draft's) in a state page
    compressed = next(s for n, s in layout.rank_specs[0].items() if n.endswith("compressed_key_cache"))
    assert compressed.page_size_bytes == 6_976 // 4 * 128 * 2  # 64 B/token: no position stored
    assert first["num_blocks"] == [p.blocks] * 2 == [170, 170]
    assert first["block_bytes"] == [[b] for b in p.bytes_per_block]
    assert first["groups"] == sorted(sorted(n.replace("model.layers", "language_model.model.layers", 1)
                                            if n.startswith("model.") else n for n in g.layers) for g in p.groups)


@pytest.mark.slow
def test_the_draft_head_builds_with_the_offload(built_pp2):
    assert built_pp2[-1]["draft_offload_inputs"] == "ok"
