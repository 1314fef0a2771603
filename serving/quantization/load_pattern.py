"""Seed 000 §3.5: a layer that keeps its weights as loaded still allocates them once after loading.

vLLM's kernels rewrite each quantized layer's weights after loading (Marlin and Humming: a new
tensor, then the loaded one freed), and PyTorch's allocator refills those holes as the next layers
do the same. The seed found that a layer which stops doing it (its hyper-connection mixers, read
as loaded by the decode-04 kernels) moves the holes the other layers' rewrites leave: reserved
memory rose 190 MiB with allocated memory unchanged, in fragments under expandable segments'
unit that ``torch.cuda.empty_cache()`` cannot return, 2 MiB over the fullest 3090's limit.
Cloning the mixers' weights and scales once, and writing the INT6 bit planes into one region of
the original's size, brought the peaks back ([24072, 24100, 24090] -> [24022, 24090, 24038] MiB).
flashnext's methods that keep the checkpoint's words (:class:`~.int8.Int8LinearMethod`, the mixers;
:class:`~.bitplane.BitplaneLinearMethod` with the planes kept, the overlay's shared experts) do the
same, through :func:`reallocate_as_repacked`.
"""

from __future__ import annotations

import torch

# what the seed reallocates: the weights and their group scales (weight_shape is 16 bytes)
REALLOCATED = ("weight_packed", "weight_scale")


def reallocate_as_repacked(layer: torch.nn.Module, names: tuple[str, ...] = REALLOCATED) -> None:
    """Give each of ``layer``'s parameters ``names`` a new tensor of its own size and contents, one
    at a time, freeing the loaded one, as a repack allocates and frees. The parameter objects stay
    (vLLM's loader and the hooks hold them), and so do their bytes."""
    for name in names:
        param = getattr(layer, name)
        param.data = param.data.clone()
