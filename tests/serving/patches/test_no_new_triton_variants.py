"""No flashnext Triton kernel compiles a new variant while serving (issue 25, item 7b; seed 000 §5).

The 3x3090 profiles capture CUDA graphs for 1, 2 and 4 tokens; a decode or verify step of 5..16
tokens runs eagerly. A kernel variant that step launches and neither capture nor the startup
warm-up launched is compiled and loaded mid-service, its memory outside vLLM's budget (the seed's
OOM). For every flashnext kernel a decode/verify step reaches, driven through the hook functions
the patches call at the model's real shapes, each launch is recorded as Triton 3.8's own cache
key for an RTX 3090 (``JITFunction``'s binder with the sm86 CUDA backend: constexprs, dtypes, the
integer and alignment specializations, launch options), without running the kernel; the keys of
1..16 tokens must be among those of 1, 2 and 4 tokens plus the warm-up's.

Stand-ins: the layer shells (a module holding a flashnext quantization method and its tensors,
called as vLLM's linear layers are: ``(output, bias)``); the kernels' SM count is the 3090's (82).
"""

import types

import pytest
import torch

triton = pytest.importorskip("triton")

from support.triton_launches import Launches  # noqa: E402

CAPTURED = (1, 2, 4)  # cudagraph_capture_sizes of the 3x3090 profiles
SERVED = range(1, 17)  # the decode kernels' token counts (decode_mma.MMA_MAX_TOKENS)
HIDDEN, EXPERTS, TOP_K, SHARED = 2560, 512, 10, 640  # Qwen3.8-Flash-Next (reference: qwen4exp-upstream.md)
HC, LOWRANK, VOCAB = 4, 320, 248320


def keys_by_tokens(step, tokens=SERVED, warm=None) -> tuple[dict[int, set], set]:
    """``({tokens: keys a step of that many tokens launched}, keys the warm-up launched)``."""
    found = {}
    for m in tokens:
        launches = Launches()
        with launches.recording():
            step(m)
        found[m] = set(launches.keys)
    warmed = set()
    if warm is not None:
        launches = Launches()
        with launches.recording():
            warm()
        warmed = set(launches.keys)
    return found, warmed


def assert_no_new_variant(found: dict[int, set], warmed: set = frozenset()):
    startup = set().union(*(found[m] for m in CAPTURED)) | warmed
    for m, keys in found.items():
        new = keys - startup
        assert not new, f"{m} tokens launch {len(new)} variant(s) neither capture nor warm-up launched: {new}"


@pytest.fixture(autouse=True)
def rtx_3090_sms(monkeypatch):
    from flashnext.quant.kernels import _common

    monkeypatch.setattr(_common, "sm_count", lambda device: 82)


def bf16(*shape):
    return torch.empty(shape, dtype=torch.bfloat16)


class LayerShell(torch.nn.Module):
    """A linear layer as vLLM's call sites use it: ``quant_method.apply`` over its own tensors."""

    def __init__(self, method, **tensors):
        super().__init__()
        self.quant_method = method
        for name, t in tensors.items():
            setattr(self, name, t)

    def forward(self, x):
        return self.quant_method.apply(self, x), None


