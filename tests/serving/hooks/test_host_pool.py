"""The exact-size pinned host pool: size, the free-RAM check, the cross-process lock; pinning on a GPU."""

import multiprocessing as mp
import time

import pytest
import torch

from flashnext.errors import FlashnextError
from flashnext.serving.runtime.host_pool import PinnedHostPool, available_bytes, host_pool_lock


def test_exact_size_and_views(tmp_path):
    pool = PinnedHostPool(10_000_000, register=False, headroom=0, lock_path=str(tmp_path / "lock"))
    assert pool.tensor.numel() == 10_000_000  # not 16 MiB, as a power-of-two allocator would take
    v = pool.view(torch.bfloat16, (1000, 4000))
    v.fill_(1.5)
    assert pool.view(torch.bfloat16, (2,), offset=0).tolist() == [1.5, 1.5]
    with pytest.raises(ValueError):
        pool.view(torch.float32, (3_000_000,))


def test_free_ram_check_names_the_size(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 131072000 kB\nMemAvailable: 2097152 kB\n")  # 2 GiB available
    with pytest.raises(FlashnextError, match=r"needs 3\.96 GiB plus 4 GiB headroom; only 2\.00 GiB"):
        PinnedHostPool(int(3.96 * 2**30), register=False, lock_path=str(tmp_path / "lock"), meminfo=meminfo)
    assert available_bytes(meminfo, tmp_path / "no-cgroup") == 2 * 2**30


def _hold(lock_path, seconds, queue):
    with host_pool_lock(lock_path):
        queue.put(("in", time.monotonic()))
        time.sleep(seconds)
        queue.put(("out", time.monotonic()))


def test_the_lock_serialises_ranks(tmp_path):
    lock = str(tmp_path / "lock")
    q = mp.get_context("fork").Queue()
    procs = [mp.get_context("fork").Process(target=_hold, args=(lock, 0.3, q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(10)
    events = sorted((q.get() for _ in range(4)), key=lambda e: e[1])
    assert [e[0] for e in events] == ["in", "out", "in", "out"]  # never two inside at once


@pytest.mark.gpu
def test_pinned_on_the_gpu(tmp_path):
    pool = PinnedHostPool(64 << 20, headroom=0, lock_path=str(tmp_path / "lock"))
    host = pool.view(torch.float32, (16 << 20,))
    assert pool.registered and host.is_pinned()
    host.copy_(torch.arange(16 << 20, dtype=torch.float32))
    dev = host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), host)


def test_pinned_empty_is_exact(tmp_path, monkeypatch):
    from flashnext.serving.runtime import host_pool

    monkeypatch.setenv("VLLM_HOST_POOL_LOCK", str(tmp_path / "lock"))
    t = host_pool.pinned_empty((1000, 160), torch.bfloat16, register=False)
    assert t.shape == (1000, 160) and t.dtype == torch.bfloat16
    assert host_pool._POOLS[-1].nbytes == 1000 * 160 * 2  # the table's bytes, nothing rounded


def test_release_drops_exactly_that_pool(tmp_path, monkeypatch):
    """qsa-offload binds its host rows twice at start-up (vLLM's CUDA-graph memory profile binds a
    minimal KV cache first): the first pool must go, the other pools stay."""
    from flashnext.serving.runtime import host_pool

    monkeypatch.setenv("VLLM_HOST_POOL_LOCK", str(tmp_path / "lock"))
    first = host_pool.pinned_empty((64, 512), torch.bfloat16, register=False)
    second = host_pool.pinned_empty((32, 512), torch.bfloat16, register=False)
    pools = list(host_pool._POOLS)
    first_pool = next(p for p in pools if p.nbytes == 64 * 512 * 2 and p.tensor.data_ptr() == first.data_ptr())
    host_pool.release(first)
    assert first_pool not in host_pool._POOLS and first_pool.tensor is None
    assert any(p.tensor is not None and p.tensor.data_ptr() == second.data_ptr() for p in host_pool._POOLS)


@pytest.mark.gpu
def test_pinned_empty_on_the_gpu(tmp_path, monkeypatch):
    """The exact pool is pinned, mapped for UVA reads like vLLM's pinned PLE lookup, and not rounded."""
    from flashnext.serving.runtime import host_pool

    monkeypatch.setenv("VLLM_HOST_POOL_LOCK", str(tmp_path / "lock"))
    n = (5 << 20) + 123  # 20 MiB + change: PyTorch's allocator would reserve 32 MiB
    exact = host_pool.pinned_empty((n,), torch.float32)
    assert exact.is_pinned() and host_pool._POOLS[-1].nbytes == 4 * n
    exact.copy_(torch.arange(n, dtype=torch.float32))
    gathered = host_pool.uva_view(exact)[torch.tensor([0, 7, n - 1], device="cuda")]
    assert gathered.tolist() == [0.0, 7.0, float(n - 1)]
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    monkeypatch.setenv("VLLM_EXACT_HOST_POOL", "0")
    rounded = host_pool.pinned_empty((n,), torch.float32)
    assert rounded.is_pinned()
    after = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    assert after - before == 32 << 20  # the power of two above 4n bytes


@pytest.mark.gpu
def test_draft_embedding_read_through_uva(tmp_path, monkeypatch):
    """mtp-02: after loading, the draft's embedding rows sit in pinned host memory and the GPU
    gathers them through a UVA view, taking no device memory."""
    from flashnext.serving.hooks.mtp import finish_draft_embedding

    monkeypatch.setenv("VLLM_HOST_POOL_LOCK", str(tmp_path / "lock"))
    embed = torch.nn.Embedding(4096, 256, dtype=torch.bfloat16)  # built on the CPU, as draft_embedding does
    rows = embed.weight.detach().clone()
    before = torch.cuda.memory_allocated()
    finish_draft_embedding(embed)
    assert embed.weight.is_cuda and torch.cuda.memory_allocated() == before
    ids = torch.tensor([[0, 17, 4095]], device="cuda")
    assert torch.equal(embed(ids).cpu(), rows[ids.cpu()])
