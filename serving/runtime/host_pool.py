"""Exact-size pinned host memory, and CUDA views of it.

PyTorch's caching host allocator rounds a pinned allocation up to a power of two: a 4.24 GiB QSA
K/V pool per layer became 8 GiB, 96 GiB for 12 layers (seed 000 §2). A pool here takes exactly the
bytes asked for with an anonymous ``mmap`` and pins them with ``cudaHostRegister``, and keeps them
until the process ends, so no allocator cache is needed.

Before pinning it checks free RAM and refuses with the size it needs. Pipeline ranks allocate at
the same moment, so the check and the pinning happen under one file lock (``VLLM_HOST_POOL_LOCK``);
without it two ranks could both pass the check and then both run out of memory.

The CUDA runtime is reached one way, through :func:`_cuda_runtime` (ctypes over the libcudart
PyTorch loaded): PyTorch's own binding has ``cudaHostRegister`` but not ``cudaHostGetDevicePointer``,
and registering through one library while asking another for the mapping made two paths to keep right.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import functools
import mmap
import os
import stat
from contextlib import contextmanager
from pathlib import Path

import torch

from flashnext import envs
from flashnext.errors import FlashnextError
from flashnext.serving.capacity.rules import HOST_HEADROOM
from flashnext.serving.host_memory import CGROUP_MEMORY_MAX, MEMINFO, read_host_memory


def available_bytes(meminfo: Path = MEMINFO, cgroup: Path = CGROUP_MEMORY_MAX.parent) -> int:
    """MemAvailable, lowered to the cgroup's remaining allowance when a limit applies."""
    return read_host_memory(meminfo, cgroup / "memory.max").allowance


@contextmanager
def host_pool_lock(path: str | None = None):
    """An exclusive lock shared by every process on the host (the pipeline ranks). The file lives in
    the shared temporary folder, where anyone can plant its name first: it is never opened through a
    link (which would create or lock the file the link points at), and only a regular file is a lock."""
    where = path or envs.VLLM_HOST_POOL_LOCK.get()
    try:
        fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FlashnextError(f"the host pool lock {where} is a symbolic link, not a lock file: remove it "
                                 "(someone else can write in that folder?) or set VLLM_HOST_POOL_LOCK elsewhere") from None
        if e.errno != errno.EISDIR:
            raise
        fd = None
    if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd is not None:
            os.close(fd)
        raise FlashnextError(f"the host pool lock {where} is not a regular file: remove it or set "
                             "VLLM_HOST_POOL_LOCK elsewhere")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _loaded_cudart() -> list[str]:
    """The libcudart files mapped into this process (the one PyTorch linked against first)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = (line.split(maxsplit=5)[-1] for line in maps if "libcudart" in line)
    return list(dict.fromkeys(p for p in paths if p.startswith("/")))


@functools.cache
def _cuda_runtime() -> ctypes.CDLL:
    """The CUDA runtime PyTorch loaded (a pip wheel's, or the system's), with the signatures of the
    three calls made here (sizes past 4 GiB need ``size_t``, not ctypes' default int)."""
    torch.cuda.init()  # loads PyTorch's libcudart and makes the context these calls run in
    found = ctypes.util.find_library("cudart")
    for name in _loaded_cudart() + ([found] if found else []) + ["libcudart.so", "libcudart.so.13",
                                                                 "libcudart.so.12"]:
        try:
            runtime = ctypes.CDLL(name)
        except OSError:
            continue
        runtime.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        runtime.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        runtime.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]
        for call in (runtime.cudaHostRegister, runtime.cudaHostUnregister, runtime.cudaHostGetDevicePointer):
            call.restype = ctypes.c_int
        return runtime
    raise FlashnextError("the CUDA runtime (libcudart) was not found")


