"""A recorder of Triton launches as Triton 3.8's own cache keys for an RTX 3090, without running the
kernels: ``JITFunction``'s binder with the sm86 CUDA backend gives the constexprs, dtypes, the
integer and alignment specializations and the launch options, which are what decide whether a
launch compiles a new variant. Used by tests/serving/patches/test_no_new_triton_variants.py and,
in its scenario's process, by tests/serving/test_engine_ledger.py.

Needs ``TRITON_INTERPRET=1`` (the kernels are then ``InterpretedFunction``s, whose ``run`` it replaces).
"""

import contextlib

from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

RTX_3090 = GPUTarget("cuda", 86, 32)


class Launches:
    """Every launch of a Triton kernel inside :meth:`recording`, as ``(kernel, specialization,
    options)``, Triton's cache key; the kernels are not run (only what the launch passes decides
    the key), but for those whose name is in ``run`` (run by the interpreter after being
    recorded)."""

    def __init__(self, run: frozenset[str] = frozenset()):
        self.keys: list[tuple[str, tuple, str]] = []
        self.run = run
        self._binders = {}
        self._backend = make_backend(RTX_3090)

    def key(self, kernel, args, kwargs):
        binder = self._binders.get(kernel.fn)
        if binder is None:
            jit = JITFunction(kernel.fn, **kernel.kwargs)  # the decorator's do_not_specialize and all
            binder = self._binders[kernel.fn] = create_function_from_signature(jit.signature, jit.params,
                                                                               self._backend)
        _, specialization, options = binder(*args, **kwargs)
        return kernel.fn.__qualname__, tuple(map(tuple, specialization)), str(options)

    @contextlib.contextmanager
    def recording(self):
        recorder = self

        def run(self, *args, grid, warmup, **kwargs):
            key = recorder.key(self, args, kwargs)
            recorder.keys.append(key)
            if key[0] in recorder.run:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)

        original = InterpretedFunction.run
        InterpretedFunction.run = run
        try:
            yield self
        finally:
            InterpretedFunction.run = original
