"""compressed-tensors ``quantization_config`` documents: building schemes and retargeting the MTP head.

vLLM resolves a module's scheme in two steps (``CompressedTensorsConfig.get_scheme_dict``): a
module matched by any ``ignore`` entry is unquantized; otherwise the *first* target, in config-group
order, that equals the module name or ``re.match``-es it (``re:`` prefix) gives the scheme. The
draft head's modules are looked up as ``mtp.layers.{num_hidden_layers + k}...`` and compressed-tensors'
``ignore`` is not remapped for the draft, so the MTP rules here are written against any layer index.
"""

from __future__ import annotations

import copy
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

    from flashnext.quant.checkpoint.jsonfile import validate

    if not isinstance(quantization_config, dict):
        raise FlashnextError(f"{where}: quantization_config must be a JSON object")
    validate(quantization_config, QuantizationConfig, f"{where}: quantization_config")
    return quantization_config


def _matches(entry: str, name: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
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
