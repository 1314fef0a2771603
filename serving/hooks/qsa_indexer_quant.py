"""Patch qsa-indexer-quant: the QSA indexer's projection keeps its own quantization scheme.

vLLM 0.34.0's ``Qwen4ExpQSAAttention`` merges ``q/k/v_proj`` with ``indexer.index_qk_proj`` into one
``Qwen4ExpQSAQKVIndexerLinear`` unless LoRA is on or the parts' quant methods are of different types,
which compressed-tensors' never are (every part gets ``CompressedTensorsLinearMethod``, whatever its
scheme; the patch adds this check to vLLM's). compressed-tensors resolves a merged layer's
scheme from its parts (``_match_fused_layer``): every part must match some target, and the first
part's target wins, without asking whether the parts' targets agree. The release quantizes q/k/v
INT6 group 64 and the indexer INT8 group 128, so the merged layer is built INT6 group 64 and the
indexer's INT8 words and group-128 scales do not fit its rows: vLLM's loader stops on the shape.

:func:`fuse_indexer_projection` keeps vLLM's merge where the parts resolve to one scheme and
otherwise keeps the indexer's ``ReplicatedLinear`` (vLLM's own LoRA layout), which resolves its
own scheme and loads its own tensors; q/k/v stay one ``QKVParallelLinear``. The cost is one more
GEMM launch per QSA layer for the indexer's keys.
"""

from __future__ import annotations

from flashnext import envs

# The parts of the merged projection, as vLLM's ``packed_modules_mapping["qkv_proj"]`` names them.
MERGED_PARTS = ("q_proj", "k_proj", "v_proj", "indexer.index_qk_proj")


def enabled() -> bool:
    return envs.VLLM_QSA_INDEXER_OWN_SCHEME.enabled()


def part_schemes(quant_config, prefix: str) -> dict[str, object] | None:
    """Each part's scheme as the quantization config resolves it by its checkpoint name (None for
    an unquantized part); None when the config does not resolve schemes by layer name."""
    scheme_of = getattr(quant_config, "get_scheme_dict", None)
    if scheme_of is None:
        return None
    return {part: scheme_of(None, layer_name=f"{prefix}.{part}") for part in MERGED_PARTS}


def fuse_indexer_projection(vllm_config, quant_config, prefix: str) -> bool:
    """Whether ``Qwen4ExpQSAAttention`` at ``prefix`` merges the indexer into q/k/v: vLLM's rule
    (not under LoRA) and, with the switch on, only where every part has the same scheme."""
    if vllm_config.lora_config is not None:
        return False
    if not enabled() or quant_config is None:
        return True
    schemes = part_schemes(quant_config, prefix)
    if schemes is None:
        return True
    first = schemes[MERGED_PARTS[0]]
    return all(scheme == first for scheme in schemes.values())
