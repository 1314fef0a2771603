"""PLE n-gram row ids in numpy, bit-identical to vLLM 0.34.0's ``_ple_ngram_ids_kernel``.

For token ``t`` of a batch (flat ``tokens``, ``query_start_loc`` of ``R+1`` entries, and
``ngram_size-1`` context tokens per request, oldest first), head ``g`` of order
``n = g // heads_per_ngram + 2`` gets::

    mixed = (p0*m0) XOR (p1*m1) XOR ... XOR (p_{n-1}*m_{n-1})     (int64, wrapping)
    id    = (mixed mod size[g]) + offset[g]                       (floor-mod, as torch.remainder)

where ``p0`` is the token and ``p_s`` its predecessor at shift ``s``: ``tokens[t-s]`` inside the
chunk, else the request's context. Walking from newest to oldest, every predecessor older than the
first EOS met becomes EOS (the EOS itself is kept); a current token that is EOS masks nothing.
The request of a token is found as the kernel's binary search finds it: the last request whose
start is at or before the token, clamped to ``R-1``.
"""

from __future__ import annotations

import numpy as np

from flashnext.quant.ple.layout import PleLayout


class NgramHasher:
    """Precomputed constants of one PLE layer; ``ids()`` for batches, ``token_ids()`` for one token."""

    def __init__(self, layout: PleLayout):
        self.layout = layout
        self.context_len = layout.ngram_size - 1
        self.multipliers = np.array(layout.multipliers, dtype=np.int64)
        self.sizes = np.array(layout.head_sizes, dtype=np.int64)
        self.offsets = np.array(layout.head_offsets, dtype=np.int64)
        # order of head g minus 2: which cumulative hash it takes
        self.head_order = np.arange(layout.num_heads) // layout.heads_per_ngram
        self.eos = np.int64(layout.eos_token_id)
        self._py_mult = [int(m) for m in layout.multipliers]
        self._py_sizes = [int(s) for s in layout.head_sizes]
        self._py_offsets = [int(o) for o in layout.head_offsets]

    def ids(self, tokens, query_start_loc=None, context=None) -> np.ndarray:
        """``[T, heads]`` int64 row ids. Defaults: one request, a fresh prompt (context all EOS)."""
        tokens = np.asarray(tokens).astype(np.int64, copy=False).reshape(-1)
        T, C = tokens.shape[0], self.context_len
        if query_start_loc is None:
            query_start_loc = np.array([0, T], dtype=np.int64)
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        R = qsl.shape[0] - 1
        if context is None:
            context = np.full((R, C), self.eos, dtype=np.int64)
        ctx = np.asarray(context).astype(np.int64, copy=False).reshape(R, C)
        t = np.arange(T, dtype=np.int64)
        req = np.minimum(np.searchsorted(qsl[1:], t, side="right"), R - 1)
        chunk_pos = t - qsl[req]
        with np.errstate(over="ignore"):
            mixed = tokens * self.multipliers[0]
            orders = []
            crossed = np.zeros(T, dtype=bool)
            for shift in range(1, C + 1):
                in_step = chunk_pos >= shift
                from_step = tokens[np.maximum(t - shift, 0)]
                ctx_col = np.clip(C - shift + chunk_pos, 0, C - 1)
                candidate = np.where(in_step, from_step, ctx[req, ctx_col])
                candidate = np.where(crossed, self.eos, candidate)
                crossed |= candidate == self.eos
                mixed = mixed ^ (candidate * self.multipliers[shift])
                orders.append(mixed)
        by_head = np.stack(orders, axis=1)[:, self.head_order]  # [T, heads]
        return np.mod(by_head, self.sizes) + self.offsets

    def token_ids(self, token: int, prev: tuple[int, ...]) -> list[int]:
        """Ids of one token with its predecessors ``prev`` (newest first), in pure Python: the
        decode path advises one token's rows per step and cannot afford numpy's per-call cost."""
        eos = self.layout.eos_token_id
        m = self._py_mult
        mixed = (token * m[0]) & 0xFFFFFFFFFFFFFFFF
        crossed = False
        cumulative = []
        for shift, cand in enumerate(prev[: self.context_len], start=1):
            if crossed:
                cand = eos
            crossed = crossed or cand == eos
            mixed ^= (cand * m[shift]) & 0xFFFFFFFFFFFFFFFF
            cumulative.append(mixed - (1 << 64) if mixed >= 1 << 63 else mixed)
        hpn = self.layout.heads_per_ngram
        return [cumulative[g // hpn] % size + off
                for g, (size, off) in enumerate(zip(self._py_sizes, self._py_offsets))]
