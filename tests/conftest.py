import os
from pathlib import Path

# vLLM decides its platform at import: on a machine with no GPU it must see no CUDA device, and
# Triton kernels then run through Triton's CPU interpreter (without TRITON_INTERPRET and with no GPU
# driver, vLLM disables Triton).
# On a GPU machine the GPU tests need the device, so leave it visible there.
if not any(Path("/dev").glob("nvidia[0-9]*")):
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import shutil  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from flashnext.quant.demo import write_demo_checkpoint  # noqa: E402


def pytest_collection_modifyitems(config, items):
    # pytest-xdist hands each module to one worker whole (--dist loadscope, so a module's engine
    # starts once), in collection order: modules with a slow test go out first, so that the last
    # one to finish is a short one and no worker idles through another's long module.
    slow_modules = {item.module for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module not in slow_modules)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine (results in docs/benchmarks.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_snapshot(tmp_path_factory) -> Path:
    """The demo checkpoint, built once per session. Tests must not modify it."""
    path = tmp_path_factory.mktemp("demo") / "snapshot"
    write_demo_checkpoint(path)
    return path


@pytest.fixture(scope="session")
def demo_overlay(demo_snapshot, tmp_path_factory) -> Path:
    from flashnext.quant.overlays.mtp_int4 import make_mtp_int4

    out = tmp_path_factory.mktemp("overlay") / "mtp-int4"
    make_mtp_int4(demo_snapshot, out, progress=False)
    return out


@pytest.fixture
def snapshot_copy(demo_snapshot, tmp_path) -> Path:
    """A private copy of the demo snapshot that a test may break."""
    dst = tmp_path / "snapshot"
    shutil.copytree(demo_snapshot, dst)
    return dst
