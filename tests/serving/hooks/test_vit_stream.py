"""BlockStream (patch vit-stream) on plain torch blocks: on the CPU here, and with a real copy stream
on the GPU machine (``-m gpu``). vLLM's own tower is in tests/serving/test_patch_series.py."""

import pytest
import torch

from flashnext.errors import FlashnextError
from flashnext.serving.hooks import vit_stream


def blocks(n, device="cpu", width=64):
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width),
                                                   torch.nn.GELU()) for _ in range(n)).to(device)


def run(stack, x):
    for block in stack:
        x = block(x)
    return x


def test_streamed_blocks_give_the_resident_output_from_two_slots():
    resident, streamed = blocks(5), blocks(5)
    x = torch.randn(7, 64)
    want = run(resident, x)
    stream = vit_stream.BlockStream(streamed)
    storages = {p.untyped_storage().data_ptr() for b in streamed for p in b.parameters()}
    assert storages == {stream.slot_memory.untyped_storage().data_ptr()}
    assert stream.device_bytes == 2 * stream.block_bytes
    for _ in range(3):  # block 0 comes back into slot 0 for the next input
        assert torch.equal(run(streamed, x), want)


def test_blocks_that_differ_are_refused_in_one_line():
    stack = blocks(3)
    stack[1][1] = torch.nn.Linear(64, 64, bias=False)
    with pytest.raises(FlashnextError, match="block 1 differs"):
        vit_stream.BlockStream(stack)


def test_install_leaves_short_towers_and_the_switch_off_alone(monkeypatch):
    class Tower(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.blocks = blocks(n)

    assert vit_stream.install(Tower(2)) is None  # no more blocks than slots
    assert vit_stream.install(torch.nn.Identity()) is None  # a later rank's StageMissingLayer has no blocks
    monkeypatch.setenv("VLLM_VIT_STREAM", "0")
    assert vit_stream.install(Tower(5)) is None
    monkeypatch.setenv("VLLM_VIT_STREAM", "1")
    assert isinstance(vit_stream.install(Tower(5)), vit_stream.BlockStream)


@pytest.mark.gpu
def test_copies_overlap_on_a_side_stream_and_stay_correct():
    resident, streamed = blocks(9, "cuda", 1024), blocks(9, "cuda", 1024)
    stream = vit_stream.BlockStream(streamed)
    assert stream.copy_stream is not None and stream.host.is_pinned()
    x = torch.randn(4096, 1024, device="cuda")
    want = run(resident, x)
    for _ in range(4):
        assert torch.equal(run(streamed, x), want)
