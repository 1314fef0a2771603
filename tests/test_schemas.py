"""Every JSON schema flashnext ships is generated from the record it describes, and is equal to it
(``flashnext.manifests.schemas.SCHEMAS``, the one table of them; ``python -m flashnext.manifests.schemas``
regenerates).
"""

import json
from pathlib import Path

import jsonschema
import pytest

ROOT = Path(__file__).resolve().parents[1]


def schemas() -> dict:
    from flashnext.manifests.schemas import SCHEMAS

    return SCHEMAS


def generated(name: str) -> dict:
    from flashnext.manifests.schemas import generated as from_record

    return from_record(name)


NAMES = ["overlay.schema.json", "bench-report.schema.json", "selftest-report.schema.json", "profile.schema.json"]


def test_the_table_names_every_generated_schema():
    assert sorted(schemas()) == sorted(NAMES)
    # compose-spec.schema.json is the Compose project's, not a record of flashnext's.
    shipped = {p.name for p in (ROOT / "manifests").glob("*.schema.json")} - {"compose-spec.schema.json"}
    assert shipped == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_the_shipped_schema_is_its_records_own(name):
    shipped = json.loads((ROOT / "manifests" / name).read_text())
    assert shipped == generated(name), f"regenerate manifests/{name}: python -m flashnext.manifests.schemas"


def test_the_schemas_agree_with_their_models_on_real_files(demo_overlay):
    """A generated schema says yes to what its model reads: the demo overlay's manifest and every
    shipped profile."""
    from flashnext.quant.overlays.manifest import OverlayManifest
    from flashnext.serving.profiles import available, load_profile

    jsonschema.validate(json.loads((demo_overlay / "overlay.json").read_text()), generated("overlay.schema.json"))
    assert OverlayManifest.load(demo_overlay).kind
    for name in available():
        path = ROOT / "serving" / "profiles" / f"{name}.json"
        jsonschema.validate(json.loads(path.read_text()), generated("profile.schema.json"))
        assert load_profile(name).name == name


def test_the_profile_schema_refuses_what_the_loader_refuses(tmp_path):
    from flashnext.errors import FlashnextError
    from flashnext.serving.profiles import load_profile

    data = json.loads((ROOT / "serving" / "profiles" / "3x3090.json").read_text())
    for bad in ({**data, "max_tokens": 5}, {**data, "gpus": "3"}, {**data, "env": {"X": 1}},
                {k: v for k, v in data.items() if k != "healthcheck"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, generated("profile.schema.json"))
        (tmp_path / "3x3090.json").write_text(json.dumps(bad))
        with pytest.raises(FlashnextError):
            load_profile("3x3090", tmp_path)
