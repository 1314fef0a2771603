"""Every decode kernel's launch parameters, in one table: ``CONFIGS[(kernel, shape_class, family)]``.

Launch parameters are measurements (docs/benchmarks.md), not part of any kernel's logic, so they
live here as data, after vLLM's ``fused_moe`` (its ``configs/*.json`` per shape and device, looked
up by ``try_get_optimal_moe_config`` with ``get_default_config`` as the fallback), scaled down to a
dict. The key:

* ``kernel``: the launcher the row is for (:data:`KERNELS`, with the type of its rows);
* ``shape_class``: the weight's size class, from its ``N * K`` and the kernel's bounds in
  :data:`SHAPE_CLASSES` (``"any"`` for a kernel without bounds);
* ``family``: the device family (:func:`device_family`, :data:`FAMILIES`): ``"h200"``, ``"sm86"``
  (the RTX 3090 and its siblings), or ``"default"``, every other device and the fallback of the two.

:func:`config_for` takes a family's row where there is one and the ``"default"`` row otherwise,
so measured rows for one family are added as data only, e.g.::

    ("bitplane_gemv", "large", "sm86"): GemvConfig(block_n=16, wide=True),

and a new size class is a bound in :data:`SHAPE_CLASSES` plus its ``"default"`` row (the tests
check that every class has one). The ``"default"`` rows hold what each kernel launched before this
table existed, the H200 sweeps of 2026-12-01; ``tests/quant/kernels/test_launch_pins.py`` pins
them at the served shapes.

A caller (a benchmark's sweep, a test) that wants another launch passes its own config, or the
kernels' keyword overrides; those win over the table.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton

DEFAULT = "default"
ANY = "any"


def _split(fixed: int | None, programs_per_sm: int, least: int, blocks: int, most: int, sms: int) -> int:
    """A split-K factor: ``fixed`` (at most ``most``), or enough parts for about ``programs_per_sm``
    programs per SM over ``blocks`` row blocks, at least ``least`` and at most ``most``."""
    if fixed:
        return min(fixed, most)
    return max(1, min(most, max(least, triton.cdiv(programs_per_sm * sms, blocks))))


def _widest_step(steps: tuple[int, ...], K: int, group: int) -> int:
    """The first of ``steps`` that divides K and holds whole groups; else one group."""
    for step in steps:
        if K % step == 0 and step % group == 0:
            return step
    return group


@dataclass(frozen=True)
class GemvConfig:
    """:mod:`.bitplane_gemv`: rows per program, K per step (the widest of it and 512..64 that divides
    K and holds whole groups is taken), warps, stages, and whether to read eight weights per load
    (``wide``) rather than four."""

    block_n: int
    block_k: int = 1024
    num_warps: int = 4
    num_stages: int = 3
    wide: bool = False


@dataclass(frozen=True)
class MmaConfig:
    """:mod:`.decode_mma`'s tensor-core GEMM: rows per program; split-K either ``split_k`` or, when
    None, about ``programs_per_sm`` programs per SM and at least ``min_split_k``; the INT6 K steps
    to try, widest first (a step must divide K and hold whole groups; else one group, INT8's only
    step)."""

    block_n: int
    split_k: int | None = None
    programs_per_sm: int = 2
    min_split_k: int = 1
    steps: tuple[int, ...] = ()
    num_warps: int = 4
    num_stages: int = 3

    def step(self, K: int, group: int) -> int:
        return _widest_step(self.steps, K, group)

    def splits(self, blocks: int, most: int, sms: int) -> int:
        return _split(self.split_k, self.programs_per_sm, self.min_split_k, blocks, most, sms)


@dataclass(frozen=True)
class RouteConfig:
    """:func:`.moe_route.route`: router rows per program, K per step, split-K (``split_k``, or about
    ``programs_per_sm`` programs per SM), warps."""

    block_n: int = 16
    block_k: int = 128
    split_k: int | None = None
    programs_per_sm: int = 2
    num_warps: int = 4

    def splits(self, blocks: int, most: int, sms: int) -> int:
        return _split(self.split_k, self.programs_per_sm, 1, blocks, most, sms)


@dataclass(frozen=True)
class MixConfig:
    """:func:`.hc_mix.hc_up_gate_mix`: hidden columns per program (each in all four streams), warps."""

    block_j: int = 32
    num_warps: int = 4


@dataclass(frozen=True)
class AttentionConfig:
    """:mod:`.qsa_row_cache`'s split-K attention: ``block`` columns per tile, ``splits`` programs per
    row and KV head, ``warps`` and ``stages`` as Triton takes them. Every row must fit the RTX
    3090's 99 KiB of shared memory per block (``test_qsa_row_cache.py`` compiles them for sm_86)."""

    block: int = 32
    splits: int = 16
    warps: int = 4
    stages: int = 2


