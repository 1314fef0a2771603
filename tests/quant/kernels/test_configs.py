"""The launch-config table is well formed, and a family's row is taken over the default row; the
kernels' shared helpers (``_common``)."""

import pytest
import torch

from flashnext.quant.kernels import _common, configs
from flashnext.quant.kernels.bitplane_gemv import GEMV_MAX_TOKENS


def test_every_row_has_a_known_key_and_its_kernels_type():
    for (kernel, cls, family), row in configs.CONFIGS.items():
        classes = [name for name, _ in configs.SHAPE_CLASSES.get(kernel, ())] or [configs.ANY]
        assert cls in classes and family in configs.FAMILIES, (kernel, cls, family)
        assert isinstance(row, configs.KERNELS[kernel]), (kernel, cls, family)


def test_every_size_class_has_a_default_row():
    for kernel in configs.KERNELS:
        classes = [name for name, _ in configs.SHAPE_CLASSES.get(kernel, ())] or [configs.ANY]
        for cls in classes:
            assert (kernel, cls, configs.DEFAULT) in configs.CONFIGS, (kernel, cls)


def test_rows_stay_within_what_the_kernels_take():
    for (kernel, _, _), row in configs.CONFIGS.items():
        if kernel == "bitplane_matmul":
            assert 1 <= row.gemv_max_tokens <= GEMV_MAX_TOKENS
        if isinstance(row, configs.MmaConfig):
            assert row.block_n % 16 == 0 and all(step % 16 == 0 for step in row.steps)


def test_size_classes_start_at_their_bound():
    assert configs.shape_class("bitplane_gemv", 4096, 4096) == "large"  # 2^24
    assert configs.shape_class("bitplane_gemv", 4096, 4095) == "small"
    assert configs.shape_class("bitplane_mma", 8192, 8192) == "large"  # 2^26
    assert configs.shape_class("bitplane_mma", 8192, 8191) == "small"
    assert configs.shape_class("moe_route", 513, 2560) == configs.ANY


def test_a_familys_row_wins_and_the_others_fall_back(monkeypatch):
    measured = configs.GemvConfig(block_n=16, wide=True)
    monkeypatch.setitem(configs.CONFIGS, ("bitplane_gemv", "large", "sm86"), measured)
    assert configs.config_for("bitplane_gemv", 16384, 16384, family="sm86") is measured
    assert configs.config_for("bitplane_gemv", 16384, 16384, family="h200") is configs.CONFIGS[
        ("bitplane_gemv", "large", configs.DEFAULT)]
    assert configs.config_for("bitplane_gemv", 1280, 2560, family="sm86") is configs.CONFIGS[
        ("bitplane_gemv", "small", configs.DEFAULT)]


def test_a_cpu_tensor_is_the_default_family():
    assert configs.device_family(torch.device("cpu")) == configs.DEFAULT
    assert configs.config_for("qsa_attention", device=torch.device("cpu")) is configs.default_config("qsa_attention")


@pytest.mark.parametrize("rows,fits", [(0, False), (1, True), (4, True), (5, False)])
def test_can_launch(rows, fits):
    x = torch.zeros(rows, 8)
    assert _common.can_launch(x, 4) == (fits and _common.INTERPRETED)


def test_split_k_counters_per_kernel_and_kept_when_grown(monkeypatch):
    monkeypatch.setattr(_common, "_COUNTERS", {})
    monkeypatch.setattr(_common, "_RETIRED", [])
    device = torch.device("cpu")
    first = _common.splitk_counters(device, 10, "a")
    assert first.numel() >= 10 and not first.any() and first.dtype == torch.int32
    assert _common.splitk_counters(device, 10, "a") is first
    assert _common.splitk_counters(device, 10, "b") is not first  # kernels never count in each other's words
    grown = _common.splitk_counters(device, first.numel() + 1, "a")
    assert grown.numel() > first.numel() and _common._RETIRED == [first]  # a captured graph may still use it
