"""Patch int6-bitplane: serve the modules that ``flashnext repack-int6`` rewrote as INT6 bit planes.

A bit-plane overlay changes each listed module's ``weight_packed`` from compressed-tensors' dense
6-bit words to ``uint8 [N, 3K/4]`` planes (:mod:`flashnext.quant.formats.bitplane`) and lists the
modules in config.json (``flashnext.int6_bitplane``). vLLM 0.33.0's compressed-tensors INT6 scheme
refuses the planes on shape, so compressed-tensors' ``get_quant_method`` asks :func:`linear_method`
first, and the listed modules get
:class:`~flashnext.serving.quantization.bitplane.BitplaneLinearMethod`:

* ``VLLM_INT6_BITPLANE=1`` (the default): the planes stay as loaded, and every batch multiplies
  through :func:`flashnext.quant.kernels.decode_mma.bitplane_matmul` (decode kernels for 1..16
  tokens, the tiled prefill GEMM of :mod:`flashnext.quant.kernels.prefill_gemm` above);
* ``VLLM_INT6_BITPLANE=0``: after loading, the planes become the dense words again (the same bytes
  the original snapshot holds) and vLLM's own INT6 scheme takes over, so the dense path is the
  fallback with the overlay still applied.

The record lists checkpoint names (``model.language_model.layers.0...``); they are mapped into
vLLM's (``language_model.model.layers.0...``) by the model's own mapper, as vLLM maps the
quantization config (:mod:`.vllm_names`), and matched as compressed-tensors matches targets
(:func:`~flashnext.quant.formats.ct_config.covered_by`): a layer vLLM merges (``gate_up_proj`` from
``gate_proj`` and ``up_proj``) is bit-plane when all of its parts are listed (some but not all is
refused).
"""

from __future__ import annotations

from flashnext import envs
from flashnext.quant.formats.bitplane import BitplaneRecord
from flashnext.quant.formats.ct_config import covered_by, vllm_module_name
from flashnext.serving.hooks.vllm_names import rename_mapper
from flashnext.serving.quantization.bitplane import BitplaneLinearMethod


def enabled() -> bool:
    return envs.VLLM_INT6_BITPLANE.enabled()


def recorded_modules(hf_config) -> set[str]:
    """The module names config.json's ``flashnext.int6_bitplane`` lists (empty without one); a
    record of another layout is refused (:class:`~flashnext.quant.formats.bitplane.BitplaneRecord`)."""
    record = BitplaneRecord.from_config(hf_config)
    return set() if record is None else set(record.modules)


_PARTLY_LISTED = ("{name}: the bit-plane overlay lists only some of {shards}, which vLLM merges into one layer; "
                  "repack all of them or none")


def bitplane_parts(prefix: str, packed_modules_mapping: dict[str, list[str]], recorded: set[str],
                   mapper=None) -> bool:
    """Whether vLLM's linear layer ``prefix`` holds bit-plane weights: its checkpoint module (or
    every part of a merged layer) is listed. ``mapper``: the model's rename mapper, which gives
    the listed checkpoint names in vLLM's names (None: the same names)."""
    listed = sorted(vllm_module_name(m, mapper) for m in recorded)
    return covered_by(listed, prefix, packed_modules_mapping, refusal=_PARTLY_LISTED)


def linear_method(quant_config, prefix: str, method):
    """The method for the linear layer at ``prefix`` that compressed-tensors chose (``method``, its
    scheme on ``layer.scheme``): the bit-plane method for a listed INT6 module, else ``method``
    unchanged."""
    from vllm.config import get_current_vllm_config

    model_config = get_current_vllm_config().model_config
    recorded = recorded_modules(model_config.hf_config) if model_config is not None else set()
    if not recorded or not bitplane_parts(prefix, getattr(quant_config, "packed_modules_mapping", {}) or {},
                                          recorded, rename_mapper(model_config)):
        return method
    return BitplaneLinearMethod(quant_config, planes_kept=enabled())
