"""Serving profiles: the data in ``serving/profiles/*.json``, read as strict records.

A profile validates as every JSON record of flashnext's own does (``StrictRecord``'s config, read
through the same ``read_model``: one reader, one style of error line, and a schema generated from
it, ``manifests/profile.schema.json``). It is a :func:`strict_dataclass` rather than a model
because plans and tests vary a profile field by field with ``dataclasses.replace``, which validates
the copy too. Adding a profile is adding a file; its keys are exactly :class:`Profile`'s.

A profile file is code the user runs: it says what the container is granted and how vLLM starts.
:func:`load_profile` is the one boundary every command reads one through (serve, the Compose file,
plan, doctor, selftest, the rig planner's template), and what it returns has passed every rule
below; the rules that need no context (ranges, names, the vllm_args flashnext keeps for itself) are
the record's own, so that a copy made with ``dataclasses.replace`` passes them too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Collection
from dataclasses import field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field
from pydantic.json_schema import SkipJsonSchema

from flashnext.errors import FlashnextError, named
from flashnext.quant.records.jsonfile import read_model
from flashnext.quant.records.strict import strict_dataclass

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"

# The whole file is read before it is parsed. A shipped profile, or one `plan --write-profile`
# wrote, is about 3 KiB; 64 KiB leaves room for twenty times its arguments, and a larger file
# (300 MB kept `serve --dry-run` busy for over a minute) is refused before a byte of it is read.
MAX_PROFILE_BYTES = 64 << 10
MAX_GPUS = 64  # 8 nodes of 8: more than any rig flashnext plans for (its rigs split 48 layers)
MAX_PORT = 65535
# Docker's waits (healthcheck interval and timeout, the grace before SIGKILL): an hour is already
# longer than any of them should be. The start period is also how long serve waits for readiness:
# the 8xH200 profiles take up to an hour to load, a day bounds it.
MAX_WAIT_S = 3600
MAX_START_PERIOD_S = 24 * 3600
MAX_RETRIES = 100
MAX_SHM_BYTES = 64 << 40  # /dev/shm is a tmpfs in host RAM: more than any host has
# A GPU's memory in GiB, as nvidia-smi reports it (24 for an RTX 3090): `plan` reads each rank's
# VRAM against it. At least 1 GiB (what the driver keeps, 0.44 GiB on a 3090, must leave room), and
# at most 1 TiB, several times the largest card made.
MIN_GPU_MEMORY_GIB = 1
MAX_GPU_MEMORY_GIB = 1024
# Docker's size grammar, in its lowercase whole-number form: 16gb, 16g, 512m, 1048576.
SHM_SIZE = re.compile(r"([1-9][0-9]{0,15})([kmgt]?)b?")
_SHM_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A capability as Docker's cap_add names it, without the CAP_ prefix (SYS_PTRACE), or ALL.
CAPABILITY = re.compile(r"(?!CAP_)[A-Z][A-Z0-9_]*")
# What a profile's container gets without `serve --grant`: the seed's own needs. SYS_PTRACE lets
# the PLE prefetcher call process_madvise (the 3x3090 and 4x3090 profiles). Memlock unlimited (the
# only ulimit) and host IPC are the record's own keys; its devices are its `gpus` NVIDIA GPUs and
# its mounts flashnext's own, read-only: a profile has no key that asks for another.
CAPABILITIES_WITHOUT_GRANT = frozenset({"SYS_PTRACE"})
# Host IPC for vLLM's workers and NCCL (the seed's), or the container's own. Never another
# container's or service's namespace, and never one shared out to others: no grant opens those.
IPC_MODES = ("host", "private")
# Where vLLM listens and what it serves are flashnext's: vllm_command puts serve's --listen and
# --port, and the model (or its view with the overlays), after the profile's arguments.
FLASHNEXT_OPTIONS = ("--host", "--port", "--uds", "--model")
# Inside the serving container (serving/compose.py): the port vLLM listens on and the snapshot's
# mount. Here because load_profile checks the very command line the container runs.
CONTAINER_PORT = 8000
MODEL_DIR = "/models/snapshot"
# A file of further arguments, which could set those out of sight, and which vLLM's parser would
# open on this host while the profile is checked.
ARGUMENTS_FILE_OPTIONS = ("--config",)
# A profile's name is its file's name without ``.json``; it also names serve's state folder and the
# Compose project, so it is one plain path component.
PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
PROFILE_NAME_RULE = "letters, digits, '.', '_' and '-', beginning with a letter or a digit"


def shm_size_bytes(text: str) -> int:
    """``shm_size`` in bytes; a :class:`ValueError` for what is not a size of :data:`SHM_SIZE`'s grammar."""
    match = SHM_SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size (a whole number, then k, m, g or t, then an optional b: "
                         "16gb, 512m)")
    return int(match[1]) * _SHM_UNITS[match[2]]