def bitplane_layer(rows: int, cols: int, group: int = 64) -> LayerShell:
    from flashnext.serving.quantization.bitplane import BitplaneLinearMethod

    return LayerShell(BitplaneLinearMethod(None, planes_kept=True),
                      weight_packed=torch.empty(rows, cols * 3 // 4, dtype=torch.uint8),
                      weight_scale=bf16(rows, cols // group), bitplane_cols=cols)


def int8_layer(method, rows: int, cols: int, group: int) -> LayerShell:
    return LayerShell(method, weight_packed=torch.empty(rows, cols // 4, dtype=torch.int32),
                      weight_scale=bf16(rows, cols // group))


@pytest.mark.parametrize("marlin", [True, False], ids=["marlin-experts", "other-experts"])
def test_decode05_router_runs_only_at_the_captured_sizes(marlin):
    """The router's variant depends on the step's size (its top-k rows, Marlin's alignment), so
    the fused path takes 1..4 tokens and vLLM's path the eager 5..16
    (``test_decode05_cuda_router.py`` checks that through vLLM's block)."""
    from flashnext.serving.hooks import moe_decode

    assert moe_decode.MAX_FUSED_TOKENS <= max(CAPTURED)
    rows = bf16(EXPERTS + 1, HIDDEN)
    step = lambda m: moe_decode.route_step(bf16(m, HIDDEN), rows, TOP_K, EXPERTS, marlin)
    found, _ = keys_by_tokens(step, range(1, moe_decode.MAX_FUSED_TOKENS + 1))
    assert_no_new_variant(found)
    assert all(len(keys) == 1 for keys in found.values())  # one launch a step
    beyond, _ = keys_by_tokens(step, (8, 16))  # what the path would launch beyond: new variants
    assert beyond[8] - found[4] and beyond[16] - found[4]


def test_decode05_bitplane_shared_expert_is_warmed_at_load(monkeypatch):
    """1..4 tokens: decode-05's fused GEMVs; 5..16: vLLM's shared-expert MLP through the layers'
    tensor-core kernel, which capture never launches for these shapes and the load-time warm-up
    does."""
    from flashnext.serving.hooks import moe_decode
    from flashnext.serving.quantization import bitplane

    mlp = types.SimpleNamespace(gate_up_proj=bitplane_layer(2 * SHARED, HIDDEN), down_proj=bitplane_layer(HIDDEN, SHARED),
                                act_fn=lambda h: h[:, :SHARED])

    def step(m):
        x = bf16(m, HIDDEN)
        if m <= moe_decode.MAX_FUSED_TOKENS:
            moe_decode._shared_expert(mlp, x, bf16(m, HIDDEN), bf16(m, 1))
        else:  # Qwen2MoeMLP.forward
            mlp.down_proj(mlp.act_fn(mlp.gate_up_proj(x)[0]))
    monkeypatch.setattr(bitplane, "_compiles_kernels", lambda weights: True)  # as on the GPU

    def load():  # what vLLM's loader calls for each layer after loading it
        for layer in (mlp.gate_up_proj, mlp.down_proj):
            layer.quant_method.process_weights_after_loading(layer)

    found, warmed = keys_by_tokens(step, warm=load)
    assert warmed and not warmed & set().union(*(found[m] for m in CAPTURED))  # the warm-up is needed
    assert_no_new_variant(found, warmed)
    with pytest.raises(AssertionError, match="neither capture nor warm-up"):
        assert_no_new_variant(found)  # without it, the 5..16-token steps would compile


@pytest.mark.parametrize("shape", [(HIDDEN, SHARED), (2 * SHARED, HIDDEN), (10240, HIDDEN), (HIDDEN, 8192)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_int6_bitplane_layers_are_warmed_at_load(shape, monkeypatch):
    from flashnext.serving.quantization import bitplane

    layer = bitplane_layer(*shape)
    monkeypatch.setattr(bitplane, "_compiles_kernels", lambda weights: True)
    found, warmed = keys_by_tokens(lambda m: layer(bf16(m, shape[1])),
                                   warm=lambda: layer.quant_method.process_weights_after_loading(layer))
    assert_no_new_variant(found, warmed)


def test_int8_modules_and_decode04_have_one_variant_per_shape():
    from flashnext.serving.hooks import hc_decode
    from flashnext.serving.quantization.int8 import Int8EmbeddingMethod, Int8LinearMethod

    lm_head = int8_layer(Int8EmbeddingMethod(128), VOCAB, HIDDEN, 128)
    pad = -(LOWRANK + HC) % 16
    mixers = [types.SimpleNamespace(hc_count=HC, hc_lowrank=LOWRANK, use_combine=combine,
                                    input_mix_weight_down_block_inject=int8_layer(Int8LinearMethod(64),
                                                                                  LOWRANK + HC + pad, HC * HIDDEN, 64),
                                    input_mix_weight_down=int8_layer(Int8LinearMethod(64), LOWRANK, HC * HIDDEN, 64),
                                    input_mix_weight_up=int8_layer(Int8LinearMethod(64), HC * HIDDEN, LOWRANK, 64))
              for combine in (True, False)]

    def step(m):
        lm_head(bf16(m, HIDDEN))  # the sampled rows' logits
        for mixer in mixers:
            assert hc_decode.mix(mixer, bf16(m, HC * HIDDEN)) is not None
            mixer.input_mix_weight_up(bf16(m, LOWRANK))  # the layer on its own (vLLM's path)

    found, _ = keys_by_tokens(step)
    assert_no_new_variant(found)


def test_qsa_row_cache_decode_steps_have_one_variant():
    """decode-07's steps: the store's invalidation (every step) and the row-cache attention (steps
    of up to ROW_CACHE_MAX_ROWS rows, which is every decode step of the 3x3090 profiles: at most 4
    requests, 2 rows each with MTP)."""
    from flashnext.quant.kernels import qsa_row_cache as q

    heads, kv_heads, dim, page, blocks, width, topk = 16, 2, 128, 64, 256, 32, 512
    cache = q.RowCache(1, 4, page, kv_heads, dim, torch.bfloat16, "cpu")
    host_kv = bf16(blocks, page, kv_heads, 2 * dim)

    def step(m):
        cache.invalidate(0, torch.empty(m, dtype=torch.int64))
        if m <= q.ROW_CACHE_MAX_ROWS:
            cache.attend(0, bf16(m, heads, dim), host_kv, torch.empty(m, topk + 1, dtype=torch.int32),
                         torch.empty(4, width, dtype=torch.int32), torch.empty(m, dtype=torch.int32),
                         bf16(m, heads * dim), out=bf16(m, heads, dim))

    found, _ = keys_by_tokens(step)
    assert_no_new_variant(found)


def test_qsa_prefill_and_eager_decode_launch_only_what_the_bind_warmed():
    """Issue 40 item 2. A prefill's staged path (attention, fold and merge) over 1..3 arena windows,
    for chunks of 1 to 600 rows and mixed batches of several requests, and the uncached path of
    eager 13..16-row decode steps, launch only the variants ``RowCache.warm`` launched at the KV
    cache's bind (before CUDA-graph capture), whatever the engine's block-table width. Release
    dimensions; an arena and host rows of demo size (their sizes are not specialized on)."""
    from flashnext.quant.kernels import qsa_row_cache as q

    heads, kv_heads, dim, page, host_blocks, topk = 16, 2, 128, 64, 40, 2051
    cache = q.RowCache(2, 8, page, kv_heads, dim, torch.bfloat16, "cpu")
    host_kv = bf16(host_blocks, page, kv_heads, 2 * dim)
    window = q.staged_scratch(600, heads, dim, 8, cache.arena[0].numel() * 2, host_blocks, 3 * 64).window_blocks

    def prefill(rows, requests, width, windows):
        table = torch.arange(requests * width, dtype=torch.int32).remainder(host_blocks).view(requests, width)
        lens = torch.full((requests,), min(width, windows * window) * page, dtype=torch.int32)
        cache.staged(bf16(rows, heads, dim), host_kv, torch.zeros(rows, topk + 1, dtype=torch.int32), table,
                     torch.arange(rows, dtype=torch.int32).remainder(requests), lens, bf16(rows, heads * dim),
                     bf16(rows, heads, dim))

    def step(case):
        rows, requests, width, windows = case
        if windows:
            prefill(rows, requests, width, windows)
        else:  # an eager decode step beyond the row cache's rows
            q.host_attention(bf16(rows, heads, dim), host_kv, torch.zeros(rows, topk + 1, dtype=torch.int32),
                             torch.zeros(requests, width, dtype=torch.int32),
                             torch.zeros(rows, dtype=torch.int32), bf16(rows, heads * dim), bf16(rows, heads, dim))

    cases = [(1, 1, 64, 1), (17, 1, 64, 2), (600, 1, 64, 3), (512, 3, 64, 3), (33, 2, 48, 2)] + [
        (rows, rows // 2, 33, 0) for rows in range(13, 17)]
    found, warmed = keys_by_tokens(step, cases, warm=lambda: cache.warm(host_kv, heads, topk))
    assert {name for name, _, _ in warmed} == {"_attention_kernel", "_fold_kernel", "_merge_kernel"}
    for case, keys in found.items():
        assert keys and keys <= warmed, f"{case}: {len(keys - warmed)} variant(s) the warm-up did not launch"


def test_the_keys_are_triton_specializations():
    """The recorder tells variants apart as Triton does: an integer argument of 16 is specialized
    (divisible by 16) unless the kernel says not to."""
    import triton.language as tl

    @triton.jit
    def plain(x_ptr, n, BLOCK: tl.constexpr):
        pass

    @triton.jit(do_not_specialize=["n"])
    def unspecialized(x_ptr, n, BLOCK: tl.constexpr):
        pass

    x = torch.empty(16)
    for kernel, distinct in ((plain, 3), (unspecialized, 1)):
        launches = Launches()
        with launches.recording():
            for n in (1, 2, 16):
                kernel[(1,)](x, n, BLOCK=16)
        assert len(set(launches.keys)) == distinct
