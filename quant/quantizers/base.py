"""The quantizer interface and its registry.

A quantizer turns a ``[rows, cols]`` float weight into symmetric integer codes with one scale per
``group_size`` columns (:class:`GroupQuantized`). Builders ask the registry by name, so a new
quantizer is one class and one decorator, and the overlay's report and model card name the one
that made it::

    @register_quantizer("mse")
    class MseRtn(Quantizer):
        description = "MSE-searched scales, round-to-nearest"

        def quantize(self, weight, bits, group_size, scale_dtype):
            ...

    q = get_quantizer("mse", positive_scales=True).quantize(w, 4, 128, torch.bfloat16)
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from flashnext.errors import FlashnextError

if TYPE_CHECKING:
    import torch

    from flashnext.quant.quantizers.mse_rtn import GroupQuantized

_REGISTRY: dict[str, type["Quantizer"]] = {}


class Quantizer(ABC):
    """Weight-only, symmetric, group-wise."""

    name: ClassVar[str]
    description: ClassVar[str]  # one phrase for reports and model cards

    @abstractmethod
    def quantize(self, weight: "torch.Tensor", bits: int, group_size: int,
                 scale_dtype: "torch.dtype", importance: "torch.Tensor | None" = None) -> "GroupQuantized":
        """Codes in ``[-2^(bits-1), 2^(bits-1) - 1]`` and ``scale_dtype`` scales for ``weight``.
        ``importance`` ([cols] or [rows, cols], non-negative): how much each input column's error
        costs on calibration activations; a quantizer may ignore it."""

    def options(self) -> dict:
        """The settings that made a result, for its report."""
        return {}


def register_quantizer(name: str):
    """Class decorator: make a :class:`Quantizer` available as ``name``."""

    def register(cls: type[Quantizer]) -> type[Quantizer]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"quantizer {name!r} is registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return register


def available_quantizers() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def get_quantizer(name: str, **options) -> Quantizer:
    """The registered quantizer ``name``, built with ``options``."""
    _load_builtin()
    if name not in _REGISTRY:
        raise FlashnextError(f"no quantizer {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**options)


def _load_builtin() -> None:
    """Import the built-in quantizers, which register themselves ("mse", "rtn")."""
    importlib.import_module("flashnext.quant.quantizers.mse_rtn")
