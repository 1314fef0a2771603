"""Reference quantizers to compare ``make-mtp-int4`` against, written from their published algorithms.

* ``llmcompressor_mse``: llm-compressor's ``memoryless_mse`` weight observer with its defaults
  (maxshrink 0.20, grid 100, norm 2.4, patience 5): shrink both ends by p = 1.00, 0.99, ... 0.81,
  scale = p*absmax/7.5, keep the p of least sum |err|^2.4 per group, stop after 5 steps in which no
  group of the tensor improved.
* ``autoround_opt_rtn``: AutoRound's optimized RTN (``iters=0``): 200 candidate scales
  ``-m / (8 - 0.06 k)``, k = -100..100, k != 0, where m is the signed value of largest magnitude;
  keep the least squared error per group; no least-squares refit.

Both search with unrounded scales, as the originals do; the chosen scale is then stored in bf16,
the storage dtype every method here shares. (The numbers for these are from reimplementations of
their documented algorithms, not from running those packages; ``benchmarks.calibrated_quality`` runs
the packages themselves.)
"""

from __future__ import annotations

import torch

from flashnext.quant.quantizers.base import GroupQuantized


def _groups(w: torch.Tensor, gs: int) -> torch.Tensor:
    return w.reshape(-1, gs).to(torch.float32)


def _finish(w: torch.Tensor, x: torch.Tensor, s: torch.Tensor, gs: int) -> GroupQuantized:
    s_b = s.to(torch.bfloat16)
    s_f = s_b.float()
    safe = torch.where(s_f == 0, torch.ones_like(s_f), s_f)
    q = (x / safe[:, None]).round().clamp(-8, 7).to(torch.int8)
    return GroupQuantized(q.view(w.shape), s_b.view(w.shape[0], -1), gs)


def llmcompressor_mse(w: torch.Tensor, group_size: int = 128, maxshrink: float = 0.20,
                      grid: float = 100.0, norm: float = 2.4, patience: int = 5) -> GroupQuantized:
    x = _groups(w, group_size)
    amax = x.abs().amax(dim=1)
    best = torch.full_like(amax, float("inf"))
    best_s = amax / 7.5
    stale = 0
    for i in range(int(maxshrink * grid)):
        p = 1 - i / grid
        s = p * amax / 7.5
        safe = torch.where(s == 0, torch.ones_like(s), s)
        q = (x / safe[:, None]).round().clamp(-8, 7)
        err = (q * safe[:, None] - x).abs().pow(norm).sum(dim=1)
        better = err < best
        if better.any():
            stale = 0
        else:
            stale += 1
            if stale >= patience:
                break
        best = torch.where(better, err, best)
        best_s = torch.where(better, s, best_s)
    return _finish(w, x, best_s, group_size)


def autoround_opt_rtn(w: torch.Tensor, group_size: int = 128) -> GroupQuantized:
    x = _groups(w, group_size)
    m = x.gather(1, x.abs().argmax(dim=1, keepdim=True)).squeeze(1)
    best = torch.full_like(m, float("inf"))
    best_s = -m / 8
    for k in range(-100, 101):
        if k == 0:
            continue
        s = -m / (8 - 0.06 * k)
        safe = torch.where(s == 0, torch.ones_like(s), s)
        q = (x / safe[:, None]).round().clamp(-8, 7)
        err = ((q * safe[:, None] - x) ** 2).sum(dim=1)
        better = err < best
        best = torch.where(better, err, best)
        best_s = torch.where(better, s, best_s)
    return _finish(w, x, best_s, group_size)
