"""Fixtures of the hostile-input suite: one pristine work tree per module, copied per test."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from support.hostile import Work


@pytest.fixture(scope="module")
def pristine(demo_snapshot, demo_overlay, tmp_path_factory) -> Path:
    from flashnext.quant.ple.table import build_table

    root = tmp_path_factory.mktemp("pristine")
    shutil.copytree(demo_snapshot, root / "snap")
    shutil.copytree(demo_overlay, root / "ov")
    build_table(root / "snap", root / "table.bin", progress=False)
    return root


@pytest.fixture
def work(pristine, tmp_path) -> Work:
    root = tmp_path / "w"
    shutil.copytree(pristine, root, symlinks=True)
    return Work(root)
