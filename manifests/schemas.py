"""The one table of the JSON schemas flashnext ships: each is generated from the record it describes.

``python -m flashnext.manifests.schemas`` rewrites every file from its record after a change to one;
``tests/test_schemas.py`` fails until that is done. The records are named as ``module:Class`` and
imported only when a schema is generated, so reading this table imports neither pydantic nor the
serving side.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

# file under manifests/ -> (the record, the schema's title)
SCHEMAS: dict[str, tuple[str, str]] = {
    "overlay.schema.json": ("flashnext.quant.overlays.manifest:OverlayManifest",
                            "flashnext overlay manifest (overlay.json), schema version 1"),
    "bench-report.schema.json": ("flashnext.serving.bench.report:BenchReport", "flashnext bench report"),
    "selftest-report.schema.json": ("flashnext.serving.selftest.report:SelftestReport", "flashnext selftest report"),
    "profile.schema.json": ("flashnext.serving.profiles:Profile",
                            "flashnext serving profile (serving/profiles/NAME.json)"),
}


def record_of(name: str) -> type:
    module, _, cls = SCHEMAS[name][0].partition(":")
    return getattr(importlib.import_module(module), cls)


def generated(name: str) -> dict:
    """The schema ``manifests/name`` must hold, from its record."""
    from flashnext.quant.records.strict import record_schema

    return record_schema(record_of(name), SCHEMAS[name][1])


def text(name: str) -> str:
    return json.dumps(generated(name), indent=1, ensure_ascii=False) + "\n"


def main() -> None:
    folder = Path(__file__).resolve().parent
    for name in SCHEMAS:
        path = folder / name
        wanted = text(name)
        if not path.exists() or path.read_text() != wanted:
            path.write_text(wanted)
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
