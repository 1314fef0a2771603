"""Reading the JSON files flashnext trusts nothing in: one line naming the file and the key.

Every JSON document flashnext reads (a snapshot's index and config, an overlay manifest, a view
record, a PLE table sidecar, a profile) comes through :func:`read_json`, and the ones with a fixed
shape are validated into typed objects by :func:`read_model` (pydantic models, strict types; see
``strict.py``), so a
wrong type or a missing key is a :class:`FlashnextError` such as
``overlay.json: replaces.0.size: Input should be a valid integer`` rather than a traceback later.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, TypeVar

from flashnext.errors import FlashnextError
from flashnext.quant.records.inputs import FileIdentity, read_regular_version

M = TypeVar("M")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        # Python reads 1e400 as inf, which json.dumps would write back as Infinity, no JSON at all.
        raise ValueError(f"number {text} is out of range (read as {value})")
    return value


# Deeper than any document flashnext reads (a config is about 6 levels); what nests deeper would
# cost the copies, merges and validators after the parse a RecursionError.
MAX_DEPTH = 64
# A JSON string (escapes included), and whatever is no bracket once strings are gone.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _deepest(text: str) -> int:
    """How deep the brackets of ``text`` nest outside its strings, counted without recursion: the
    json module's parser recurses once a level, and a document 10^5 deep took it to the interpreter's
    limit, where a finalizer that ran in between (any unraisable error) failed again and printed a
    page of traceback beside the one line."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if len(brackets) <= MAX_DEPTH:
        return len(brackets)
    import numpy as np

    codes = np.frombuffer(brackets.encode("ascii"), dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def parse_json(text: str | bytes, where: str) -> Any:
    """Strict JSON: no duplicate keys, no NaN/Infinity and no number that only reads as one, nested
    at most :data:`MAX_DEPTH` deep (refused before the parse, which recurses once a level)."""
    try:
        if isinstance(text, (bytes, bytearray)):
            text = text.decode(json.detect_encoding(text), "surrogatepass")
        too_deep = _deepest(text) > MAX_DEPTH
        if not too_deep:
            data = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant,
                              parse_float=_finite)
    except ValueError as e:  # UnicodeDecodeError included
        raise FlashnextError(f"{where}: not valid JSON ({str(e).splitlines()[0]})") from None
    if too_deep:
        raise FlashnextError(f"{where}: JSON nested more than {MAX_DEPTH} levels deep; no file flashnext "
                             "reads is")
    return data


def read_json(path: Path, what: str, expect: type = dict, max_bytes: int | None = None) -> Any:
    """The JSON document at ``path`` (``what`` it is, for the message), of type ``expect``, in a
    file of at most ``max_bytes``."""
    return read_json_version(path, what, expect, max_bytes)[0]


def read_json_version(path: Path, what: str, expect: type = dict,
                      max_bytes: int | None = None) -> tuple[Any, FileIdentity]:
    """:func:`read_json`, and the version of the file it was read from (for
    :func:`~flashnext.quant.records.inputs.check_unchanged` before an output made from it commits)."""
    path = Path(path)
    try:
        text, version = read_regular_version(path, what, max_bytes=max_bytes)
    except FileNotFoundError:
        raise FlashnextError(f"{path}: missing ({what})") from None
    except IsADirectoryError:
        raise FlashnextError(f"{path}: is a directory, expected {what}") from None
    data = parse_json(text, str(path))
    if not isinstance(data, expect):
        raise FlashnextError(f"{path}: {what} must be a JSON {_json_type(expect)}, "
                             f"got {_json_type(type(data))}")
    return data, version


def _json_type(t: type) -> str:
    return {dict: "object", list: "array", str: "string", int: "integer", float: "number",
            bool: "boolean", type(None): "null"}.get(t, t.__name__)


# pydantic's type errors in flashnext's words (what the value must be, and what it is); any other
# error (a range, a pattern, a validator's own sentence) keeps pydantic's message after its key.
_MUST_BE = {"int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
            "string_type": "a string", "bool_type": "a boolean", "bool_parsing": "a boolean",
            "float_type": "a number", "float_parsing": "a number", "list_type": "a list",
            "dict_type": "a JSON object", "model_type": "a JSON object", "model_attributes_type": "a JSON object",
            "dataclass_type": "a JSON object", "dataclass_exact_type": "a JSON object"}
# An unknown key: of a model (extra_forbidden), of a dataclass (unexpected_keyword_argument).
_UNKNOWN = ("extra_forbidden", "unexpected_keyword_argument")
_PLURAL = {"an integer": "integers", "a string": "strings", "a boolean": "booleans", "a number": "numbers",
           "a list": "lists", "a JSON object": "JSON objects"}
# A range's bound, in get_int's words: pydantic's error kind -> (the words, the bound's key in its ctx).
_BOUND = {"greater_than_equal": ("at least", "ge"), "less_than_equal": ("at most", "le"),
          "greater_than": ("more than", "gt"), "less_than": ("less than", "lt")}


def _key(loc) -> str:
    # pydantic puts validator names ("function-after[...]") in the location; they are no key.
    return ".".join(str(p) for p in loc if "[" not in str(p))


def _unwrapped(hint):
    from typing import Annotated, Union, get_args, get_origin
    import types

    while True:
        if get_origin(hint) is Annotated:
            hint = get_args(hint)[0]
        elif get_origin(hint) in (Union, types.UnionType):
            arms = [a for a in get_args(hint) if a is not type(None)]
            if len(arms) != 1:
                return hint
            hint = arms[0]
        else:
            return hint


