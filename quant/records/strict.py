"""The base of flashnext's own JSON records (the overlay manifest, the view record, the PLE sidecar):
pydantic models with strict types that refuse unknown keys. Kept apart from ``jsonfile`` so that
reading a safetensors header or a snapshot does not import pydantic."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[int, Field(ge=0)]


class StrictRecord(BaseModel):
    """A JSON record of flashnext's own format: strict types, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
