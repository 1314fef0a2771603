"""compressed-tensors ``quantization_config`` documents: where they live, which scheme a module
resolves to, building schemes, and retargeting the MTP head.

This is the one reader of these documents, so the builders (which decide what an overlay
quantizes) and the serving hooks (which decide how vLLM serves it) cannot drift apart: both ask
:func:`target_for`, which resolves a module as vLLM 0.34.0's ``CompressedTensorsConfig.get_scheme_dict``
does. A module matched by an ``ignore`` entry is unquantized; otherwise the *first* target, in
config-group order, that matches it gives the scheme. Each single match is compressed-tensors' own
``match_name`` (an exact name, or ``re:`` with ``re.match``), behind :func:`bounded_pattern`. A vLLM
layer that fuses several checkpoint modules (``gate_up_proj``) is matched by its own name first,
then through its shards, all of which must agree, as vLLM requires.

The hooks see the checkpoint's names the way vLLM maps them into its own
(``apply_vllm_mapper``), and :func:`vllm_module_name` maps a checkpoint module the same way, for
the one case ``apply_vllm_mapper`` leaves alone: an entry naming a top-level module (``lm_head``),
which it cannot tell from a class name (``Linear``).

The draft head's modules are looked up as ``mtp.layers.{num_hidden_layers + k}...`` and
compressed-tensors' ``ignore`` is not remapped for the draft, so the MTP rules here are written
against any layer index.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from flashnext.errors import FlashnextError

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationArgs

# The modules `repack-int6` rewrites by default: the shared experts (seed 000 §3.3, decode-05).
DEFAULT_INT6_TARGETS = r".*mlp\.shared_expert\.(gate|up|down)_proj$"

MTP_EXPERT_GROUP = "flashnext_mtp_routed_experts"
# Any MTP routed-expert projection, whatever layer index vLLM gives the draft layer.
MTP_EXPERT_PATTERN = r"mtp\.layers\.\d+\.mlp\.experts\.\d+\.(?:gate|up|down)_proj$"
MTP_EXPERT_TARGET = "re:^" + MTP_EXPERT_PATTERN
# Every MTP module except the routed-expert projections stays unquantized.
MTP_OTHER_IGNORE = "re:^mtp\\.(?!" + MTP_EXPERT_PATTERN[len("mtp\\."):] + ")"


# The keys a config may keep its quantization config under, in the order vLLM 0.34.0 looks
# (``ModelArchConfigConvertor._normalize_quantization_config``): compressed-tensors once wrote
# ``compression_config``.
QUANTIZATION_KEYS = ("quantization_config", "compression_config")


def _holder_and_key(config: dict) -> tuple[dict, str] | None:
    for holder in (config, config.get("text_config")):
        if isinstance(holder, dict):
            for key in QUANTIZATION_KEYS:
                if holder.get(key) is not None:
                    return holder, key
    return None


def quantization_holder(config: dict) -> dict | None:
    """The object of a ``config.json`` that holds its quantization config: the config itself, or
    its ``text_config`` (where a multimodal checkpoint may keep the text model's), the top level
    first, as vLLM 0.34.0 looks (``get_quantization_config``); None when neither has one. The one
    rule every reader and writer of a snapshot's quantization config uses."""
    found = _holder_and_key(config)
    return None if found is None else found[0]


def quantization_config_of(config: dict) -> dict | None:
    """``config.json``'s quantization config (see :func:`quantization_holder`), or None."""
    found = _holder_and_key(config)
    return None if found is None else found[0][found[1]]


def set_quantization_config(config: dict, quantization_config: dict) -> None:
    """Put ``quantization_config`` where ``config`` keeps its quantization config (the top level
    when it has none), under the key it is read from."""
    holder, key = _holder_and_key(config) or (config, QUANTIZATION_KEYS[0])
    holder[key] = quantization_config


def is_compressed_tensors(quantization_config: dict | None) -> bool:
    """Whether vLLM serves ``quantization_config`` through compressed-tensors: ``quant_method``
    normalised as vLLM does (lower case, ``compressed_tensors`` spelled with a hyphen)."""
    method = quantization_config.get("quant_method") if isinstance(quantization_config, dict) else None
    return isinstance(method, str) and method.lower().replace("compressed_tensors", "compressed-tensors") \
        == "compressed-tensors"


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


def matches(name: str, target: str, fused: Mapping[str, Iterable[str]] | None = None) -> bool:
    """compressed-tensors' ``match_name(name, target, fused)`` (an exact name, or ``re:`` with
    ``re.match``; a fused vLLM name matches when any of its shards does), with every pattern checked
    by :func:`bounded_pattern` first."""
    from compressed_tensors.utils.match import match_name

    if not isinstance(target, str):
        raise FlashnextError(f"quantization_config: target or ignore entry {target!r} is not a string")
    if target.startswith("re:"):
        bounded_pattern(target)
    return match_name(name, target, fused)


def shard_names(name: str, fused: Mapping[str, Iterable[str]] | None) -> list[str] | None:
    """The checkpoint modules vLLM's fused layer ``name`` is made of (``...gate_up_proj`` ->
    ``...gate_proj``, ``...up_proj``), by the rule compressed-tensors' ``match_name`` expands them
    with (the first fused suffix ``name`` ends with); None when ``name`` is not fused."""
    for suffix, shards in (fused or {}).items():
        if name.endswith(suffix):
            stem = name.removesuffix(suffix)
            return [stem + shard for shard in shards]
    return None


def _same_for_every_shard(name: str, shards: list[str], verdicts: list, refusal: str):
    if any(v != verdicts[0] for v in verdicts):
        raise FlashnextError(refusal.format(name=name, shards=", ".join(shards)))
    return verdicts[0]


_MIXED_IGNORE = ("quantization_config: ignore matches only some of the shards of {name} ({shards}); vLLM serves "
                 "them as one layer, so they must all be ignored or none")
_MIXED_SCHEMES = ("quantization_config: the shards of {name} ({shards}) resolve to different schemes; vLLM serves "
                  "them as one layer with one scheme")


def covered_by(entries: Iterable[str], name: str, fused: Mapping[str, Iterable[str]] | None = None,
               refusal: str = _MIXED_IGNORE) -> bool:
    """Whether ``entries`` (an ``ignore`` list, or any list of module names) match module ``name``,
    or, for a fused vLLM layer no entry names itself, every one of its shards. Some shards but not
    all is refused with ``refusal`` (formatted with ``name`` and ``shards``), as vLLM refuses it for
    ``ignore`` (``should_ignore_layer``)."""
    entries = list(entries or ())
    if any(matches(name, entry) for entry in entries):
        return True
    shards = shard_names(name, fused)
    if shards is None:
        return False
    return _same_for_every_shard(name, shards, [any(matches(s, e) for e in entries) for s in shards], refusal)


def target_for(targets: Mapping[str, object], ignore: Iterable[str], name: str,
               fused: Mapping[str, Iterable[str]] | None = None) -> str | None:
    """The target (a key of ``targets``, target -> scheme, in order) that gives module ``name``
    its scheme, or None when it is unquantized: ignored, or matched by no target. A fused vLLM
    layer that no target names itself takes its first shard's target, as vLLM does; its shards
    must all resolve to one scheme (vLLM would serve the first one's for all of them)."""
    if covered_by(ignore, name, fused):
        return None
    found = next((t for t in targets if matches(name, t)), None)
    shards = shard_names(name, fused) if found is None else None
    if shards is None:
        return found
    per_shard = [next((t for t in targets if matches(s, t)), None) for s in shards]
    _same_for_every_shard(name, shards, [None if t is None else targets[t] for t in per_shard], _MIXED_SCHEMES)
    return per_shard[0]


def scheme_for(quantization_config: dict, name: str, fused: Mapping[str, Iterable[str]] | None = None) -> dict | None:
    """The config group (a ``QuantizationScheme`` document) that gives module ``name`` its scheme
    under the compressed-tensors document ``quantization_config``, or None when it is unquantized."""
    groups = quantization_config.get("config_groups") or {}
    by_target: dict[str, dict] = {}
    for group in groups.values():
        for target in group.get("targets") or ():
            by_target.setdefault(target, group)
    target = target_for(by_target, quantization_config.get("ignore") or (), name, fused)
    return None if target is None else by_target[target]


def vllm_scheme(quant_config, name: str, mapper=None):
    """The ``target_scheme_map`` entry that vLLM's ``CompressedTensorsConfig`` ``quant_config``
    (already mapped into vLLM's module names by ``apply_vllm_mapper``) gives vLLM's module
    ``name``, by :func:`target_for`; None when it is unquantized. The entries vLLM's mapping
    leaves in checkpoint names are finished with ``mapper`` (:func:`vllm_entries`)."""
    schemes = getattr(quant_config, "target_scheme_map", None) or {}
    targets: dict = {}
    for target, scheme in zip(vllm_entries(schemes, mapper), schemes.values()):
        targets.setdefault(target, scheme)  # the first in order wins, as before mapping
    ignore = vllm_entries(getattr(quant_config, "ignore", None) or (), mapper)
    target = target_for(targets, ignore, name, getattr(quant_config, "packed_modules_mapping", None))
    return None if target is None else targets[target]


def weight_args(scheme) -> QuantizationArgs | None:
    """The ``weights`` of a scheme, from a document's group or vLLM's ``target_scheme_map`` entry
    alike, as compressed-tensors' ``QuantizationArgs``; None for no weight quantization."""
    from compressed_tensors.quantization import QuantizationArgs

    weights = None if scheme is None else scheme.get("weights")
    if weights is None or isinstance(weights, QuantizationArgs):
        return weights
    return QuantizationArgs.model_validate(weights, from_attributes=not isinstance(weights, dict))


def symmetric_int_group_size(scheme, bits: int) -> int | None:
    """The group size when ``scheme`` quantizes weights as symmetric ``bits``-bit INT by groups,
    else None."""
    from compressed_tensors.quantization import QuantizationStrategy, QuantizationType

    w = weight_args(scheme)
    if (w is None or w.num_bits != bits or w.type != QuantizationType.INT or not w.symmetric
            or w.strategy != QuantizationStrategy.GROUP or not w.group_size or w.group_size <= 0):
        return None
    return int(w.group_size)


def vllm_module_name(name: str, mapper) -> str:
    """Checkpoint module ``name`` in vLLM's module names: what ``mapper`` (a model's
    ``hf_to_vllm_mapper.get_rename_mapper()``; None: the names are the same) makes of the module's
    tensors' names."""
    if mapper is None:
        return name
    mapped = mapper.map_name(name + ".weight")
    return mapped.removesuffix(".weight") if mapped and mapped.endswith(".weight") else name


def vllm_entries(entries: Iterable[str], mapper) -> list[str]:
    """Targets or ``ignore`` entries as vLLM's ``apply_vllm_mapper`` left them, with those it
    cannot map finished: it maps only entries with a dot, and an exact entry without one is a
    class name (``Linear``) or a top-level module (``lm_head``), of which only the latter has
    tensors ``mapper`` renames. (vLLM 0.34.0 alone leaves the release's ``lm_head`` target in
    checkpoint names, so its own config resolves ``language_model.lm_head`` as unquantized.)"""
    return [vllm_module_name(e, mapper) if isinstance(e, str) and "." not in e and not e.startswith("re:") else e
            for e in entries]


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
    if not is_compressed_tensors(quantization_config):
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
        if not any(matches(n, entry) for n in expert_names):
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
