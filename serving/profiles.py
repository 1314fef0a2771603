"""Serving profiles: the data in ``serving/profiles/*.json``, read as strict records.

A profile validates as every JSON record of flashnext's own does (``StrictRecord``'s config, read
through the same ``read_model``: one reader, one style of error line, and a schema generated from
it, ``manifests/profile.schema.json``). It is a :func:`strict_dataclass` rather than a model
because plans and tests vary a profile field by field with ``dataclasses.replace``, which validates
the copy too. Adding a profile is adding a file; its keys are exactly :class:`Profile`'s.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import field
from pathlib import Path

from pydantic.json_schema import SkipJsonSchema

from flashnext.errors import FlashnextError
from flashnext.quant.records.jsonfile import read_model
from flashnext.quant.records.strict import strict_dataclass

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


@strict_dataclass
class ContainerSettings:
    shm_size: str
    ipc: str
    memlock_unlimited: bool
    cap_add: dict[str, str]  # capability -> why the profile needs it
    stop_grace_period_s: int
    port: int


@strict_dataclass
class Healthcheck:
    interval_s: int
    timeout_s: int
    retries: int
    start_period_s: int


@strict_dataclass
class Profile:
    name: str
    description: str
    model_family: str
    gpus: int
    vllm_args: list[str]
    env: dict[str, str]
    container: ContainerSettings
    uses_ple_table: bool
    healthcheck: Healthcheck
    # Where it was read from, set by load_profile: not a key of the file.
    path: SkipJsonSchema[Path] = field(default=PROFILE_DIR, compare=False)

    @classmethod
    def not_this_record(cls, data: object) -> str | None:
        if isinstance(data, dict) and "path" in data:
            return "unknown keys ['path']"
        return None


def available() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name: str, directory: Path = PROFILE_DIR) -> Profile:
    """Load ``serving/profiles/NAME.json``: strict JSON, a regular file, every key known and of its
    type; anything else is one line naming the file and the key."""
    path = Path(directory) / f"{name}.json"
    if "/" in name or name.startswith(".") or not os.path.lexists(path):
        raise FlashnextError(f"no serving profile {name!r}: choose one of {', '.join(available())}")
    profile = read_model(path, Profile, "a serving profile")
    if profile.name != name:
        raise FlashnextError(f"{path}: name {profile.name!r} does not match the file name")
    return dataclasses.replace(profile, path=path)