def _shm_size(text: str) -> str:
    if shm_size_bytes(text) > MAX_SHM_BYTES:
        raise ValueError(f"{text} is more than {MAX_SHM_BYTES >> 40} TiB")
    return text


def _breaks_a_line(text: str) -> bool:
    return any(ch in text for ch in "\0\n\r")


def _environment(env: dict[str, str]) -> dict[str, str]:
    for key, value in env.items():
        if not ENV_NAME.fullmatch(key):
            raise ValueError(f"{key!r} is not an environment variable name (letters, digits and '_', "
                             "not beginning with a digit)")
        if _breaks_a_line(value):
            raise ValueError(f"{key}'s value holds a NUL or a line break")
    return env


def _capabilities(cap_add: dict[str, str]) -> dict[str, str]:
    for cap in cap_add:
        if not CAPABILITY.fullmatch(cap):
            raise ValueError(f"{cap!r} is not a capability as Docker names it (upper case, without CAP_: SYS_PTRACE)")
    return cap_add


def _own_option(arg: str) -> str | None:
    """The option of :data:`FLASHNEXT_OPTIONS` or :data:`ARGUMENTS_FILE_OPTIONS` that vLLM's parser
    would read ``arg`` as, if any. Its parser turns ``_`` into ``-`` and ``--opt.key v`` into
    ``--opt '{"key": "v"}'``, and argparse takes a prefix of an option for the option."""
    if not arg.startswith("--") or arg == "--":
        return None
    spelled = arg.partition("=")[0].partition(".")[0].replace("_", "-")
    return next((own for own in (*FLASHNEXT_OPTIONS, *ARGUMENTS_FILE_OPTIONS) if own.startswith(spelled)), None)


def _vllm_args(args: list[str]) -> list[str]:
    for arg in args:
        if _breaks_a_line(arg):
            raise ValueError(f"{arg!r} holds a NUL or a line break")
        if arg == "--":
            raise ValueError("'--' ends vLLM's options, so flashnext's own --host and --port after the "
                             "profile's arguments would not be read as options")
        own = _own_option(arg)
        if own is None:
            continue
        spelled = arg.partition("=")[0]
        named = own if spelled == own else f"{spelled} may be read as {own}, which"
        if own in ARGUMENTS_FILE_OPTIONS:
            raise ValueError(f"{named} names a file of further arguments, which could set flashnext's own "
                             f"({', '.join(FLASHNEXT_OPTIONS)}) out of sight: put its arguments in vllm_args")
        raise ValueError(f"{named} is set by flashnext: serve puts where vLLM listens and the model it serves "
                         "(vLLM's --host and --port, and its model) after the profile's arguments")
    return args


def _profile_name(name: str) -> str:
    if not PROFILE_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a profile name ({PROFILE_NAME_RULE})")
    return name


def _anchored(pattern: re.Pattern) -> str:
    """``pattern`` as the shipped JSON schema states it (the validators above say it in words)."""
    return f"^{pattern.pattern}$"


