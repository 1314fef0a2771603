"""A recorder of the tensors flashnext's code allocates, for tests/serving/test_engine_ledger.py.

A ``TorchDispatchMode`` sees every aten op; an op's output is an allocation when its storage is
none of its inputs' (a view, an in-place op or an ``out=`` op writes storage it was handed), and
``lift_fresh``'s output is the new tensor of a ``torch.tensor(data)``. An allocation is flashnext's
when its Python call stack passes through flashnext's code (the ``serving`` and ``quant``
packages); its call site is the innermost such frame, ``path:function`` relative to the
repository, so that vLLM's code called from a flashnext hook counts as that hook's. A test's
stand-in for what cannot run on the CPU (``stand_ins``: its directories, e.g. tests/support) is not
flashnext's code: what it allocates below a flashnext frame is left out, as the kernel it stands in
for allocates otherwise.

For each step (:meth:`Allocations.step`) it keeps every allocation with its bytes (the storage's)
and whether it outlived the step, and each site's peak of live bytes within the step. The CPU has
no allocator hooks with Python stacks (``torch.cuda.memory._record_memory_history`` is CUDA's), and
dispatch sees every allocation torch makes for an op, which is what the GPU's caching allocator
would be asked for.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass
class Allocation:
    site: str
    nbytes: int
    storage: StorageWeakRef
    outlived: bool | None = None  # whether it was alive once the step was over

    @property
    def alive(self) -> bool:
        return not self.storage.expired()


@dataclass
class Step:
    name: str
    allocations: list[Allocation] = field(default_factory=list)
    peaks: dict[str, int] = field(default_factory=dict)  # site -> its most bytes live at once

    def to_json(self) -> dict:
        return {"name": self.name, "peaks": self.peaks,
                "allocations": [{"site": a.site, "bytes": a.nbytes, "outlived": a.outlived} for a in self.allocations]}


def _storage(t: torch.Tensor):
    return t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() else None


class Allocations(TorchDispatchMode):
    """Steps of flashnext allocations (see the module's docstring); ``roots`` are the directories
    of flashnext's code, ``repository`` what call sites are named relative to, ``stand_ins`` the
    directories of stand-ins whose allocations are none of flashnext's."""

    def __init__(self, roots: list[Path], repository: Path, stand_ins: tuple[Path, ...] = ()):
        super().__init__()
        self.roots = tuple(str(r) + "/" for r in roots)
        self.stand_ins = tuple(str(r) + "/" for r in stand_ins)
        self.repository = str(repository) + "/"
        self._current: Step | None = None

    def _site(self) -> str | None:
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if self.stand_ins and path.startswith(self.stand_ins):
                return None
            if path.startswith(self.roots):
                return f"{path.removeprefix(self.repository)}:{frame.f_code.co_name}"
            frame = frame.f_back
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        step = self._current
        site = None if step is None else self._site()
        if site is None:
            return out
        fresh = func is torch.ops.aten.lift_fresh.default
        given = set() if fresh else {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and _storage(t) not in given
                and _storage(t) is not None]
        for t in made:
            storage = t.untyped_storage()
            step.allocations.append(Allocation(site, storage.nbytes(), StorageWeakRef(storage)))
        if made:
            live: dict[str, int] = {}
            for a in step.allocations:
                if a.alive:
                    live[a.site] = live.get(a.site, 0) + a.nbytes
            for s, n in live.items():
                step.peaks[s] = max(step.peaks.get(s, 0), n)
        return out

    @contextlib.contextmanager
    def step(self, name: str):
        """Record the allocations of one step; whether each outlived it is decided when the step's
        own references are gone (after the block, and a collection)."""
        step = Step(name)
        self._current = step
        try:
            yield step
        finally:
            self._current = None
            gc.collect()
            for a in step.allocations:
                a.outlived = a.alive
