"""The base of flashnext's own JSON records (the overlay manifest, the view record, the PLE sidecar,
serving profiles, bench and selftest reports): pydantic models that refuse unknown keys and every
float JSON cannot hold, read through ``jsonfile.read_model``, and whose shipped JSON schemas are
generated from them (:func:`record_schema`), so that a record's shape has one home. Kept apart from
``jsonfile`` so that reading a safetensors header or a snapshot does not import pydantic."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[int, Field(ge=0)]
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


class StrictRecord(BaseModel):
    """A JSON record of flashnext's own format: strict types, unknown keys refused, floats finite."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @classmethod
    def not_this_record(cls, data: Any) -> str | None:
        """Why ``data`` is no such record at all (another format, an older schema version), said
        before any key-by-key complaint; None when it may be one."""
        return None


def strict_dataclass(cls: type) -> type:
    """``cls`` as a frozen dataclass that validates as a :class:`StrictRecord` does (the same
    config, read through the same ``read_model``): for records whose callers copy them with
    ``dataclasses.replace`` (serving profiles, which tests and plans vary field by field)."""
    from pydantic.dataclasses import dataclass

    return dataclass(frozen=True, config=StrictRecord.model_config)(cls)


class BuilderInfo(StrictRecord):
    """Which flashnext command wrote a record, and flashnext's version."""

    name: str = Field(description="The command that built it, e.g. make-mtp-int4.")
    version: str = Field(description="flashnext's version.")


class PartialIdentity(StrictRecord):
    """The partial file or directory an interrupted build created: device and inode, so that a
    resumed build writes only into the very one it made."""

    dev: int
    inode: int


def record_schema(model: type, title: str) -> dict:
    """The JSON schema shipped for ``model`` (a record or a :func:`strict_dataclass`) under
    ``manifests/``: pydantic's, with its dialect and a title."""
    from pydantic import TypeAdapter

    schema = model.model_json_schema() if issubclass(model, BaseModel) else TypeAdapter(model).json_schema()
    schema["$schema"] = JSON_SCHEMA_DIALECT
    schema["title"] = title
    return schema
