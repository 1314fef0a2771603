"""compressed-tensors ``quantization_config`` documents: building schemes and retargeting the MTP head.

vLLM resolves a module's scheme in two steps (``CompressedTensorsConfig.get_scheme_dict``): a
module matched by any ``ignore`` entry is unquantized; otherwise the *first* target, in config-group
order, that equals the module name or ``re.match``-es it (``re:`` prefix) gives the scheme. The
draft head's modules are looked up as ``mtp.layers.{num_hidden_layers + k}...`` and compressed-tensors'
``ignore`` is not remapped for the draft, so the MTP rules here are written against any layer index.
"""

from __future__ import annotations

import copy
import functools
import re

from flashnext.errors import FlashnextError

# The modules `repack-int6` rewrites by default: the shared experts (seed 000 §3.3, decode-05).
DEFAULT_INT6_TARGETS = r".*mlp\.shared_expert\.(gate|up|down)_proj$"

MTP_EXPERT_GROUP = "flashnext_mtp_routed_experts"
# Any MTP routed-expert projection, whatever layer index vLLM gives the draft layer.
MTP_EXPERT_PATTERN = r"mtp\.layers\.\d+\.mlp\.experts\.\d+\.(?:gate|up|down)_proj$"
MTP_EXPERT_TARGET = "re:^" + MTP_EXPERT_PATTERN
# Every MTP module except the routed-expert projections stays unquantized.
MTP_OTHER_IGNORE = "re:^mtp\\.(?!" + MTP_EXPERT_PATTERN[len("mtp\\."):] + ")"


def quantization_holder(config: dict) -> dict | None:
    """The object of a ``config.json`` that holds ``quantization_config``: the config itself or its
    ``text_config`` (a multimodal checkpoint keeps the text model's there), whichever has it as a
    JSON object, the top level first; None when neither does. The one rule every reader and writer
    of a snapshot's quantization config uses."""
    for holder in (config, config.get("text_config")):
        if isinstance(holder, dict) and isinstance(holder.get("quantization_config"), dict):
            return holder
    return None


def quantization_config_of(config: dict) -> dict | None:
    """``config.json``'s ``quantization_config`` (see :func:`quantization_holder`), or None."""
    holder = quantization_holder(config)
    return None if holder is None else holder["quantization_config"]


