"""The QSA offload kernels (host K/V rows, the decode-07 row cache, staged prefill) against their
torch references: through Triton's CPU interpreter here, on pinned host memory through UVA on the
GPU machine (``-m gpu``; results in docs/benchmarks.md)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from flashnext.quant.kernels import qsa_row_cache as rc
from flashnext.quant.kernels import reference
from flashnext.quant.kernels.configs import AttentionConfig

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def gen(seed):
    return torch.Generator().manual_seed(seed)


class Cache:
    """A small offloaded QSA layer: host rows, block tables, and selections like the indexer's."""

    def __init__(self, blocks=12, block_size=16, kv_heads=2, q_heads=4, head_dim=32, topk=48, seed=0):
        self.g = gen(seed)
        self.block_size, self.kv_heads, self.q_heads, self.head_dim, self.topk = (block_size, kv_heads, q_heads,
                                                                                   head_dim, topk)
        host = torch.randn(blocks, block_size, kv_heads, 2 * head_dim, generator=self.g).to(torch.bfloat16)
        if GPU:
            from flashnext.serving.runtime.host_pool import uva_view

            self.pinned = host.pin_memory()
            self.host_kv = uva_view(self.pinned)
        else:
            self.pinned = self.host_kv = host

    def rewrite(self, slots):
        """A store: new bytes in ``slots``' host rows, written through the UVA view (by the GPU
        there) as the served store path writes them."""
        flat = self.host_kv.view(-1, self.kv_heads, 2 * self.head_dim)
        rows = torch.randn(len(slots), self.kv_heads, 2 * self.head_dim, generator=self.g).to(torch.bfloat16)
        flat[slots.to(flat.device)] = rows.to(flat.device)
        if GPU:
            torch.cuda.synchronize()

    def step(self, tables, contexts, rows_per_request=1, previous=None, overlap=0.0):
        """Query rows, their selections (``overlap`` of each kept from ``previous``) and gates."""
        rows = rows_per_request * len(contexts)
        token_to_req = torch.arange(len(contexts), dtype=torch.int32).repeat_interleave(rows_per_request)
        indices = torch.full((rows, self.topk + 1), -1, dtype=torch.int32)
        for r in range(rows):
            context = contexts[token_to_req[r]]
            count = min(self.topk, context)
            chosen = torch.randperm(context, generator=self.g)[:count]
            if previous is not None and overlap:
                keep = int(overlap * count)
                old = previous[r, :previous[r, -1]]
                chosen = torch.cat([old[:keep].long(), chosen[~torch.isin(chosen, old[:keep].long())]])[:count]
            indices[r, :count] = chosen.int()
            indices[r, -1] = count
        q = torch.randn(rows, self.q_heads, self.head_dim, generator=self.g).to(torch.bfloat16)
        gate = torch.randn(rows, self.q_heads, self.head_dim, generator=self.g).to(torch.bfloat16)
        table = torch.tensor(tables, dtype=torch.int32)
        return [t.to(DEVICE) for t in (q, indices, table, token_to_req, gate)]


CONFIG = AttentionConfig(block=16, splits=2, warps=2, stages=1)


def test_host_attention_matches_the_reference():
    c = Cache()
    q, indices, table, token_to_req, gate = c.step([[3, 7, 1], [5, 0, 9]], [40, 33], rows_per_request=2)
    got = rc.host_attention(q, c.host_kv, indices, table, token_to_req, gate, config=CONFIG)
    ref = reference.reference_attention(q, c.host_kv, indices, table, token_to_req, gate)
    assert (got.float() - ref.float()).abs().max() <= 2 ** -6


def test_invalidate_drops_exactly_the_stored_slots():
    tags = torch.tensor([16, -1, 2, 35, 4, 21, 6, 7], dtype=torch.int64, device=DEVICE)
    stored = torch.tensor([2, 3, 21, 99, -1, 35 + 8], device=DEVICE)
    expected = reference.reference_invalidate(tags.clone().cpu(), stored.cpu())
    rc.invalidate_slots(tags, stored)
    assert tags.tolist() == expected.tolist() == [16, -1, -1, 35, 4, -1, 6, 7]  # 3, 99, 43 were not cached


