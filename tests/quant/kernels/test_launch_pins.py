"""Every kernel launches as it did before the launch-config table existed (issue 27), at the shapes
Qwen3.8-Flash-Next serves (docs/benchmarks.md) and for the SM counts of the CPU interpreter (4), the
RTX 3090 (82) and the H200 (132).

The kernels are replaced by recorders, so nothing runs and the tensors live on the meta device; the
expected values are written out by hand from the rules the kernels had (a change to a default row
of ``configs.CONFIGS`` shows up here, as it should: it changes what users run).
"""

from __future__ import annotations

import pytest
import torch
import triton

from flashnext.quant.kernels import bitplane_gemv, decode_mma, hc_mix, moe_route, qsa_row_cache

META = "meta"
SMS = (4, 82, 132)


class Recorder:
    """Stands where a ``@triton.jit`` kernel is launched: ``kernel[grid](*args, **meta)``."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((self.name, tuple(grid), kwargs))
        return launch


@pytest.fixture
def launches(monkeypatch):
    calls: list = []
    for module, names in ((decode_mma, ["_mma_kernel"]), (hc_mix, ["_up_gate_mix_kernel"]),
                          (moe_route, ["_route_kernel"]),
                          (bitplane_gemv, ["_gemv_kernel", "_gate_up_kernel", "_down_combine_kernel"]),
                          (qsa_row_cache, ["_attention_kernel", "_plan_kernel", "_merge_kernel",
                                           "_invalidate_kernel"])):
        for name in names:
            monkeypatch.setattr(module, name, Recorder(name, calls))
    return calls


@pytest.fixture
def sms(monkeypatch):
    """Set the SM count every launch sees."""
    from flashnext.quant.kernels import _common

    return lambda count: monkeypatch.setattr(_common, "sm_count", lambda device: count)


def bf16(*shape):
    return torch.empty(shape, dtype=torch.bfloat16, device=META)


def planes(n, k, group=64):
    return torch.empty(n, k * 3 // 4, dtype=torch.uint8, device=META), bf16(n, k // group)


def int8_words(n, k, group):
    return torch.empty(n, k // 4, dtype=torch.int32, device=META), bf16(n, k // group)


def picked(kwargs: dict, *names):
    return tuple(kwargs[name] for name in names)


# (N, K) -> (STEP, BLOCK_N, {sms: SPLIT_K}); group 64, num_warps 4, num_stages 3
INT6_MMA = {
    (1280, 2560): (256, 32, {4: 2, 82: 5, 132: 7}),
    (2560, 640): (128, 32, {4: 2, 82: 3, 132: 4}),
    (10240, 2560): (256, 32, {4: 2, 82: 2, 132: 2}),
    (6144, 2560): (256, 32, {4: 2, 82: 2, 132: 2}),
    (2560, 6144): (256, 32, {4: 2, 82: 3, 132: 4}),
    (13312, 2560): (256, 32, {4: 2, 82: 2, 132: 2}),
    (8192, 8192): (256, 64, {4: 2, 82: 2, 132: 3}),
    (16384, 16384): (256, 64, {4: 2, 82: 2, 132: 2}),
}


@pytest.mark.parametrize("count", SMS)
@pytest.mark.parametrize("shape", list(INT6_MMA), ids=lambda s: f"{s[0]}x{s[1]}")
def test_bitplane_mma(shape, count, launches, sms):
    sms(count)
    n, k = shape
    step, block_n, split = INT6_MMA[shape]
    for m in (1, 16):
        decode_mma.bitplane_mma(bf16(m, k), *planes(n, k))
    for name, grid, kw in launches:
        assert name == "_mma_kernel" and grid == (triton.cdiv(n, block_n), split[count])
        assert picked(kw, "STEP", "BLOCK_N", "SPLIT_K", "BITS", "BLOCK_M", "num_warps", "num_stages") == (
            step, block_n, split[count], 6, 16, 4, 3)
    assert len(launches) == 2


# (N, K, group) -> (BLOCK_N, {sms: SPLIT_K}): the LM head, the HC mixers through Int8LinearMethod
INT8_MMA = {
    (248320, 2560, 128): (64, {4: 1, 82: 1, 132: 1}),
    (336, 10240, 64): (64, {4: 2, 82: 28, 132: 44}),
    (10240, 320, 64): (64, {4: 1, 82: 2, 132: 2}),
}


@pytest.mark.parametrize("count", SMS)
@pytest.mark.parametrize("shape", list(INT8_MMA), ids=lambda s: f"{s[0]}x{s[1]}g{s[2]}")
def test_int8_mma(shape, count, launches, sms):
    sms(count)
    n, k, group = shape
    block_n, split = INT8_MMA[shape]
    decode_mma.int8_mma(bf16(3, k), *int8_words(n, k, group))
    [(name, grid, kw)] = launches
    assert grid == (triton.cdiv(n, block_n), split[count])
    assert picked(kw, "STEP", "GROUP", "BLOCK_N", "SPLIT_K", "BITS", "SILU_COLUMNS", "num_warps", "num_stages") == (
        group, group, block_n, split[count], 8, 0, 4, 3)


@pytest.mark.parametrize("count", SMS)
def test_hc_mix(count, launches, sms):
    """decode-04 at the model's shape: hidden 2560, 4 streams, low rank 320, 336 down/inject rows."""
    sms(count)
    down = int8_words(336, 4 * 2560, 64)
    up = int8_words(4 * 2560, 320, 64)
    hc_mix.hc_mix(bf16(2, 4 * 2560), down, up, 320, 4)
    (name, grid, kw), (name2, grid2, kw2) = launches
    assert name == "_mma_kernel" and grid == (11, 16)
    assert picked(kw, "BLOCK_N", "SPLIT_K", "SILU_COLUMNS", "SILU_DIV", "num_warps", "num_stages") == (32, 16, 320, 4,
                                                                                                      4, 3)
    assert name2 == "_up_gate_mix_kernel" and grid2 == (80,)
    assert picked(kw2, "BLOCK_J", "GROUP", "BLOCK_M", "num_warps") == (32, 64, 16, 4)