def _container_at(model, loc) -> str | None:
    """"list" or "object" when ``loc`` in ``model`` is a list or a ``dict`` field, else None."""
    from typing import get_args, get_origin

    hint = model
    for part in loc:
        hint = _unwrapped(hint)
        fields = getattr(hint, "model_fields", None) or getattr(hint, "__pydantic_fields__", None)
        if isinstance(fields, dict) and isinstance(part, str):
            if part not in fields:
                return None
            hint = fields[part].annotation
        elif get_origin(hint) is list:
            hint = get_args(hint)[0]
        elif get_origin(hint) is dict:
            hint = get_args(hint)[1]
        else:
            return None
    origin = get_origin(_unwrapped(hint))
    return "list" if origin is list else "object" if origin is dict else None


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validation_message(error, where: str, model=None) -> str:
    """A pydantic ``ValidationError`` as one line naming ``where`` and the first bad key, in the one
    style of every flashnext record: ``where: key must be an integer, got '3'``, ``where: key must
    be at least 1, got 0``, ``where: unknown keys ['x']``, ``where: key: <a validator's sentence>``,
    or ``where: key: <pydantic's message>`` for anything else."""
    errors = error.errors()
    first = errors[0]
    loc = tuple(p for p in first.get("loc", ()) if "[" not in str(p))
    kind = first.get("type")
    if kind in (*_UNKNOWN, "missing"):
        parent = loc[:-1]
        same = [e for e in errors if e.get("type") in (*_UNKNOWN, "missing")
                and tuple(p for p in e["loc"] if "[" not in str(p))[:-1] == parent]
        unknown = sorted(str(e["loc"][-1]) for e in same if e["type"] in _UNKNOWN)
        missing = sorted(str(e["loc"][-1]) for e in same if e["type"] == "missing")
        parts = ([f"unknown keys {unknown}"] if unknown else []) + ([f"missing keys {missing}"] if missing else [])
        at = f"{_key(parent)}: " if parent else ""
        rest = len(errors) - len(same)
        return f"{where}: {at}{'; '.join(parts)}" + (f" (and {rest} more)" if rest else "")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if kind in _BOUND and loc:
        words, bound = _BOUND[kind]
        return f"{where}: {_key(loc)} must be {words} {first['ctx'][bound]}, got {_shown(first.get('input'))}{more}"
    if kind == "value_error":  # a validator's own sentence, without pydantic's "Value error, "
        return f"{where}: {_key(loc) or '(top level)'}: {first['ctx']['error']}{more}"
    must = _MUST_BE.get(kind)
    if must is not None and loc:
        container = _container_at(model, loc[:-1]) if model is not None and len(loc) > 1 else None
        got = _shown(first.get("input"))
        if container == "list":
            return f"{where}: {_key(loc[:-1])} must be a list of {_PLURAL[must]} (item {loc[-1]} is {got}){more}"
        if container == "object":
            return f"{where}: {_key(loc[:-1])} must be an object of {_PLURAL[must]} ({loc[-1]} is {got}){more}"
        return f"{where}: {_key(loc)} must be {must}, got {got}{more}"
    return f"{where}: {_key(loc) or '(top level)'}: {first.get('msg', 'invalid')}{more}"


def validate(data: Any, model: type[M], where: str) -> M:
    """``data`` as a ``model``, or one line: the record's own reason that it is no such record
    (``StrictRecord.not_this_record``) first, else the first bad key."""
    from pydantic import ValidationError

    why = getattr(model, "not_this_record", None)
    if why is not None and (reason := why(data)):
        raise FlashnextError(f"{where}: {reason}")
    try:
        if hasattr(model, "model_validate"):
            return model.model_validate(data)  # type: ignore[attr-defined]
        from pydantic import TypeAdapter

        # A strict dataclass takes a dict only as JSON (in Python it wants an instance): the data
        # came from JSON, and goes back to it losslessly (parse_json refused what would not).
        return TypeAdapter(model).validate_json(json.dumps(data))
    except ValidationError as e:
        raise FlashnextError(validation_message(e, where, model)) from None


def read_model(path: Path, model: type[M], what: str, max_bytes: int | None = None) -> M:
    """``path`` read as JSON (from a file of at most ``max_bytes``) and validated into ``model``."""
    return validate(read_json(path, what, max_bytes=max_bytes), model, str(path))


def get_int(obj: dict, key: str, where: str, minimum: int | None = None, default: int | None = None,
            maximum: int | None = None) -> int:
    """``obj[key]`` as an int (a JSON integer, or a float with an integral value), at least ``minimum``
    and at most ``maximum``."""
    if key not in obj:
        if default is not None:
            return default
        raise FlashnextError(f"{where}: {key} is missing")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and (not math.isfinite(value) or not value.is_integer())):
        raise FlashnextError(f"{where}: {key} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise FlashnextError(f"{where}: {key} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise FlashnextError(f"{where}: {key} must be at most {maximum}, got {value}")
    return value


def get_dict(obj: dict, key: str, where: str, required: bool = True) -> dict | None:
    if key not in obj or obj[key] is None:
        if required:
            raise FlashnextError(f"{where}: {key} is missing")
        return None
    if not isinstance(obj[key], dict):
        raise FlashnextError(f"{where}: {key} must be a JSON object, got {_json_type(type(obj[key]))}")
    return obj[key]