def test_row_cache_steps_are_bit_exact_and_keep_the_protocol():
    """Hits, misses, collisions, prefix sharing, stores between steps, against the host-only path."""
    c = Cache(blocks=10, seed=1)
    cache = rc.RowCache(1, 1, 16, c.kv_heads, c.head_dim, torch.bfloat16, DEVICE)  # 16 sets: many collisions
    tables = [[4, 2, 8], [4, 2, 6]]  # both requests share their first two blocks (a common prefix)
    tags_ref = cache.tags[0].clone().cpu()
    arena_ref = cache.layer_rows[0].clone().cpu()
    previous, hits_seen = None, 0
    for step in range(12):
        q, indices, table, token_to_req, gate = c.step(tables, [45, 40], rows_per_request=2,
                                                      previous=previous, overlap=0.8)
        if step in (4, 9):  # a store rewrites rows, then invalidates them
            stored = reference.reference_slots(indices, table, token_to_req, 10, 16)[0, :5].cpu()
            stored = stored[stored >= 0]
            c.rewrite(stored)
            cache.invalidate(0, stored.to(DEVICE))
            reference.reference_invalidate(tags_ref, stored)
        got = cache.attend(0, q, c.host_kv, indices, table, token_to_req, gate, config=CONFIG)
        plain = rc.host_attention(q, c.host_kv, indices, table, token_to_req, gate, config=CONFIG)
        assert torch.equal(got, plain), step
        slots = reference.reference_slots(indices, table, token_to_req, 10, 16).cpu().reshape(-1)
        _, hits = reference.reference_row_cache_step(slots, tags_ref, c.pinned, arena_ref)
        hits_seen += int(hits.sum())
        assert torch.equal(cache.tags[0].cpu(), tags_ref), step
        assert torch.equal(cache.layer_rows[0].cpu(), arena_ref), step
        previous = indices.cpu()
    assert hits_seen > 0


def test_a_shared_prefix_block_hits_for_the_other_request():
    c = Cache(seed=2)
    cache = rc.RowCache(1, 4, 16, c.kv_heads, c.head_dim, torch.bfloat16, DEVICE)  # 64 sets, no collisions
    q, indices, table, token_to_req, gate = c.step([[5, 1]], [16])
    cache.attend(0, q, c.host_kv, indices, table, token_to_req, gate, config=CONFIG)
    # the second request shares block 5 as its first block: the same slots, so the same rows
    table2 = torch.tensor([[5, 3]], dtype=torch.int32, device=DEVICE)
    slots = reference.reference_slots(indices, table2, token_to_req, 12, 16).reshape(-1)
    assert (cache.tags[0][slots[slots >= 0] % cache.sets] == slots[slots >= 0]).all()


def test_concurrent_claims_the_largest_slot_wins_and_a_hit_set_is_not_written():
    c = Cache(blocks=8, seed=3)
    cache = rc.RowCache(1, 1, 16, c.kv_heads, c.head_dim, torch.bfloat16, DEVICE)
    # slots 0..63 of request blocks [0, 1, 2, 3] all collide four ways on 16 sets
    q, indices, table, token_to_req, gate = c.step([[0, 1, 2, 3]], [64])
    indices[0, :48] = torch.arange(48, dtype=torch.int32)
    indices[0, -1] = 48
    cache.attend(0, q, c.host_kv, indices, table, token_to_req, gate, config=CONFIG)
    assert cache.tags[0].tolist() == list(range(32, 48))  # the largest bid per set
    # next step: slot 33 hits set 1, and the missing 49 (same set) must not replace it
    indices[0, :2] = torch.tensor([33, 49], dtype=torch.int32)
    indices[0, -1] = 2
    got = cache.attend(0, q, c.host_kv, indices, table, token_to_req, gate, config=CONFIG)
    assert cache.tags[0][1].item() == 33
    assert torch.equal(got, rc.host_attention(q, c.host_kv, indices, table, token_to_req, gate, config=CONFIG))


def test_epoch_wrap_clears_the_old_marks():
    c = Cache(seed=4)
    cache = rc.RowCache(1, 1, 16, c.kv_heads, c.head_dim, torch.bfloat16, DEVICE, epoch_limit=4)
    previous = None
    for step in range(9):  # wraps twice
        q, indices, table, token_to_req, gate = c.step([[1, 2, 3]], [40], previous=previous, overlap=0.7)
        got = cache.attend(0, q, c.host_kv, indices, table, token_to_req, gate, config=CONFIG)
        assert torch.equal(got, rc.host_attention(q, c.host_kv, indices, table, token_to_req, gate, config=CONFIG))
        previous = indices.cpu()
    assert cache.epochs[0] == 3 and cache.epoch[0].item() == 3  # 1 2 3 | 1 2 3 | 1 2 3


