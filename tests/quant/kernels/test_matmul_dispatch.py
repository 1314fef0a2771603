"""Which kernel ``bitplane_matmul`` runs, and how ``bitplane_mma`` launches, at the shared expert's
shapes on the H200: pinned to what measured faster there against stock vLLM (docs/benchmarks.md,
"Against stock vLLM's kernels"), so a table edit that brings back the slower variant fails here."""

import pytest
import triton

from flashnext.quant.kernels import configs
from flashnext.quant.kernels.decode_mma import matmul_variant

GATE_UP, DOWN = (1280, 2560), (2560, 640)
H200_SMS = 132


@pytest.mark.parametrize("shape", [GATE_UP, DOWN])
@pytest.mark.parametrize("tokens,variant", [(1, "gemv"), (2, "mma"), (4, "mma"), (8, "mma"), (16, "mma")])
def test_h200_shared_expert_dispatch(shape, tokens, variant):
    # 4 tokens on the down shape: the GEMV ran 5.77 us, the tensor-core kernel 4.33, stock 4.79;
    # 2 tokens on gate_up: 6.87 against 5.46 (docs/benchmarks.md, issue 28)
    assert matmul_variant(tokens, *shape, family="h200") == variant


def test_other_families_keep_the_default_rows():
    # unmeasured there (the 3090 is measured by users' selftest): the GEMV up to 4 tokens, as before
    assert matmul_variant(4, *DOWN, family="sm86") == "gemv"
    assert matmul_variant(4, *DOWN) == "gemv"
    assert matmul_variant(5, *DOWN) == "mma"


@pytest.mark.parametrize("shape,block_n,split", [(GATE_UP, 64, 10), (DOWN, 64, 5)])
def test_h200_mma_launch_splits_k_down_to_one_step_a_program(shape, block_n, split):
    n, k = shape
    config = configs.config_for("bitplane_mma", n, k, family="h200")
    step = config.step(k, 64)
    assert config.block_n == block_n
    assert config.splits(triton.cdiv(n, config.block_n), k // step, H200_SMS) == split == k // step


@pytest.mark.parametrize("shape", [(10240, 2560), (6144, 2560), (2560, 6144), (13312, 2560)])
def test_the_h200_shared_expert_launch_stays_off_the_attention_shapes(shape):
    # measured 7-17% slower there (docs/benchmarks.md): those shapes keep the default launch
    assert configs.config_for("bitplane_mma", *shape, family="h200") is configs.default_config("bitplane_mma", "small")
