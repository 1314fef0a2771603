"""One deployment: what ``serve``, ``doctor`` and the compose file are about, resolved once.

A :class:`Deployment` is a validated profile and the model it serves (a base snapshot, the overlays
applied over it in order, the PLE table file), with where ``serve`` publishes it. What the
commands need of the model is read from it once, the first time it is asked for, and kept: the
base's ``config.json`` (the plan's text and vision configs), the served config (the view's: its
last overlay's that has one), and the serving shape and plan derived from them. ``serve``, the
preflight, the compose file and the native command line all take the same Deployment, so no stage
reads the model or loads the profile again.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from flashnext.errors import FlashnextError
from flashnext.serving.profiles import Profile


@dataclass(frozen=True)
class Deployment:
    """A profile serving a model: what the commands resolve once and every stage takes. Its model
    facts are read on first use and kept (``cached_property``), so that building one reads nothing
    and a stage that does not need them (``--dry-run`` plans nothing) does not pay for them."""

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

    @cached_property
    def model_config(self):
        """The base's config.json (a :class:`~flashnext.serving.capacity.model.ModelConfig`; the
        pinned manifest without a model), read here once for every planner."""
        from flashnext.serving.capacity.model import read_model_config

        return read_model_config(self.model)

    @cached_property
    def snapshot(self):
        """The base snapshot (:class:`~flashnext.quant.checkpoint.snapshot.Snapshot`), opened once,
        with the config.json :attr:`model_config` read; for the checks that read its index and shards."""
        from flashnext.quant.checkpoint.snapshot import CONFIG_FILE, Snapshot

        if self.model is None:
            raise FlashnextError("no --model: the pinned base checkpoint has no snapshot here")
        if not (Path(self.model) / CONFIG_FILE).is_file():
            return Snapshot.open(self.model)  # refused as Snapshot.open refuses it
        read = self.model_config
        return Snapshot.open(self.model, config=(read.config, read.version))

    def open_snapshot(self, root: Path):
        """The snapshot at ``root``: :attr:`snapshot` where ``root`` is this deployment's model (a
        planner handed a config.json opens the folder beside it), else opened as any other."""
        from flashnext.quant.checkpoint.snapshot import Snapshot

        if self.model is not None and Path(root) == Path(self.model):
            return self.snapshot
        return Snapshot.open(root)

    @cached_property
    def served_config(self) -> dict | None:
        """The config.json vLLM loads: the last overlay's that has one (a view's is its last
        overlay's), else the base's; None where none is there to read (the commands that need one
        say so themselves)."""
        from flashnext.quant.checkpoint.snapshot import CONFIG_FILE, read_config

        if self.model is None:
            return None
        for overlay in reversed(self.overlays):
            if (Path(overlay) / CONFIG_FILE).is_file():
                return read_config(Path(overlay) / CONFIG_FILE)
        if not (Path(self.model) / CONFIG_FILE).is_file():
            return None
        return self.model_config.config

    @property
    def ple_format(self) -> str | None:
        """The served config's ``ple_embedding_dtype``: ``"nvfp4"``, ``"float8_e4m3fn"``, or None for
        the BF16 table (or where there is no config.json to read)."""
        from flashnext.quant.checkpoint.snapshot import text_config_of

        config = self.served_config
        return None if config is None else text_config_of(config).get("ple_embedding_dtype")

    @cached_property
    def shape(self):
        """The profile's serving shape (:class:`~flashnext.serving.capacity.ServingShape`)."""
        from flashnext.serving.capacity import ServingShape

        return ServingShape.from_profile(self.profile, self.kv_cache_memory_bytes, self.prefix_caching)

    @cached_property
    def _plan_or_error(self):
        from flashnext.serving import capacity

        try:
            # a family's planner reads the pinned base itself where there is no model (FAMILIES' contract)
            return capacity.plan_profile(self.profile, self.kv_cache_memory_bytes, self.prefix_caching,
                                         model=self.model_config if self.model is not None else None)
        except FlashnextError as e:  # kept: a deployment that cannot be planned says why each time it is asked
            return e

    @property
    def plan(self):
        """The profile's plan for the model (:class:`~flashnext.serving.capacity.Plan`), computed once;
        a :class:`FlashnextError` where it cannot be planned here."""
        result = self._plan_or_error
        if isinstance(result, FlashnextError):
            raise result
        return result


def resolve_deployment(profile: str, model: Path | None = None, overlays: Collection[Path] = (),
                       ple_table: Path | None = None, *, grants: Collection[str] = (), bind: str = "127.0.0.1",
                       port: int | None = None, kv_cache_memory_bytes: int | None = None,
                       prefix_caching: bool | None = None) -> Deployment:
    """The deployment of ``--profile`` (a name or a profile file, loaded and checked once with
    ``grants``) serving ``model`` with ``overlays`` and ``ple_table``: what every later stage takes."""
    from flashnext.serving.profiles import load_profile

    return Deployment(load_profile(profile, grants=grants), model, tuple(overlays), ple_table, bind, port,
                      kv_cache_memory_bytes, prefix_caching)