# kernel, (N, K) -> (grid, BLOCK_N, BLOCK_K, WIDE); group 64, num_warps 4, num_stages 3
GEMV = [
    ("gemv", (1280, 2560), ((320,), 4, 512, False)),
    ("gemv", (2560, 640), ((640,), 4, 128, False)),
    ("gemv", (10240, 2560), ((1280,), 8, 512, True)),
    ("gemv", (4096, 4096), ((512,), 8, 1024, True)),
    ("gemv", (16384, 16384), ((2048,), 8, 1024, True)),
    ("gate_up", (1280, 2560), ((160,), 4, 512, False)),
    ("down_combine", (2560, 640), ((640,), 4, 128, False)),
]


@pytest.mark.parametrize("kernel,shape,want", GEMV, ids=[f"{kernel}-{n}x{k}" for kernel, (n, k), _ in GEMV])
@pytest.mark.parametrize("m", [1, 3])
def test_bitplane_gemv(kernel, shape, want, m, launches):
    n, k = shape
    x, w = bf16(m, k), planes(n, k)
    if kernel == "gemv":
        bitplane_gemv.bitplane_gemv(x, *w)
    elif kernel == "gate_up":
        bitplane_gemv.bitplane_gate_up_silu(x, *w)
    else:
        bitplane_gemv.bitplane_down_combine(x, *w, bf16(m, n), bf16(m, 1))
    [(name, grid, kw)] = launches
    assert (grid,) + picked(kw, "BLOCK_N", "BLOCK_K", "WIDE") == want
    assert picked(kw, "M_PAD", "GROUP", "num_warps", "num_stages") == (triton.next_power_of_2(m), 64, 4, 3)


# (N, K) -> the token counts bitplane_matmul sends to the CUDA-core GEMV (the rest: tensor cores)
GEMV_TOKENS = {
    (1280, 2560): {1, 2, 3, 4},
    (2560, 640): {1, 2, 3, 4},
    (2048, 2048): {1},  # 2^22 weights: no longer "small"
    (2560, 6144): {1},
    (10240, 2560): {1},
}


@pytest.mark.parametrize("shape", list(GEMV_TOKENS), ids=lambda s: f"{s[0]}x{s[1]}")
def test_bitplane_matmul_picks_the_kernel(shape, launches):
    n, k = shape
    w = planes(n, k)
    gemv = set()
    for m in range(1, 17):
        launches.clear()
        decode_mma.bitplane_matmul(bf16(m, k), *w)
        [(name, _, _)] = launches
        if name == "_gemv_kernel":
            gemv.add(m)
        else:
            assert name == "_mma_kernel"
    assert gemv == GEMV_TOKENS[shape]


@pytest.mark.parametrize("count", SMS)
@pytest.mark.parametrize("m", [1, 4, 16])
def test_route(m, count, launches, sms):
    """decode-05: 512 experts and the shared gate over hidden 2560, top 10."""
    sms(count)
    moe_route.route(bf16(m, 2560), bf16(513, 2560), 10, align_block=8 if m <= 4 else 0)
    [(name, grid, kw)] = launches
    split = {4: 1, 82: 5, 132: 8}[count]
    assert grid == (33, split)
    assert picked(kw, "BLOCK_N", "BLOCK_K", "SPLIT_K", "BLOCK_M", "num_warps") == (16, 128, split, 16, 4)


def qsa_step(rows=2, topk=64):
    q, gate = bf16(rows, 24, 256), bf16(rows, 24, 256)
    indices = torch.empty(rows, topk + 1, dtype=torch.int32, device=META)
    table = torch.empty(1, 3, dtype=torch.int32, device=META)
    token_to_req = torch.empty(rows, dtype=torch.int32, device=META)
    return q, indices, table, token_to_req, gate


def check_attention(launch):
    name, grid, kw = launch
    assert name == "_attention_kernel" and grid == (2, 2, 16)
    assert picked(kw, "NUM_SPLITS", "BLOCK", "BLOCK_M", "num_warps", "num_stages") == (16, 32, 16, 4, 2)


def test_qsa_host_attention(launches):
    q, indices, table, token_to_req, gate = qsa_step()
    qsa_row_cache.host_attention(q, bf16(3, 16, 2, 512), indices, table, token_to_req, gate)
    check_attention(launches[0])
    assert launches[1][0] == "_merge_kernel" and launches[1][1] == (2, 24)


def test_qsa_row_cache_step(launches):
    q, indices, table, token_to_req, gate = qsa_step()
    cache = qsa_row_cache.RowCache(1, 1, 16, 2, 256, torch.bfloat16, META)
    cache.attend(0, q, bf16(3, 16, 2, 512), indices, table, token_to_req, gate)
    (plan, grid, kw), attention = launches[:2]
    assert plan == "_plan_kernel" and grid == (2, 2) and picked(kw, "BLOCK", "num_warps") == (32, 1)
    check_attention(attention)