GpuCount = Annotated[int, Field(ge=1, le=MAX_GPUS)]
Port = Annotated[int, Field(ge=1, le=MAX_PORT)]
WaitSeconds = Annotated[int, Field(ge=1, le=MAX_WAIT_S)]
StartPeriodSeconds = Annotated[int, Field(ge=1, le=MAX_START_PERIOD_S)]
Retries = Annotated[int, Field(ge=1, le=MAX_RETRIES)]
GpuMemoryGiB = Annotated[float, Field(ge=MIN_GPU_MEMORY_GIB, le=MAX_GPU_MEMORY_GIB)]


@strict_dataclass
class ContainerSettings:
    shm_size: Annotated[str, AfterValidator(_shm_size), Field(json_schema_extra={"pattern": _anchored(SHM_SIZE)})]
    ipc: Literal[IPC_MODES]
    memlock_unlimited: bool
    cap_add: Annotated[dict[str, str], AfterValidator(_capabilities),  # capability -> why the profile needs it
                       Field(json_schema_extra={"propertyNames": {"pattern": _anchored(CAPABILITY)}})]
    stop_grace_period_s: WaitSeconds
    port: Port


@strict_dataclass
class Healthcheck:
    interval_s: WaitSeconds
    timeout_s: WaitSeconds
    retries: Retries
    start_period_s: StartPeriodSeconds


@strict_dataclass
class Profile:
    name: Annotated[str, AfterValidator(_profile_name), Field(json_schema_extra={"pattern": _anchored(PROFILE_NAME)})]
    description: str
    model_family: str
    gpus: GpuCount
    vllm_args: Annotated[list[str], AfterValidator(_vllm_args)]
    env: Annotated[dict[str, str], AfterValidator(_environment),
                   Field(json_schema_extra={"propertyNames": {"pattern": _anchored(ENV_NAME)}})]
    container: ContainerSettings
    uses_ple_table: bool
    healthcheck: Healthcheck
    # Each GPU's memory in GiB, where the profile is for one kind of card: `plan` shows each rank's
    # VRAM against it (`plan --gpu-memory` overrides it). Optional: a profile without it is planned
    # without the card's columns.
    gpu_memory_gib: GpuMemoryGiB | None = None
    # Where it was read from, set by load_profile: not a key of the file.
    path: SkipJsonSchema[Path] = field(default=PROFILE_DIR, compare=False)

    @classmethod
    def not_this_record(cls, data: object) -> str | None:
        if isinstance(data, dict) and "path" in data:
            return "unknown keys ['path']"
        return None


def available() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def is_profile_file(arg: str) -> bool:
    """Whether ``--profile ARG`` names a profile file (``flashnext plan --write-profile``'s, say)
    rather than a shipped profile: a path with a folder in it, or a ``.json`` name."""
    return "/" in arg or arg.endswith(".json")


def capability(text: str) -> str:
    """``serve --grant``'s argument as a profile's cap_add names it: ``SYS_ADMIN`` for
    ``sys_admin`` or ``CAP_SYS_ADMIN``."""
    name = text.upper().removeprefix("CAP_")
    if not CAPABILITY.fullmatch(name):
        raise FlashnextError(f"{text!r} is not a capability (SYS_ADMIN, CAP_NET_ADMIN, ALL)")
    return name


def capabilities_to_grant(profile: Profile) -> list[str]:
    """The capabilities ``profile`` asks for beyond :data:`CAPABILITIES_WITHOUT_GRANT`: each needs
    ``serve --grant``."""
    return sorted(set(profile.container.cap_add) - CAPABILITIES_WITHOUT_GRANT)


