"""The quantizer interface, its result type and its registry.

A quantizer turns a ``[rows, cols]`` float weight into symmetric integer codes with one scale per
``group_size`` columns (:class:`GroupQuantized`). Builders ask the registry by name, so a new
quantizer is one class and one decorator (plus a line in :data:`BUILTIN` for one shipped with
flashnext), and the overlay's report and model card name the one that made it::

    @register_quantizer("mse")
    class MseRtn(Quantizer):
        description = "MSE-searched scales, round-to-nearest"

        def quantize(self, weight, bits, group_size, scale_dtype, importance=None, gram=None):
            ...

    q = get_quantizer("mse", positive_scales=True).quantize(w, 4, 128, torch.bfloat16)

This module imports no torch: a command line lists the quantizers (``make-mtp-int4 --quantizer``,
its ``--help``) and refuses a bad name without paying for it; the built-in ones are imported when
one is asked for.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from flashnext.errors import FlashnextError

if TYPE_CHECKING:
    import torch

SUPPORTED_GROUP_SIZES = (32, 64, 128)

# The quantizers flashnext ships, and the module whose import registers each (a test checks that
# each module registers exactly these names).
BUILTIN: dict[str, str] = {
    "mse": "flashnext.quant.quantizers.mse_rtn",
    "rtn": "flashnext.quant.quantizers.mse_rtn",
    "gptq": "flashnext.quant.quantizers.gptq",
}

_REGISTRY: dict[str, type["Quantizer"]] = {}


@dataclass
class GroupQuantized:
    """Signed integer codes and per-group scales of one ``[N, K]`` matrix."""

    codes: "torch.Tensor"  # int8 [N, K]
    scale: "torch.Tensor"  # scale dtype [N, K // group_size]
    group_size: int

    def dequantize(self, dtype: "torch.dtype | None" = None) -> "torch.Tensor":
        """``q * s`` computed as the format defines it: in the scale dtype, then cast (float32 by default)."""
        import torch

        return dequantize(self.codes, self.scale, self.group_size).to(dtype or torch.float32)


def dequantize(codes: "torch.Tensor", scale: "torch.Tensor", group_size: int) -> "torch.Tensor":
    """``codes * scale`` per group, in the scale's dtype (how compressed-tensors and vLLM do it)."""
    rows, cols = codes.shape
    expanded = scale.repeat_interleave(group_size, dim=1)[:, :cols]
    return codes.to(scale.dtype) * expanded


def check_group_size(cols: int, group_size: int, what: str = "matrix") -> None:
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise FlashnextError(
            f"group size {group_size} is not supported: use one of {SUPPORTED_GROUP_SIZES}")
    if cols % group_size:
        raise FlashnextError(
            f"{what}: input dimension K={cols} is not divisible by the group size {group_size}")


class Quantizer(ABC):
    """Weight-only, symmetric, group-wise.

    Builders construct every quantizer alike, ``get_quantizer(name, positive_scales=...,
    calibrated=...)``: ``positive_scales`` asks for scales > 0 only, ``calibrated`` says that
    ``quantize`` will get calibration statistics. A quantizer may ignore either.
    """

    name: ClassVar[str]
    description: ClassVar[str]  # one phrase for reports and model cards
    # quantize() needs ``gram``: a builder computes the Gram matrices (K x K each, costly) only for
    # a quantizer that says so, and refuses to run it without calibration data.
    uses_gram: ClassVar[bool] = False

    def __init__(self, positive_scales: bool = False, calibrated: bool = False):
        self.positive_scales = positive_scales
        self.calibrated = calibrated

    @abstractmethod
    def quantize(self, weight: "torch.Tensor", bits: int, group_size: int, scale_dtype: "torch.dtype",
                 importance: "torch.Tensor | None" = None, gram: "torch.Tensor | None" = None) -> GroupQuantized:
        """Codes in ``[-2^(bits-1), 2^(bits-1) - 1]`` and ``scale_dtype`` scales for ``weight``.

        ``importance`` ([cols] or [rows, cols], non-negative): how much each input column's error
        costs on calibration activations. ``gram`` ([cols, cols], or [b, cols, cols] when
        ``weight`` stacks ``b`` matrices of ``rows // b`` rows, each with its own): ``XᵀX`` of the
        calibration inputs, given only to a quantizer with :attr:`uses_gram`. A quantizer may
        ignore ``importance``."""

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
    """The names :func:`get_quantizer` accepts (without importing the built-in ones)."""
    return sorted(set(BUILTIN) | set(_REGISTRY))


def quantizer_class(name: str) -> type[Quantizer]:
    """The class registered as ``name``, importing the built-in module that defines it."""
    if name not in _REGISTRY and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
    if name not in _REGISTRY:
        raise FlashnextError(f"no quantizer {name!r}; available: {', '.join(available_quantizers())}")
    return _REGISTRY[name]


def get_quantizer(name: str, **options) -> Quantizer:
    """The registered quantizer ``name``, built with ``options``."""
    return quantizer_class(name)(**options)


def require_finite(t: "torch.Tensor", what: str, origin: tuple[int, ...] = ()) -> None:
    """Refuse a source tensor holding NaN or Inf, naming ``what`` and the first bad index (counted
    from ``origin``, where ``t`` is a slice of a larger tensor): a scale or an error computed over it
    would be silently wrong (Python's ``max(0.0, nan)`` drops the NaN; an Inf makes every scale inf)."""
    import torch

    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        first = bad.nonzero()[0].tolist()
        at = [i + o for i, o in zip(first, origin)] + first[len(origin):]
        value = t[tuple(first)].item()
        raise FlashnextError(f"{what} holds {value} at index {at}: refusing to quantize non-finite weights")