@dataclass(frozen=True)
class GemmConfig:
    """:mod:`.prefill_gemm`: an output tile of ``block_m`` tokens by ``block_n`` weight rows, the INT6
    K steps to try, widest first (as :class:`MmaConfig`; INT8 steps one group), warps, stages."""

    block_m: int = 32
    block_n: int = 64
    steps: tuple[int, ...] = (128,)
    num_warps: int = 4
    num_stages: int = 3

    def step(self, K: int, group: int) -> int:
        return _widest_step(self.steps, K, group)


@dataclass(frozen=True)
class MlpChoice:
    """decode-05's bit-plane shared expert: up to how many tokens its step runs as the two fused
    GEMVs of :mod:`.bitplane_gemv` (gate_up + SiLU, down + gated combine; at most their 4) rather
    than :func:`.decode_mma.bitplane_matmul` and the elementwise steps (0: never)."""

    fused_max_tokens: int


@dataclass(frozen=True)
class MatmulChoice:
    """:func:`.decode_mma.bitplane_matmul`: up to how many tokens the CUDA-core GEMV runs (at most
    its 4) before the tensor-core kernel takes over."""

    gemv_max_tokens: int


@dataclass(frozen=True)
class PrefillChoice:
    """How the int6-bitplane and int8-modules layers multiply a prefill (more than 16 tokens):
    ``"gemm"``, the tiled ``tl.dot`` GEMM of :mod:`.prefill_gemm` over the stored words, or
    ``"dequantize"``, the whole weight dequantized by :mod:`.dequantize` and a cuBLAS GEMM."""

    through: str

    def __post_init__(self):
        if self.through not in ("gemm", "dequantize"):
            raise ValueError(f"PrefillChoice.through: gemm or dequantize, not {self.through!r}")


# kernel -> the type of its rows
KERNELS: dict[str, type] = {
    "bitplane_gemv": GemvConfig, "bitplane_mma": MmaConfig, "int8_mma": MmaConfig, "hc_down_inject": MmaConfig,
    "hc_up_gate_mix": MixConfig, "bitplane_matmul": MatmulChoice, "moe_route": RouteConfig,
    "qsa_attention": AttentionConfig, "bitplane_gemm": GemmConfig, "int8_gemm": GemmConfig,
    "bitplane_mlp": MlpChoice, "prefill": PrefillChoice,
}
FAMILIES = ("h200", "sm86", DEFAULT)

# kernel -> ((class, least N * K), ...) ascending; a kernel not listed has one class, "any"
SHAPE_CLASSES: dict[str, tuple[tuple[str, int], ...]] = {
    "bitplane_gemv": (("small", 0), ("large", 1 << 24)),
    "bitplane_mma": (("shared", 0), ("small", 1 << 22), ("large", 1 << 26)),
    "bitplane_matmul": (("small", 0), ("large", 1 << 22)),
}

