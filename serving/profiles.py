"""Serving profiles: the data in ``serving/profiles/*.json``, read as strict records.

A profile validates as every JSON record of flashnext's own does (``StrictRecord``'s config, read
through the same ``read_model``: one reader, one style of error line, and a schema generated from
it, ``manifests/profile.schema.json``). It is a :func:`strict_dataclass` rather than a model
because plans and tests vary a profile field by field with ``dataclasses.replace``, which validates
the copy too. Adding a profile is adding a file; its keys are exactly :class:`Profile`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
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


# A profile's name is its file's name without ``.json``; it also names serve's state folder and the
# Compose project, so it is one plain path component.
PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def available() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def is_profile_file(arg: str) -> bool:
    """Whether ``--profile ARG`` names a profile file (``flashnext plan --write-profile``'s, say)
    rather than a shipped profile: a path with a folder in it, or a ``.json`` name."""
    return "/" in arg or arg.endswith(".json")


def load_profile(name: str, directory: Path = PROFILE_DIR) -> Profile:
    """Load ``serving/profiles/NAME.json``, or the profile file ``name`` names (:func:`is_profile_file`):
    strict JSON, a regular file, every key known and of its type, its ``name`` its file's name;
    anything else is one line naming the file and the key."""
    if is_profile_file(name):
        path = Path(name)
        if not path.name.endswith(".json") or not os.path.lexists(path):
            raise FlashnextError(f"no serving profile file {name}: give a .json file that `flashnext plan "
                                 "--write-profile` wrote, or one of " + ", ".join(available()))
        stem = path.name[:-len(".json")]
    else:
        path, stem = Path(directory) / f"{name}.json", name
        if name.startswith(".") or not os.path.lexists(path):
            raise FlashnextError(f"no serving profile {name!r}: choose one of {', '.join(available())}")
    profile = read_model(path, Profile, "a serving profile")
    if profile.name != stem:
        raise FlashnextError(f"{path}: name {profile.name!r} does not match the file name")
    if not PROFILE_NAME.fullmatch(profile.name):
        raise FlashnextError(f"{path}: name {profile.name!r} is not a profile name (letters, digits, '.', '_', '-')")
    return dataclasses.replace(profile, path=path)


def profile_name(arg: str) -> str:
    """The name ``--profile ARG`` runs under (serve's state folder): the shipped name, or the name
    inside the profile file ARG."""
    if is_profile_file(arg):
        return load_profile(arg).name
    if not PROFILE_NAME.fullmatch(arg):
        raise FlashnextError(f"{arg!r} is not a profile name (letters, digits, '.', '_', '-') or a profile file")
    return arg


def is_shipped(profile: Profile) -> bool:
    """Whether ``profile`` is the shipped one of its name, read from ``serving/profiles/`` (the image
    has those; another file has to be carried into the container). A profile not read from a file
    (``path`` left at its default) counts as shipped."""
    shipped = PROFILE_DIR / f"{profile.name}.json"
    if profile.path in (PROFILE_DIR, shipped):
        return True
    try:
        return os.path.samefile(profile.path, shipped)
    except OSError:
        return False


def profile_text(profile: Profile) -> str:
    """``profile`` as its file holds it: its keys in :class:`Profile`'s order, two-space indent, ASCII."""
    data = {f.name: getattr(profile, f.name) for f in dataclasses.fields(Profile) if f.name != "path"}
    data["container"] = dataclasses.asdict(profile.container)
    data["healthcheck"] = dataclasses.asdict(profile.healthcheck)
    return json.dumps(data, indent=2) + "\n"


def write_profile(profile: Profile, path: Path) -> Path:
    """Write ``profile`` as a new file ``path`` (``NAME.json``, NAME the profile's name): created
    exclusively and never through a link, complete or not at all; an existing ``path`` is refused."""
    from flashnext.quant.checkpoint.fsutil import write_new_file

    path = Path(path)
    if path.name != f"{profile.name}.json":
        raise FlashnextError(f"{path}: a profile file is named after its profile: {profile.name}.json")
    write_new_file(path, profile_text(profile))
    return path


_SPECULATIVE_CONFIG = ("--speculative-config", "-sc")


def speculative_method(profile: Profile) -> str | None:
    """The method of the profile's ``--speculative-config`` (``"mtp"``), None where it sets none.

    Read without vLLM, unlike the plan's reading (``capacity/shape.py``), because the Hub model card
    asks it on a base install, which has no vLLM; tests/quant/overlays/test_hub.py checks that it
    agrees with vLLM's own parser. The last occurrence wins, as with argparse; a form it cannot read
    as vLLM does (the dotted ``--speculative-config.method``, the underscore spelling, which vLLM's
    parse_known_args does not read the same way on every run) is refused rather than guessed."""
    import json

    text = None
    args = list(profile.vllm_args)
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag.startswith(("--speculative-config.", "--speculative_config")):
            raise FlashnextError(f"profile {profile.name}: {flag} is not read here; give the speculative "
                                 "config as one JSON --speculative-config")
        if flag in _SPECULATIVE_CONFIG:
            if not eq and i + 1 >= len(args):
                raise FlashnextError(f"profile {profile.name}: {flag} has no value")
            text = value if eq else args[i + 1]
    if text is None:
        return None
    try:
        config = json.loads(text)
    except ValueError as e:
        raise FlashnextError(f"profile {profile.name}: --speculative-config is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise FlashnextError(f"profile {profile.name}: --speculative-config is not a JSON object")
    method = config.get("method")
    return method if isinstance(method, str) else None