def weight_scheme(targets: list[str], bits: int, group_size: int) -> dict:
    """A weight-only symmetric INT group scheme, serialised by compressed-tensors itself."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(
        targets=targets,
        weights=QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group",
                                 group_size=group_size),
        format="pack-quantized",
    )
    return scheme.model_dump(mode="json")


def checked_quantization_config(quantization_config: object, where: str) -> dict:
    """``quantization_config`` validated by compressed-tensors' own ``QuantizationConfig`` (one line
    naming ``where`` and the bad key otherwise); returned unchanged, as the plain document."""
    from compressed_tensors.quantization import QuantizationConfig

    from flashnext.quant.records.jsonfile import validate

    if not isinstance(quantization_config, dict):
        raise FlashnextError(f"{where}: quantization_config must be a JSON object")
    validate(quantization_config, QuantizationConfig, f"{where}: quantization_config")
    return quantization_config


# The names matched are module paths of a few dozen characters and the patterns that select them
# short; a longer or more ambiguous pattern is refused rather than risked (Python's `re` has no
# time limit, and `(a+)+$` against one 40-character name backtracks for hours).
PATTERN_LIMIT = 512
# Quantifiers that may take a varying count ("*", "+", "?", "{m,n}"): k of them in a row can try
# every way of splitting a name among them, C(len + k, k); 6 against a 70-character name is
# ~0.3 s.
VARIABLE_QUANTIFIER_LIMIT = 6


def _refuse(entry: str, why: str) -> FlashnextError:
    shown = repr(entry[:80]) + ("..." if len(entry) > 80 else "")
    return FlashnextError(f"quantization_config: the target or ignore pattern {shown} {why}")


_SLOW = "; matching it can take exponential time: write a simpler pattern (the names are short module paths)"


def _check_quantifiers(entry: str, parsed, inside_repeat: bool, counts: list[int]) -> None:
    """Refuse what makes a backtracking match exponential: a quantifier or an alternation inside a
    repeated group (``(a+)+``, ``(a?){30}``, ``(a|ab)*``), or too many quantifiers in a row."""
    from re import _constants as c

    for op, av in parsed:
        if op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
            low, high, body = av
            variable = low != high
            if inside_repeat and variable:
                raise _refuse(entry, "has a quantifier inside a repeated group" + _SLOW)
            counts[0] += variable
            if counts[0] > VARIABLE_QUANTIFIER_LIMIT:
                raise _refuse(entry, f"has more than {VARIABLE_QUANTIFIER_LIMIT} quantifiers" + _SLOW)
            _check_quantifiers(entry, body, inside_repeat or high > 1, counts)
        elif op is c.BRANCH:
            if inside_repeat:
                raise _refuse(entry, "has an alternation inside a repeated group" + _SLOW)
            for branch in av[1]:
                _check_quantifiers(entry, branch, inside_repeat, counts)
        elif op is c.SUBPATTERN:
            _check_quantifiers(entry, av[-1], inside_repeat, counts)
        elif op in (c.ASSERT, c.ASSERT_NOT):
            _check_quantifiers(entry, av[1], inside_repeat, counts)
        elif op is c.ATOMIC_GROUP:
            _check_quantifiers(entry, av, inside_repeat, counts)
        elif op is c.GROUPREF_EXISTS:
            for branch in av[1:]:
                if branch is not None:
                    _check_quantifiers(entry, branch, inside_repeat, counts)


@functools.lru_cache(maxsize=1024)
def bounded_pattern(entry: str) -> re.Pattern:
    """The compiled regular expression of a ``re:`` target or ``ignore`` entry, refused in one line
    when it is not a valid expression, is longer than :data:`PATTERN_LIMIT` or could backtrack
    without bound."""
    pattern = entry[3:]
    if len(pattern) > PATTERN_LIMIT:
        raise _refuse(entry, f"is longer than {PATTERN_LIMIT} characters" + _SLOW)
    try:
        compiled = re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise _refuse(entry, f"is not a valid regular expression ({e})") from None
    from re import _parser  # the parse `re.compile` itself makes: the only exact reading of the syntax

    _check_quantifiers(entry, _parser.parse(pattern), False, [0])
    return compiled


def _matches(entry: str, name: str) -> bool:
    """compressed-tensors' matcher (``re:`` entries with ``re.match``, others by equality), with
    every pattern checked by :func:`bounded_pattern` first."""
    if not isinstance(entry, str):
        raise FlashnextError(f"quantization_config: target or ignore entry {entry!r} is not a string")
    if entry.startswith("re:"):
        return bounded_pattern(entry).match(name) is not None
    return entry == name


def _probe_expert_names(draft_layer_indices: list[int]) -> list[str]:
    return [f"mtp.layers.{layer}.mlp.experts.{e}.{proj}_proj"
            for layer in draft_layer_indices for e in (0, 1) for proj in ("gate", "up", "down")]


def with_mtp_experts_quantized(quantization_config: dict | None, bits: int, group_size: int,
                               draft_layer_indices: list[int]) -> dict:
    """Return a copy of ``quantization_config`` under which the MTP routed experts resolve to
    ``bits``-bit pack-quantized with ``group_size``, every other MTP module stays unquantized, and
    every other module resolves exactly as before.

    ``draft_layer_indices`` are the layer indices to check the result against (the checkpoint's
    ``0`` and vLLM's ``num_hidden_layers``).
    """
    if quantization_config is None:
        raise FlashnextError("config.json has no quantization_config: make-mtp-int4 expects a "
                             "compressed-tensors quantized snapshot")
    if quantization_config.get("quant_method") != "compressed-tensors":
        raise FlashnextError(
            f"quantization_config.quant_method is {quantization_config.get('quant_method')!r}: "
            "only compressed-tensors snapshots are supported")
    qc = copy.deepcopy(checked_quantization_config(quantization_config, "config.json"))
    groups = qc.get("config_groups") or {}
    if MTP_EXPERT_GROUP in groups:
        raise FlashnextError(
            f"quantization_config already has the group {MTP_EXPERT_GROUP}: this snapshot already "
            "has its MTP experts quantized")
    expert_names = _probe_expert_names(draft_layer_indices)
    guard = "(?!" + MTP_EXPERT_PATTERN + ")"
    ignore = []
    for entry in qc.get("ignore") or []:
        if not any(_matches(entry, n) for n in expert_names):
            ignore.append(entry)
        elif entry.startswith("re:"):
            # Keep the entry for every other name; only the expert projections escape it.
            ignore.append("re:" + guard + "(?:" + entry[3:] + ")")
        # An exact name of an MTP expert projection is dropped.
    ignore.append(MTP_OTHER_IGNORE)
    qc["ignore"] = ignore
    # First in order, so it wins over any broader expert target of the main model.
    qc["config_groups"] = {MTP_EXPERT_GROUP: weight_scheme([MTP_EXPERT_TARGET], bits, group_size),
                           **groups}
    return qc