CONFIGS: dict[tuple[str, str, str], object] = {
    # H200 sweep (docs/benchmarks.md, bit-plane GEMV): from 2^24 weights eight weights per load
    ("bitplane_gemv", "small", DEFAULT): GemvConfig(block_n=4),
    ("bitplane_gemv", "large", DEFAULT): GemvConfig(block_n=8, wide=True),
    # H200 sweeps (2026-12-01): 256 columns a step, 64-row blocks from 2^26 weights, split at least 2
    ("bitplane_mma", "shared", DEFAULT): MmaConfig(block_n=32, min_split_k=2, steps=(256, 128)),
    ("bitplane_mma", "small", DEFAULT): MmaConfig(block_n=32, min_split_k=2, steps=(256, 128)),
    ("bitplane_mma", "large", DEFAULT): MmaConfig(block_n=64, min_split_k=2, steps=(256, 128)),
    ("int8_mma", ANY, DEFAULT): MmaConfig(block_n=64),
    # decode-04's down/inject GEMM (a few hundred rows over a long K): 6.2 against 12.7 us on the H200
    ("hc_down_inject", ANY, DEFAULT): MmaConfig(block_n=32, split_k=16),
    ("hc_up_gate_mix", ANY, DEFAULT): MixConfig(block_j=32, num_warps=4),
    # the GEMV wins for one token everywhere and up to four below 2^22 weights (2026-12-01)
    ("bitplane_matmul", "small", DEFAULT): MatmulChoice(gemv_max_tokens=4),
    ("bitplane_matmul", "large", DEFAULT): MatmulChoice(gemv_max_tokens=1),
    # H200, 2026-12-02/03 (docs/benchmarks.md, against stock vLLM): from 2 tokens the tuned
    # tensor-core kernel wins at the shared expert's gate_up (1280x2560: 5.46 against the GEMV's
    # 6.87 us at 2 tokens; the selftest's timing: 5.6 against 7.0) and ties at its down (2560x640:
    # 3.97 against 3.95), so the GEMV keeps one token only
    ("bitplane_matmul", "small", "h200"): MatmulChoice(gemv_max_tokens=1),
    # H200 sweep, 2026-12-02: below 2^22 weights (the shared expert's shapes) 64-row blocks and K
    # split down to one step a program (about 4 programs per SM, capped by the steps): 1280x2560 at
    # 4 tokens 6.48 -> 5.49 us, 2560x640 4.33 -> 4.07; at 6144x2560 and 10240x2560 the same launch
    # was 7-17% slower, hence the separate class
    ("bitplane_mma", "shared", "h200"): MmaConfig(block_n=64, programs_per_sm=4, min_split_k=2, steps=(256, 128)),
    ("moe_route", ANY, DEFAULT): RouteConfig(block_n=16, block_k=128),
    ("qsa_attention", ANY, DEFAULT): AttentionConfig(block=32, splits=16, warps=4, stages=2),
    # seed 000's W8A16 prefill GEMM on the 3090: 32 tokens x 64 rows (102 us against Marlin's 120 at
    # 512 tokens; 64x64 4% slower); within the 3090's 99 KiB of shared memory per block
    # (tests/quant/kernels/test_prefill_gemm.py compiles both for sm_86)
    ("bitplane_gemm", ANY, DEFAULT): GemmConfig(block_m=32, block_n=64, steps=(128,), num_warps=4, num_stages=3),
    ("int8_gemm", ANY, DEFAULT): GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=3),
    # H200 sweep, 2026-12-03, 512 tokens (docs/benchmarks.md): 128 tokens x 64 rows, one group a step:
    # 1280x2560 40.4 -> 29.8 us, 10240x2560 245 -> 99.7 (Humming 19.7 and 49.1)
    ("bitplane_gemm", ANY, "h200"): GemmConfig(block_m=128, block_n=64, steps=(64,), num_warps=4, num_stages=3),
    # H200 sweep, 2026-12-03 (second run), 512 tokens: 128 tokens x 64 rows; the HC up GEMM
    # (10240x320) 18.9 us against Humming's 20.4 and dequantize + GEMM's 40.3. (The HC down GEMM's 24
    # tiles leave the SMs idle: fills_device sends it to dequantize + GEMM, 45 us, Humming 29.)
    ("int8_gemm", ANY, "h200"): GemmConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
    # the seed's W8A16 tl.dot GEMM (seed 000: 102 us against Marlin's 120 at 512 tokens on the 3090)
    ("prefill", ANY, DEFAULT): PrefillChoice(through="gemm"),
    # H200, 2026-12-03 (docs/benchmarks.md): the dequantization kernel and cuBLAS beat both the tiled
    # GEMM and Humming at 512 tokens: shared gate_up 11.8 us (GEMM 29.8, Humming 19.8), down 8.0
    # (13.0, 16.2), HC down/inject 14.7 (45.2 through dequantize + GEMM on the host's path, 29.1), HC
    # up 11.9 (18.6, 20.3); at 2048 tokens too
    ("prefill", ANY, "h200"): PrefillChoice(through="dequantize"),
    # what decode-05 was built with (seed 000 §3.3's one-token GEMVs on the 3090): fused up to 4 tokens
    ("bitplane_mlp", ANY, DEFAULT): MlpChoice(fused_max_tokens=4),
    # H200, 2026-12-03, the whole shared-expert step: the fused GEMVs lose at every size (1 token
    # 12.45 against 11.66 us unfused, 2: 14.39 / 13.63, 4: 19.93 / 12.51; stock 17.6-17.8)
    ("bitplane_mlp", ANY, "h200"): MlpChoice(fused_max_tokens=0),
}


def shape_class(kernel: str, N: int, K: int) -> str:
    """The size class of an ``[N, K]`` weight for ``kernel``: the last of its bounds ``N * K`` reaches."""
    chosen = ANY
    for name, least in SHAPE_CLASSES.get(kernel, ()):
        if N * K >= least:
            chosen = name
    return chosen


@functools.lru_cache(maxsize=None)
def device_family(device: torch.device) -> str:
    """``"h200"``, ``"sm86"`` or ``"default"`` (anything else, and every non-CUDA device)."""
    if device.type != "cuda":
        return DEFAULT
    if "H200" in torch.cuda.get_device_name(device):
        return "h200"
    if torch.cuda.get_device_capability(device) == (8, 6):
        return "sm86"
    return DEFAULT


def launch_config(kernel: str, N: int, K: int, device, config=None, **overrides):
    """``config`` (the caller's) or the table's row for an ``[N, K]`` weight on ``device``, with the
    caller's keyword overrides (those not None) applied: what a kernel's entry point launches."""
    config = config or config_for(kernel, N, K, device)
    given = {name: value for name, value in overrides.items() if value is not None}
    return dataclasses.replace(config, **given) if given else config


def default_config(kernel: str, cls: str = ANY):
    """The fallback row of ``kernel`` for size class ``cls``."""
    return CONFIGS[(kernel, cls, DEFAULT)]


def config_for(kernel: str, N: int = 0, K: int = 0, device: torch.device | None = None, family: str | None = None):
    """The launch config of ``kernel`` for an ``[N, K]`` weight on ``device`` (or device ``family``):
    the family's row for the shape's class, else the default row."""
    cls = shape_class(kernel, N, K)
    if family is None:
        family = DEFAULT if device is None else device_family(device)
    return CONFIGS.get((kernel, cls, family)) or default_config(kernel, cls)