class PinnedHostPool:
    """``nbytes`` of page-locked host memory, exactly (rounded to the page size only)."""

    def __init__(self, nbytes: int, *, register: bool = True, headroom: int = HOST_HEADROOM,
                 lock_path: str | None = None, meminfo: Path = Path("/proc/meminfo")):
        if nbytes <= 0:
            raise FlashnextError(f"a host pool needs a positive size, got {nbytes}")
        self.nbytes = nbytes
        self.registered = False
        with host_pool_lock(lock_path):
            free = available_bytes(meminfo)
            if nbytes + headroom > free:
                raise FlashnextError(
                    f"the pinned host pool needs {nbytes / 2**30:.2f} GiB plus {headroom / 2**30:.0f} GiB headroom; "
                    f"only {free / 2**30:.2f} GiB of RAM is available: lower --kv-cache-memory-bytes or free memory")
            self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
            # Touch every page now, under the lock, so the memory is really taken before the next rank checks.
            self.tensor.zero_()
            if register:
                err = _cuda_runtime().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
                if err != 0:
                    raise FlashnextError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed (error {err}); "
                                         "is `ulimit -l` unlimited?")
                self.registered = True

    def close(self) -> None:
        """Unpin and unmap. The driver keeps a registration past ``munmap``, and a later mapping at
        the same address could then not be registered, so a pool is always unregistered first."""
        if getattr(self, "registered", False):
            _cuda_runtime().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False
        if getattr(self, "_map", None) is not None:
            self.tensor = None
            try:
                self._map.close()
            except BufferError:
                pass  # a view still refers to it; the mapping goes when that does
            self._map = None

    def __del__(self):
        self.close()

    def view(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """A tensor over ``[offset, offset + size)`` of the pool."""
        nbytes = _nbytes(shape, dtype)
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"view of {nbytes} B at {offset} exceeds the pool's {self.nbytes} B")
        return self.tensor[offset:offset + nbytes].view(dtype).view(shape)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for d in shape:
        count *= d
    return count * torch.empty(0, dtype=dtype).element_size()


# Held for the process's lifetime, as vLLM holds the pinned tensors made from them.
_POOLS: list[PinnedHostPool] = []


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, *, register: bool = True) -> torch.Tensor:
    """An uninitialised pinned host tensor of exactly its size (patch host-pool).

    With ``VLLM_EXACT_HOST_POOL=0`` it is PyTorch's ``torch.empty(..., pin_memory=True)`` instead,
    which the caching host allocator rounds up to a power of two (a 95.4 GiB PLE table: 128 GiB).
    """
    if not envs.VLLM_EXACT_HOST_POOL.enabled():
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
    pool = PinnedHostPool(max(_nbytes(shape, dtype), 1), register=register, lock_path=envs.VLLM_HOST_POOL_LOCK.get())
    _POOLS.append(pool)
    return pool.view(dtype, tuple(shape))


def release(tensor: torch.Tensor) -> None:
    """Unpin and unmap the exact-size pool behind ``tensor`` (a :func:`pinned_empty` result) once
    nothing else refers to it; a PyTorch pinned tensor (the switch off) just goes with its last reference."""
    for pool in _POOLS:
        if pool.tensor is not None and pool.tensor.data_ptr() == tensor.data_ptr():
            _POOLS.remove(pool)
            pool.close()
            return


class _CudaArray:
    def __init__(self, pointer: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False),
                                         "version": 3, "strides": None}


def uva_view(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over pinned host memory (unified addressing): kernels read ``host`` over PCIe,
    nothing is copied and no device memory is taken. ``host`` must stay alive as long as the view."""
    if not host.is_pinned():
        raise FlashnextError("a UVA view needs pinned host memory")
    pointer = ctypes.c_void_p()
    err = _cuda_runtime().cudaHostGetDevicePointer(ctypes.byref(pointer), host.data_ptr(), 0)
    if err != 0:
        raise FlashnextError(f"cudaHostGetDevicePointer failed (error {err})")
    nbytes = host.numel() * host.element_size()
    return torch.as_tensor(_CudaArray(pointer.value, nbytes), device="cuda").view(host.dtype).view(host.shape)