def load_profile(name: str, directory: Path = PROFILE_DIR, grants: Collection[str] = ()) -> Profile:
    """Load ``serving/profiles/NAME.json``, or the profile file ``name`` names (:func:`is_profile_file`):
    at most :data:`MAX_PROFILE_BYTES`, strict JSON, a regular file, every key known, of its type and
    in its range, its ``name`` its file's name; no capability beyond
    :data:`CAPABILITIES_WITHOUT_GRANT` unless ``grants`` (serve's ``--grant``) names it; and, for a
    profile that is not flashnext's own, where vLLM's supported release is installed, ``vllm_args``
    read by vLLM's own parser in the command line flashnext runs. Anything else is one line naming
    the file and the key."""
    profile = _read_profile(name, directory)
    ungranted = [cap for cap in capabilities_to_grant(profile) if cap not in grants]
    if ungranted:
        granting = " ".join(f"{named('grant')} {cap}" for cap in ungranted)
        raise FlashnextError(
            f"{profile.path}: container.cap_add asks for {', '.join(ungranted)}, which a profile gets only when "
            f"serve is told to grant it ({granting}); unasked it gets "
            f"{', '.join(sorted(CAPABILITIES_WITHOUT_GRANT))}")
    if not shipped(profile):
        _parse_with_vllm(profile)
    return profile


def shipped(profile: Profile) -> bool:
    """Whether ``profile`` is one flashnext ships. Their vllm_args are read by the supported vLLM's
    parser in the test suite (tests/serving/test_profiles.py), not at every load: building that
    parser imports vLLM, seconds that `serve --dry-run` and `doctor` would otherwise pay each run."""
    return profile.path.resolve().parent == PROFILE_DIR


def _read_profile(name: str, directory: Path = PROFILE_DIR) -> Profile:
    """The profile ``name`` as its file holds it, every rule of the record checked."""
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
    profile = read_model(path, Profile, "a serving profile", max_bytes=MAX_PROFILE_BYTES)
    if profile.name != stem:
        raise FlashnextError(f"{path}: name {profile.name!r} does not match the file name")
    return dataclasses.replace(profile, path=path)


def _parse_with_vllm(profile: Profile) -> None:
    """Refuse what vLLM's own parser refuses in the command line flashnext runs for ``profile``
    (its arguments, then flashnext's own). A base install (Docker's host side) has no vLLM, and
    another release's parser would judge options of another release: the record's rules stand alone
    there, and the container, whose image has the release, reads the profile again."""
    from flashnext.serving import vllm_release

    if not vllm_release.supported(vllm_release.installed_version()):
        return
    from flashnext.serving.capacity.shape import parse_serve_command

    parse_serve_command(vllm_command(profile, MODEL_DIR, "0.0.0.0", CONTAINER_PORT)[2:], f"{profile.path}: vllm_args")


def vllm_command(profile: Profile, model: str, listen: str, port: int) -> list[str]:
    """``vllm serve MODEL`` with the profile's arguments: what serve runs, natively or in the
    container (serving/compose.py), and what :func:`load_profile` has vLLM's parser check."""
    return ["vllm", "serve", model, *profile.vllm_args, "--host", listen, "--port", str(port)]


def profile_name(arg: str) -> str:
    """The name ``--profile ARG`` runs under (serve's state folder): the shipped name, or the name
    inside the profile file ARG. Stopping a started profile, or reading its logs, runs nothing the
    file says: it is read as a record for its name, asking for no grant and running no vLLM parser."""
    if is_profile_file(arg):
        return _read_profile(arg).name
    return require_profile_name(arg)


def require_profile_name(name: str) -> str:
    """``name``, refused in one line unless it is a profile name: it becomes a path component."""
    if not PROFILE_NAME.fullmatch(name):
        raise FlashnextError(f"{name!r} is not a profile name ({PROFILE_NAME_RULE})")
    return name


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
    memory = data.pop("gpu_memory_gib")
    if memory is not None:  # left out where unset; a whole number of GiB as one (24, not 24.0)
        data["gpu_memory_gib"] = int(memory) if float(memory).is_integer() else memory
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
