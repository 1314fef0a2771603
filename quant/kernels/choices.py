"""The launch table's decisions between flashnext's own kernel variants, timed both ways on this GPU.

:mod:`.configs` holds rows measured on the H200; the RTX 3090's rows are the defaults, chosen to fit
its shared memory but never timed on one. ``flashnext selftest`` runs :func:`time_choices` on the
user's GPU, so the report says, for each decision at Qwen3.8-Flash-Next's served shapes, what the
table picks there and what measured fastest, and which row to add where they differ:

* ``bitplane_matmul``: the CUDA-core GEMV or the tensor-core kernel, for 1, 2 and 4 tokens at the
  shared expert's two matrices (``MatmulChoice.gemv_max_tokens``);
* ``bitplane_mlp``: decode-05's shared-expert step as the two fused GEMVs, or as the layers'
  kernels and the elementwise steps, compiled as vLLM's graph runs them (``MlpChoice``);
* ``bitplane_gemm``: the prefill GEMM's tile at 512 tokens, every row the table holds for it;
* ``prefill``: at 512 tokens, the tiled GEMM over the stored words or the weight dequantized and a
  cuBLAS GEMM (``PrefillChoice``), at the shared expert's matrices and the hyper-connection mixers'
  INT8 ones.

Times are CUDA-graph replays (``triton.testing.do_bench_cudagraph``); the inputs are random codes
at the served shapes.

>>> for point in time_choices(torch.device("cuda")):   # doctest: +SKIP
...     print(point.decision, point.shape, point.tokens, point.table_picks, point.fastest)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from flashnext.quant.kernels import configs

HIDDEN, SHARED_INTERMEDIATE = 2560, 640  # Qwen3.8-Flash-Next's hidden size and shared expert
DECODE_TOKENS = (1, 2, 4)  # the profiles' CUDA-graph sizes
PREFILL_TOKENS = 512
# The hyper-connection mixers' INT8 g64 GEMMs: down/inject (low rank + 4 + padding, over 4 x hidden)
# and up (4 x hidden, over the low rank)
HC_INT8_SHAPES = ((336, 4 * HIDDEN), (4 * HIDDEN, 320))
# A pick within this share of the fastest variant agrees: closer than that, replays of one graph differ.
AGREEMENT = 0.05


@dataclass(frozen=True)
class ChoicePoint:
    """One decision at one shape and token count: each variant's time (us) and the table's pick."""

    decision: str
    shape: str
    tokens: int
    table_picks: str
    timings_us: dict[str, float]

    @property
    def fastest(self) -> str:
        return min(self.timings_us, key=self.timings_us.get)

    @property
    def agrees(self) -> bool:
        return self.timings_us[self.table_picks] <= self.timings_us[self.fastest] * (1 + AGREEMENT)


def _cuda_graph_us(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=30) * 1000


def _int6(n: int, k: int, device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    from flashnext.quant.formats.bitplane import codes_to_bitplane

    codes = torch.randint(-31, 32, (n, k), dtype=torch.int8, generator=gen)
    scales = (torch.rand(n, k // 64, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    return codes_to_bitplane(codes).to(device), scales.to(device)


def _scales(n: int, groups: int, device, gen: torch.Generator) -> torch.Tensor:
    return (torch.rand(n, groups, generator=gen) * 0.01 + 1e-4).to(torch.bfloat16).to(device)


def _compiled(fn, *example):
    """``fn`` compiled by Inductor for ``example`` (what vLLM's compiled graph runs on a GPU), or ``fn``."""
    if not example[0].is_cuda:
        return fn
    try:
        candidate = torch.compile(fn, dynamic=False, fullgraph=True)
        candidate(*example)
        return candidate
    except Exception:  # noqa: BLE001 - no compiler here: eager is the upper bound
        return fn


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def _gated_combine(shared: torch.Tensor, gate: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(gate) * shared + routed


def time_choices(device: torch.device, timer: Callable[[Callable[[], object]], float] = _cuda_graph_us,
                 seed: int = 0) -> list[ChoicePoint]:
    """Every decision of the module docstring, timed on ``device`` with ``timer`` (a function's time
    in us); the table's picks are those ``device`` gets."""
    from flashnext.quant.kernels.bitplane_gemv import bitplane_down_combine, bitplane_gate_up_silu, bitplane_gemv
    from torch.nn import functional as F

    from flashnext.quant.formats.packing import pack_int32
    from flashnext.quant.kernels.decode_mma import (bitplane_matmul, bitplane_mma, fused_gemvs_win, matmul_variant,
                                                    prefill_through)
    from flashnext.quant.kernels.dequantize import bitplane_dequantize, int8_dequantize
    from flashnext.quant.kernels.prefill_gemm import bitplane_gemm, int8_gemm

    gen = torch.Generator().manual_seed(seed)
    shapes = ((2 * SHARED_INTERMEDIATE, HIDDEN), (HIDDEN, SHARED_INTERMEDIATE))  # gate_up, down: (N, K)
    gate_up, down = (_int6(n, k, device, gen) for n, k in shapes)
    matrices = tuple(zip((gate_up, down), shapes))
    points = []

    def x_of(m: int, k: int) -> torch.Tensor:
        return torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)

    for (planes, scales), (n, k) in matrices:
        for m in DECODE_TOKENS:
            x = x_of(m, k)
            points.append(ChoicePoint("bitplane_matmul", f"{n}x{k}", m, matmul_variant(m, n, k, device), {
                "gemv": timer(lambda: bitplane_gemv(x, planes, scales)),
                "mma": timer(lambda: bitplane_mma(x, planes, scales))}))
    for m in DECODE_TOKENS:
        x, routed = x_of(m, HIDDEN), x_of(m, HIDDEN)
        gate = x_of(m, 1)
        silu_and_mul = _compiled(_silu_and_mul, x_of(m, 2 * SHARED_INTERMEDIATE))
        combine = _compiled(_gated_combine, routed, gate, routed)

        def fused():
            return bitplane_down_combine(bitplane_gate_up_silu(x, *gate_up), *down, routed, gate)

        def layers():
            return combine(bitplane_matmul(silu_and_mul(bitplane_matmul(x, *gate_up)), *down), gate, routed)

        pick = "fused" if fused_gemvs_win(m, *shapes, device) else "layers"
        points.append(ChoicePoint("bitplane_mlp", f"shared expert {HIDDEN}/{SHARED_INTERMEDIATE}", m, pick,
                                  {"fused": timer(fused), "layers": timer(layers)}))
    rows = {family: row for (kernel, _, family), row in configs.CONFIGS.items() if kernel == "bitplane_gemm"}
    table_row = configs.config_for("bitplane_gemm", device=device)
    for (planes, scales), (n, k) in matrices:
        x = x_of(PREFILL_TOKENS, k)
        timings = {f"row {family}": timer(lambda row=row: bitplane_gemm(x, planes, scales, config=row))
                   for family, row in rows.items()}
        pick = next(f"row {family}" for family, row in rows.items() if row == table_row)
        points.append(ChoicePoint("bitplane_gemm", f"{n}x{k}", PREFILL_TOKENS, pick, timings))
    through = prefill_through(device)
    for (planes, scales), (n, k) in matrices:
        x = x_of(PREFILL_TOKENS, k)
        points.append(ChoicePoint("prefill", f"{n}x{k} INT6", PREFILL_TOKENS, through, {
            "gemm": timer(lambda: bitplane_gemm(x, planes, scales)),
            "dequantize": timer(lambda: F.linear(x, bitplane_dequantize(planes, scales, x.dtype)))}))
    for n, k in HC_INT8_SHAPES:
        codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        packed, scales = pack_int32(codes, 8).to(device), _scales(n, k // 64, device, gen)
        x = x_of(PREFILL_TOKENS, k)
        points.append(ChoicePoint("prefill", f"{n}x{k} INT8", PREFILL_TOKENS, through, {
            "gemm": timer(lambda: int8_gemm(x, packed, scales)),
            "dequantize": timer(lambda: F.linear(x, int8_dequantize(packed, scales, x.dtype)))}))
    return points


def advice(point: ChoicePoint) -> str:
    """One line: what the table picks at ``point``, what measured faster, by how much."""
    picked, best = point.timings_us[point.table_picks], point.timings_us[point.fastest]
    head = f"{point.decision} {point.shape}, {point.tokens} token(s): the table picks {point.table_picks}"
    if point.agrees:
        return f"{head} ({picked:.1f} us), the fastest here"
    return (f"{head} ({picked:.1f} us); {point.fastest} measured {best:.1f} us ({picked / best - 1:+.0%} for the "
            f"pick): this GPU's row in quant/kernels/configs.py should pick {point.fastest}")


def as_dict(point: ChoicePoint) -> dict:
    return dataclasses.asdict(point) | {"fastest": point.fastest, "agrees": point.agrees}
