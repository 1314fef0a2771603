"""Fixtures the patch tests share: the patched vLLM tree (built once a session) and the demo PLE table."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def patched_tree(tmp_path_factory) -> Path:
    """The installed vLLM with the whole series applied, as a shadow tree to put on PYTHONPATH."""
    pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")
    from flashnext.serving.patch_series import patched_tree as build

    return build(tmp_path_factory.mktemp("patched") / "tree")


@pytest.fixture(scope="session")
def demo_table(tmp_path_factory, demo_snapshot) -> Path:
    from flashnext.quant.ple.table import build_table

    table = tmp_path_factory.mktemp("ple") / "table.bin"
    build_table(demo_snapshot, table, progress=False)
    return table
