"""Serving profiles: the data in ``serving/profiles/*.json``, loaded strictly."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from flashnext.errors import FlashnextError

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True)
class ContainerSettings:
    shm_size: str
    ipc: str
    memlock_unlimited: bool
    cap_add: dict[str, str]  # capability -> why the profile needs it
    stop_grace_period_s: int
    port: int


@dataclass(frozen=True)
class Healthcheck:
    interval_s: int
    timeout_s: int
    retries: int
    start_period_s: int


@dataclass(frozen=True)
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
    path: Path = field(default=PROFILE_DIR, compare=False)


def _strict(cls, data: dict, where: str):
    names = {f.name for f in fields(cls) if f.name != "path"}
    unknown = set(data) - names
    missing = names - set(data)
    if unknown or missing:
        raise FlashnextError(f"{where}: " + "; ".join(
            ([f"unknown keys {sorted(unknown)}"] if unknown else []) + ([f"missing keys {sorted(missing)}"] if missing else [])))
    return data


def available() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name: str, directory: Path = PROFILE_DIR) -> Profile:
    """Load ``serving/profiles/NAME.json``; unknown or missing keys are an error."""
    path = Path(directory) / f"{name}.json"
    if not path.is_file():
        raise FlashnextError(f"no serving profile {name!r}: choose one of {', '.join(available())}")
    data = _strict(Profile, json.loads(path.read_text()), str(path))
    container = ContainerSettings(**_strict(ContainerSettings, data["container"], f"{path} container"))
    health = Healthcheck(**_strict(Healthcheck, data["healthcheck"], f"{path} healthcheck"))
    if data["name"] != name:
        raise FlashnextError(f"{path}: name {data['name']!r} does not match the file name")
    return Profile(**{**data, "container": container, "healthcheck": health}, path=path)