def test_staged_prefill_matches_the_reference_and_empties_the_cache():
    c = Cache(blocks=12, seed=5)
    cache = rc.RowCache(2, 2, 16, c.kv_heads, c.head_dim, torch.bfloat16, DEVICE)  # two blocks per window
    cache.tags.fill_(3)
    tables = [[3, 7, 1, 10], [5, 0, 9, 11]]
    q, indices, table, token_to_req, gate = c.step(tables, [60, 50], rows_per_request=3)
    seq_lens = torch.tensor([60, 50], device=DEVICE)
    got = cache.staged(q, c.host_kv, indices, table, token_to_req, seq_lens, gate, config=CONFIG)
    ref = reference.reference_attention(q, c.host_kv, indices, table, token_to_req, gate)
    assert (got.float() - ref.float()).abs().max() <= 2 ** -6
    assert (cache.tags == rc.EMPTY_TAG).all()


SM86_SHARED_BYTES = 99 * 1024  # the RTX 3090's opt-in shared memory per block


SM86_COMPILE = textwrap.dedent('''
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from flashnext.quant.kernels import configs, qsa_row_cache as rc

    signature = {name: "*bf16" for name in ("q_ptr", "host_ptr", "arena_ptr")}
    signature.update({"indices_ptr": "*i32", "block_table_ptr": "*i32", "token_to_req_ptr": "*i32",
                      "tags_ptr": "*i64", "hitmark_ptr": "*i32", "claim_ptr": "*i64", "partial_out_ptr": "*fp32",
                      "partial_lse_ptr": "*fp32", "epoch_ptr": "*i32", "sets": "i32", "softmax_scale": "fp32"})
    for name in ("stride_q_row", "stride_q_head", "stride_host_block", "stride_host_token", "stride_indices_row",
                 "stride_table_req", "num_rows", "num_requests", "num_blocks", "table_width", "split_offset"):
        signature[name] = "i32"
    config = configs.config_for("qsa_attention", family="sm86")
    shared = {}
    for use_cache in (True, False):
        constexprs = {"TOPK": 2048, "PAGE_SIZE": 12144, "GROUP": 12, "HEAD_DIM": 256,
                      "NUM_Q_HEADS": 24, "KV_HEADS": 2, "NUM_SPLITS": config.splits, "BLOCK_M": rc.block_m(12),
                      "BLOCK": config.block, "USE_CACHE": use_cache, "DOT_FP32": False}
        src = ASTSource(rc._attention_kernel, dict(signature, **{k: "constexpr" for k in constexprs}), constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 86, 32),
                                  options={"num_warps": config.warps, "num_stages": config.stages})
        shared["cached" if use_cache else "host"] = compiled.metadata.shared
    print(json.dumps(shared))
''')


def test_launch_configs_fit_the_3090s_shared_memory():
    """The real-shape decode kernel compiled for sm_86 (ptxas ships with Triton; no GPU needed), in a
    process without the interpreter: the shared memory it asks for fits the 3090."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", SM86_COMPILE], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    shared = json.loads(out.stdout.strip().splitlines()[-1])
    assert max(shared.values()) <= SM86_SHARED_BYTES, shared


@pytest.mark.gpu
def test_real_shapes_on_pinned_host_memory():
    """The real layer (24 query heads, 2 KV heads of 256, top-2048, 12,144-token blocks) on UVA."""
    c = Cache(blocks=6, block_size=12144, kv_heads=2, q_heads=24, head_dim=256, topk=2048, seed=6)
    cache = rc.RowCache(4, 4, 12144, 2, 256, torch.bfloat16, DEVICE)
    tables = [[0, 1, 2, 3, 4, 5]]
    previous = None
    for step in range(4):
        q, indices, table, token_to_req, gate = c.step(tables, [70000], rows_per_request=2, previous=previous,
                                                      overlap=0.72)
        got = cache.attend(1, q, c.host_kv, indices, table, token_to_req, gate)
        assert torch.equal(got, rc.host_attention(q, c.host_kv, indices, table, token_to_req, gate))
        ref = reference.reference_attention(q, c.host_kv, indices, table, token_to_req, gate)
        assert (got.float() - ref.float()).abs().max() <= 2 ** -5
        previous = indices.cpu()
    seq_lens = torch.tensor([70000], device=DEVICE)
    got = cache.staged(q, c.host_kv, indices, table, token_to_req, seq_lens, gate)
    assert (got.float() - ref.float()).abs().max() <= 2 ** -5
