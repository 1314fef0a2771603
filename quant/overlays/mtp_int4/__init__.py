"""Build the MTP INT4 overlay: the draft head's routed experts as INT4 pack-quantized tensors.

Only the MTP routed experts change. Every base shard that holds them is rewritten under the same
file name: its other tensors are copied byte for byte, and the BF16 experts (fused
``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]``, or per-expert
``experts.{e}.{gate,up,down}_proj.weight``) are replaced by per-expert compressed-tensors tensors
``experts.{e}.{gate,up,down}_proj.{weight_packed,weight_scale,weight_shape}``, the names vLLM's
FusedMoE loader maps to ``w13_*`` / ``w2_*``. The overlay also carries the updated index and
config.json (see :func:`quant.formats.ct_config.with_mtp_experts_quantized`) and ``overlay.json``.

One concern a module, in the manner of compressed-tensors' ``compressors/pack_quantized/``:
``source`` (finding the experts, reading them, naming what replaces them), ``builder`` (options
and the per-batch quantize), ``calibrated`` (``--calib``'s statistics for a batch), ``metrics``
(the report's error figures) and ``card`` (the model card's section).

Memory: experts are streamed ``experts_per_batch`` at a time. Each expert in flight costs about
23 bytes per weight (bf16 source, fp32 working copy, int8 codes, int64 packing temporaries), i.e.
about 0.11 GiB for the real head's expert (H 2560, I 640, 4.9 M weights); the solver's scratch is
chunked (a few MiB on the CPU). The source is read with ``pread`` rather than mmap, so nothing of it
stays resident: with the default 4 experts per batch the whole process peaked at 1.12 GiB on the
real-size head (docs/benchmarks.md), whatever the number of experts.
"""

from flashnext.quant.overlays.mtp_int4.builder import MtpInt4Builder, MtpInt4Options, make_mtp_int4
from flashnext.quant.overlays.mtp_int4.source import DraftLayerExperts, expert_tensor_names, find_draft_experts

__all__ = ["DraftLayerExperts", "MtpInt4Builder", "MtpInt4Options", "expert_tensor_names", "find_draft_experts",
           "make_mtp_int4"]
