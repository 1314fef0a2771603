"""One deployment: what ``serve``, ``doctor``, ``plan`` and ``selftest`` are about, resolved once.

A :class:`Deployment` is a validated profile and the model it serves (a base snapshot, the overlays
applied over it in order, the PLE table file), with where ``serve`` publishes it. What the
commands need of the model is read from it once, the first time it is asked for, and kept: the
base's ``config.json`` (the plan's text and vision configs), the served model (the base snapshot
with the overlays' config.json and index merged in memory, by the rule ``overlay apply`` writes a
view with), and the serving shape and plan derived from them. A read that fails is kept too: the
same error is raised each time it is asked for, and nothing is read again. ``serve``, the
preflight, the compose file, the native command line and the selftest all take the same
Deployment, so no stage reads the model or loads the profile again.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from flashnext.errors import FlashnextError
from flashnext.serving.profiles import Profile


class once:
    """A property computed on first use and kept, as ``functools.cached_property``, whose
    :class:`FlashnextError` is kept as well: asked again, it raises the same error without
    computing (reading) again."""

    def __init__(self, compute):
        self.compute = compute
        self.__doc__ = compute.__doc__

    def __set_name__(self, owner, name: str) -> None:
        self.key = f"_once_{name}"

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        kept = instance.__dict__  # a frozen dataclass's own attributes stay frozen: this is beside them
        if self.key not in kept:
            try:
                kept[self.key] = (True, self.compute(instance))
            except FlashnextError as error:
                kept[self.key] = (False, error)
        ok, value = kept[self.key]
        if not ok:
            raise value
        return value


@dataclass(frozen=True)
class Deployment:
    """A profile serving a model: what the commands resolve once and every stage takes. Its model
    facts are read on first use and kept (:class:`once`), so that building one reads nothing and a
    stage that does not need them (``--dry-run`` plans nothing) does not pay for them."""

    profile: Profile
    model: Path | None = None  # the base snapshot; None: the pinned base checkpoint, as planned
    overlays: tuple[Path, ...] = field(default_factory=tuple)
    ple_table: Path | None = None
    bind: str = "127.0.0.1"
    port: int | None = None
    # `flashnext plan`'s overrides of the profile's vLLM arguments (None: the profile's own)
    kv_cache_memory_bytes: int | None = None
    prefix_caching: bool | None = None

    @property
    def host_port(self) -> int:
        return self.port or self.profile.container.port

    @once
    def model_config(self):
        """The base's config.json (a :class:`~flashnext.serving.capacity.model.ModelConfig`; the
        pinned manifest without a model), read here once for every planner."""
        from flashnext.serving.capacity.model import read_model_config

        return read_model_config(self.model)

    @once
    def snapshot(self):
        """The base snapshot (:class:`~flashnext.quant.checkpoint.snapshot.Snapshot`), opened once,
        with the config.json :attr:`model_config` read; for the checks that read its index and shards."""
        from flashnext.quant.checkpoint.snapshot import CONFIG_FILE, Snapshot

        if self.model is None:
            raise FlashnextError("is not given: the pinned base checkpoint has no snapshot here", field="model")
        if not (Path(self.model) / CONFIG_FILE).is_file():
            return Snapshot.open(self.model)  # refused as Snapshot.open refuses it
        read = self.model_config
        return Snapshot.open(self.model, config=(read.config, read.version))

    def open_snapshot(self, root: Path):
        """The snapshot at ``root``: :attr:`served_model` where ``root`` is this deployment's model (a
        planner handed a config.json opens the folder beside it), else opened as any other."""
        from flashnext.quant.checkpoint.snapshot import Snapshot

        if self.model is not None and Path(root) == Path(self.model):
            return self.served_model
        return Snapshot.open(root)

    @once
    def overlay_stack(self):
        """The overlays over the base (:class:`~flashnext.quant.overlays.view.OverlayStack`): the
        library's stacking rule, reading each overlay's manifest, config.json and index once, and
        the base through :attr:`snapshot`."""
        from flashnext.quant.overlays.view import OverlayStack

        return OverlayStack(self.model, self.overlays, open_base=lambda: self.snapshot)

    @once
    def served_config(self) -> dict | None:
        """The config.json vLLM loads: the view's (a single overlay's own, else the base's with every
        overlay's changes merged), the base's without overlays; None without a model, or where there
        is none to read (the commands that need one say so themselves)."""
        from flashnext.quant.checkpoint.snapshot import CONFIG_FILE

        if self.model is None:
            return None
        overlays = [Path(o) for o in self.overlays]
        if not all(o.is_dir() for o in overlays) or not any((where / CONFIG_FILE).is_file()
                                                             for where in (*overlays, Path(self.model))):
            return None  # nothing here to read: a missing input is refused by the command, in its words
        return self.overlay_stack.config if overlays else self.model_config.config

    @once
    def served_model(self):
        """The model vLLM serves, held in memory (a :class:`~flashnext.quant.checkpoint.snapshot.Snapshot`):
        the base snapshot opened once with the overlays' config.json and index merged, each tensor
        read from the overlay file that serves it, else the base's (:attr:`snapshot` without
        overlays); None without a model (the pinned base checkpoint, as planned)."""
        if self.model is None:
            return None
        return self.overlay_stack.served if self.overlays else self.snapshot

    @property
    def ple_format(self) -> str | None:
        """The served config's ``ple_embedding_dtype``: ``"nvfp4"``, ``"float8_e4m3fn"``, or None for
        the BF16 table (or where there is no config.json to read)."""
        from flashnext.quant.checkpoint.snapshot import text_config_of

        config = self.served_config
        return None if config is None else text_config_of(config).get("ple_embedding_dtype")

    @once
    def shape(self):
        """The profile's serving shape (:class:`~flashnext.serving.capacity.ServingShape`)."""
        from flashnext.serving.capacity import ServingShape

        return ServingShape.from_profile(self.profile, self.kv_cache_memory_bytes, self.prefix_caching)

    @once
    def plan(self):
        """The profile's plan for the model (:class:`~flashnext.serving.capacity.Plan`), computed once;
        a :class:`FlashnextError` where it cannot be planned here."""
        from flashnext.serving import capacity

        # a family's planner reads the pinned base itself where there is no model (FAMILIES' contract)
        return capacity.plan_profile(self.profile, self.kv_cache_memory_bytes, self.prefix_caching,
                                     model=self.model_config if self.model is not None else None)


def resolve_deployment(profile: str, model: Path | None = None, overlays: Collection[Path] = (),
                       ple_table: Path | None = None, *, grants: Collection[str] = (), bind: str = "127.0.0.1",
                       port: int | None = None, kv_cache_memory_bytes: int | None = None,
                       prefix_caching: bool | None = None) -> Deployment:
    """The deployment of ``--profile`` (a name or a profile file, loaded and checked once with
    ``grants``) serving ``model`` with ``overlays`` and ``ple_table``: what every later stage takes."""
    from flashnext.serving.profiles import load_profile

    return Deployment(load_profile(profile, grants=grants), model, tuple(overlays), ple_table, bind, port,
                      kv_cache_memory_bytes, prefix_caching)
