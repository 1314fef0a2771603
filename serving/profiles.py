"""Serving profiles: the data in ``serving/profiles/*.json``, loaded strictly."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import get_args, get_origin, get_type_hints

from flashnext.errors import FlashnextError
from flashnext.quant.records.jsonfile import read_json

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


def _strict(cls, data: object, where: str) -> dict:
    """``data`` as the fields of ``cls``: a JSON object with exactly its keys, each of its type."""
    if not isinstance(data, dict):
        raise FlashnextError(f"{where} must be a JSON object")
    names = {f.name for f in fields(cls) if f.name != "path"}
    unknown = set(data) - names
    missing = names - set(data)
    if unknown or missing:
        raise FlashnextError(f"{where}: " + "; ".join(
            ([f"unknown keys {sorted(unknown)}"] if unknown else []) + ([f"missing keys {sorted(missing)}"] if missing else [])))
    hints = get_type_hints(cls)
    for name in sorted(names):
        _check_type(data[name], hints[name], f"{where}: {name}")
    return data


def _check_type(value: object, hint, where: str) -> None:
    """``value`` (from JSON) is of ``hint``: a scalar, ``list[str]`` or ``dict[str, str]``; nested
    dataclasses are checked by their own :func:`_strict`."""
    origin, args = get_origin(hint), get_args(hint)
    if is_dataclass(hint):
        return
    if origin is list:
        if not isinstance(value, list) or not all(isinstance(v, args[0]) for v in value):
            raise FlashnextError(f"{where} must be a list of {_json_name(args[0])}s")
    elif origin is dict:
        if not isinstance(value, dict) or not all(isinstance(v, args[1]) for v in value.values()):
            raise FlashnextError(f"{where} must be an object of {_json_name(args[1])}s")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise FlashnextError(f"{where} must be an integer, got {value!r}")
    elif not isinstance(value, hint):
        raise FlashnextError(f"{where} must be a {_json_name(hint)}, got {value!r}")


def _json_name(t: type) -> str:
    return {str: "string", int: "integer", bool: "boolean"}.get(t, t.__name__)


def available() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name: str, directory: Path = PROFILE_DIR) -> Profile:
    """Load ``serving/profiles/NAME.json``: strict JSON, a regular file, every key known and of its
    type; anything else is one line naming the file and the key."""
    path = Path(directory) / f"{name}.json"
    if "/" in name or name.startswith(".") or not os.path.lexists(path):
        raise FlashnextError(f"no serving profile {name!r}: choose one of {', '.join(available())}")
    data = _strict(Profile, read_json(path, "a serving profile"), str(path))
    container = ContainerSettings(**_strict(ContainerSettings, data["container"], f"{path}: container"))
    health = Healthcheck(**_strict(Healthcheck, data["healthcheck"], f"{path}: healthcheck"))
    if data["name"] != name:
        raise FlashnextError(f"{path}: name {data['name']!r} does not match the file name")
    return Profile(**{**data, "container": container, "healthcheck": health}, path=path)
