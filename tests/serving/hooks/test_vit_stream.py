"""BlockStream (the mechanism of patch vit-stream) and the hook's install on plain torch blocks:
on the CPU here, and with a real copy stream on the GPU machine (``-m gpu``). vLLM's own tower is
in tests/serving/test_patch_series.py."""

import contextlib
import os

import pytest
import torch

from flashnext.errors import FlashnextError
from flashnext.serving.hooks import vit_stream
from flashnext.serving.runtime.block_stream import BlockStream


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
    stream = BlockStream(streamed)
    storages = {p.untyped_storage().data_ptr() for b in streamed for p in b.parameters()}
    assert storages == {stream.slot_memory.untyped_storage().data_ptr()}
    assert stream.device_bytes == 2 * stream.block_bytes
    for _ in range(3):  # block 0 comes back into slot 0 for the next input
        assert torch.equal(run(streamed, x), want)


def test_blocks_that_differ_are_refused_in_one_line():
    stack = blocks(3)
    stack[1][1] = torch.nn.Linear(64, 64, bias=False)
    with pytest.raises(FlashnextError, match="block 1 differs"):
        BlockStream(stack)
    with pytest.raises(FlashnextError, match="two slots"):  # the next copy would overwrite a running block
        BlockStream(blocks(3), slots=1)


class Model(torch.nn.Module):
    """A model with a vision tower of ``n`` blocks beside its other weights, as vLLM's."""

    def __init__(self, n, width=64):
        super().__init__()
        self.language_model = torch.nn.Linear(width, width)
        self.visual = torch.nn.Module()
        self.visual.blocks = blocks(n, width=width)
        self.visual.merger = torch.nn.Linear(width, 8)


def test_install_leaves_short_towers_and_the_switch_off_alone(monkeypatch):
    short = Model(2)
    assert vit_stream.install(short) is None  # no more blocks than slots: moved, not streamed
    assert short.visual._flashnext_block_stream is None
    later_rank = Model(5)
    later_rank.visual = torch.nn.Identity()  # a later rank's StageMissingLayer has no blocks
    assert vit_stream.install(later_rank) is None
    monkeypatch.setenv("VLLM_VIT_STREAM", "0")
    assert vit_stream.install(Model(5)) is None
    assert isinstance(vit_stream.build_context(), type(contextlib.nullcontext()))
    monkeypatch.setenv("VLLM_VIT_STREAM", "1")
    assert vit_stream.build_context() == torch.device("cpu")
    assert isinstance(vit_stream.install(Model(5)), BlockStream)


@pytest.mark.gpu
def test_copies_overlap_on_a_side_stream_and_stay_correct():
    resident, streamed = blocks(9, "cuda", 1024), blocks(9, "cuda", 1024)
    stream = BlockStream(streamed)
    assert stream.copy_stream is not None and stream.host.is_pinned()
    x = torch.randn(4096, 1024, device="cuda")
    want = run(resident, x)
    for _ in range(4):
        assert torch.equal(run(streamed, x), want)


@pytest.mark.gpu
def test_install_returns_the_pinned_copies_of_vllms_post_load_step():
    """Issue 40 item 4. vLLM's post-load step leaves each CPU-built quantized module's parameters in
    ``torch.empty_like(pin_memory=True)`` (``device_loading_context``; vLLM cannot run on the GPU
    machine, so the test makes those copies as it does). Install copies them into the stream's own
    pinned rows and gives the old ones back: the process holds the tower's bytes once, not twice.
    Counted as the process's resident memory (torch 2.11 there keeps no host-allocator statistics)."""
    def resident() -> int:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    model = Model(6, width=2048)
    model.language_model.to("cuda")
    for p in model.visual.parameters():
        p.data = torch.empty_like(p.data, device="cpu", pin_memory=True).copy_(p.data)
    tower = sum(p.numel() * p.element_size() for p in model.visual.parameters())
    before = resident()
    stream = vit_stream.install(model)
    grown = resident() - before
    assert stream.host.is_pinned() and stream.host.numel() >= tower * 5 // 6  # the blocks, in its own rows
    assert grown < tower // 2, f"{grown / 2**20:.1f} MiB more resident for a {tower / 2**20:.1f} MiB tower"


@pytest.mark.gpu
def test_a_tower_built_on_the_cpu_streams_on_the_device_of_the_model():
    model = Model(6)
    model.language_model.to("cuda")
    x = torch.randn(32, 64)
    want = model.visual.merger(run(model.visual.blocks, x)).cuda()
    stream = vit_stream.install(model)
    assert stream.device.type == "cuda" and model.visual.merger.weight.is_cuda
    assert all(p.is_cuda for b in model.visual.blocks for p in b.parameters())
    for _ in range(3):
        got = model.visual.merger(run(model.visual.blocks, x.cuda()))
        torch.testing.assert_close(got, want)  # CPU against GPU arithmetic
