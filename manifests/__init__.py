"""Pinned descriptions of external things (the base model, the vLLM release, the overlay manifest
schema), shipped as package data: read them with :func:`manifest_path`, never through the source tree."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def manifest_path(name: str) -> Path:
    """The installed file ``name`` (e.g. ``overlay.schema.json``)."""
    return Path(str(resources.files(__name__) / name))
