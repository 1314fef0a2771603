"""Build vLLM 0.34.0's own ``qwen4_exp`` model for the demo checkpoint on the CPU with the
checkpoint's whole quantization config, load one QSA layer's tensors with vLLM's own loader and
compare what the layer holds with independent dequantizations of the checkpoint; print JSON.

Run by tests/serving/patches/test_qsa_indexer_quant.py against stock and patched vLLM trees:
``python qsa_indexer_quant_scenario.py SNAPSHOT PORT``.

Stand-ins, for what cannot exist on a CPU:
* the CUDA platform as vLLM's kernel chooser sees it (``kernel_fit.kernels_see_capability``, sm86),
  so that the model is built with the kernels a 3090 gets (Humming for INT6, Marlin for INT8);
* the Marlin GEMM of the indexer projection: the same ``CompressedTensorsWNA16`` scheme is switched
  to vLLM's own batch-invariant path (dequantize + matmul), its CPU route, fed fp32 activations
  (Triton's CPU interpreter, which runs that matmul, computes bf16 dots wrongly). The INT6 q/k/v
  projection is not run: vLLM's batch-invariant INT6 unpacking reads compressed-tensors' padded
  6-bit layout, not the release's dense words, and Humming has no CPU path.
"""
import json
import sys
import traceback

import torch

from flashnext.quant.formats.packing import dequantize_groups, unpack_int32
from flashnext.serving.selftest.kernel_fit import kernels_see_capability
from support.vllm_demo import build_model, demo_vllm, read_tensors

snapshot, port = sys.argv[1], sys.argv[2]
LAYER = 3  # the demo's one full-attention (QSA) layer
CKPT = f"model.language_model.layers.{LAYER}.self_attn."
SHARDS = ("q_proj", "k_proj", "v_proj", "indexer.index_qk_proj")

out = {}
with demo_vllm(snapshot, port, {}) as (config, _):
    qc = config.quant_config
    with kernels_see_capability(86):
        model = build_model(config)
    attn = model.language_model.model.layers[LAYER].self_attn
    prefix = attn.qkv_proj.prefix.rsplit(".", 1)[0]
    out["schemes"] = {}
    for shard in SHARDS:
        weights = qc.get_scheme_dict(None, layer_name=f"{prefix}.{shard}")["weights"]
        out["schemes"][shard] = [weights.num_bits, weights.group_size]

    def kernel(layer):
        c = layer.scheme.kernel.config
        return {"class": type(layer).__name__, "kernel": type(layer.scheme.kernel).__name__,
                "weight_type": str(c.weight_type).removeprefix("ScalarType."), "k": c.partition_weight_shape[0],
                "n": c.partition_weight_shape[1], "group_size": c.group_size,
                "can_implement": list(type(layer.scheme.kernel).can_implement(c))}

    out["fused"] = bool(attn.fuse_indexer_projection)
    index_proj = getattr(attn.indexer, "index_qk_proj", None)
    with kernels_see_capability(86):
        out["qkv_proj"] = kernel(attn.qkv_proj)
        out["index_qk_proj"] = kernel(index_proj) if index_proj is not None else None

    tensors = read_tensors(snapshot, lambda n: n.startswith(CKPT))
    try:
        model.load_weights(iter(tensors.items()))
        out["loaded"] = True
    except Exception as error:  # noqa: BLE001 - the scenario reports what vLLM's loader raised
        out["loaded"] = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
        where = traceback.extract_tb(error.__traceback__)[-1]
        out["load_error_at"] = f"{where.filename.rsplit('/vllm/', 1)[-1]}:{where.lineno}: {where.line}"

    # Independent references: the checkpoint's own tensors, unpacked densely by flashnext.
    def reference(shard):
        words, scales = tensors[CKPT + shard + ".weight_packed"], tensors[CKPT + shard + ".weight_scale"]
        rows, cols = (int(v) for v in tensors[CKPT + shard + ".weight_shape"])
        bits = words.shape[1] * 32 // cols
        return dequantize_groups(unpack_int32(words, bits, cols), scales)

    qkv_ref = torch.cat([reference(s) for s in SHARDS[:3]])
    index_ref = reference(SHARDS[3])
    out["reference_shapes"] = [list(qkv_ref.shape), list(index_ref.shape)]
    if out["loaded"] is True:
        qkv = attn.qkv_proj
        cols = int(tensors[CKPT + "q_proj.weight_shape"][1])

        def as_int6(words, scales):  # what the INT6 group-64 layer reads from its rows
            return dequantize_groups(unpack_int32(words, 6, cols), scales)

        rows = qkv_ref.shape[0]
        out["qkv_rows_equal"] = torch.equal(as_int6(qkv.weight_packed[:rows], qkv.weight_scale[:rows]), qkv_ref)
        if out["fused"]:
            held = as_int6(qkv.weight_packed[rows:], qkv.weight_scale[rows:])
            out["index_rows_equal"] = torch.equal(held, index_ref)
            out["index_rows_max_error"] = float((held - index_ref).abs().max())
        else:
            held = index_proj.weight_packed
            out["index_words_equal"] = torch.equal(held, tensors[CKPT + "indexer.index_qk_proj.weight_packed"])
            out["index_scales_equal"] = torch.equal(index_proj.weight_scale,
                                                    tensors[CKPT + "indexer.index_qk_proj.weight_scale"])
            # The CPU route of the indexer's own scheme (see the module docstring).
            index_proj.scheme.use_batch_invariant = True
            index_proj.quant_method.process_weights_after_loading(index_proj)
            x = torch.randn(5, cols, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
            got = index_proj(x)[0].float()
            want = x @ index_ref.T
            # vLLM dequantizes into the scale's dtype (bf16): the same rounding, applied to the
            # reference's weights, leaves only the summation order.
            want_bf16_weights = x @ index_ref.to(torch.bfloat16).float().T
            out["index_forward_max_rel_error"] = float(((got - want).abs() / want.abs().clamp_min(1.0)).max())
            out["index_forward_max_error_bf16_weights"] = float((got - want_bf16_weights).abs().max())
            out["index_forward_shape"] = list(got.shape)
print(json.dumps(out))
