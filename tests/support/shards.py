"""Editing a test snapshot's shard in place (on a private copy), through flashnext's own writer."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

from flashnext.quant.formats.safetensors_io import ShardWriter, spec_of


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    with ShardWriter(path, [spec_of(k, v) for k, v in tensors.items()], {"format": "pt"}) as w:
        for k, v in tensors.items():
            w.write(k, v)


def rewrite_shard(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> dict[str, torch.Tensor]:
    """Load ``path``, let ``edit`` change the tensors in place, write it back; returns the tensors.

    The tensors are cloned first: ``load_file`` maps the file, which the rewrite truncates.
    """
    tensors = {k: v.clone() for k, v in load_file(path).items()}
    edit(tensors)
    write_shard(path, tensors)
    return tensors
