"""The device a quantizer runs on, checked before any work: the CPU or a CUDA device this process
can use. The error carries the name as given, so that a command line can name its own flag."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashnext.errors import FlashnextError

if TYPE_CHECKING:
    import torch


class DeviceError(FlashnextError):
    """``name`` is no device to quantize on; ``problem`` says why, following the name."""

    def __init__(self, name: str, problem: str):
        super().__init__(f"device {name!r}{problem}")
        self.name = name
        self.problem = problem


def usable_device(name: str) -> torch.device:
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise DeviceError(name, f" is not a device name: {str(e).splitlines()[0]}") from None
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(name, ": quantizing runs on cpu or cuda[:N]")
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as e:
        raise DeviceError(name, f" is not usable here: {str(e).splitlines()[0]}") from None
    return device
