"""Build vLLM 0.34.0's own ``qwen4_exp`` model for the demo checkpoint on the CPU, as a 3090 and an
H200 would build it, and follow the INT8 LM head through vLLM's own kernel chooser, scheme, loader
and the method its logits processor calls; print JSON.

Run by tests/serving/patches/test_int8_lm_head.py against the patched vLLM tree:
``python int8_lm_head_scenario.py SNAPSHOT PORT``. The quantization config keeps only
the LM head's and embedding's group (the other layers do not depend on them, and the CPU has no
kernel for them).

Stand-ins, for what cannot exist on a CPU:
* the CUDA platform as vLLM's kernel chooser sees it (``kernel_fit.kernels_see_capability``);
* Marlin's repack and GEMM (CUDA ops): the LM head's ``CompressedTensorsWNA16`` scheme is switched
  to vLLM's own batch-invariant path (dequantize + matmul), its CPU route, fed fp32 activations
  (Triton's CPU interpreter, which runs that matmul, computes bf16 dots wrongly).
"""
import json
import os
import sys

import torch

from flashnext.quant.formats.packing import dequantize_groups, unpack_int32
from flashnext.serving.selftest.kernel_fit import kernels_see_capability
from support.vllm_demo import build_model, demo_vllm, read_tensors

snapshot, port = sys.argv[1], sys.argv[2]


def only_the_int8_lm_head_and_embedding(config):
    qc = getattr(config, "quantization_config", None)
    if qc is not None:
        groups = {k: g for k, g in qc["config_groups"].items()
                  if g["weights"]["num_bits"] == 8 and "lm_head" in g["targets"]}
        for g in groups.values():
            g["targets"] = ["lm_head", "re:.*embed_tokens$"]
        qc["config_groups"] = groups
    return config


def built(config, capability=None):
    config.compilation_config.static_forward_context.clear()  # a second build registers the layers again
    if capability is None:
        return build_model(config)
    with kernels_see_capability(capability):
        return build_model(config)


out = {}
with demo_vllm(snapshot, port, only_the_int8_lm_head_and_embedding) as (config, _):
    lm_head = lambda model: model.language_model.lm_head
    out["kernels"] = {}
    for capability in (86, 90, None):
        method = lm_head(built(config, capability)).quant_method
        out["kernels"][str(capability or "cpu")] = [type(method).__name__, method.kernel]
    os.environ["VLLM_INT8_LM_HEAD_KERNEL"] = "flashnext"
    out["kernels"]["86, switch flashnext"] = [None, lm_head(built(config, 86)).quant_method.kernel]
    os.environ["VLLM_INT8_LM_HEAD_KERNEL"] = "vllm"

    model = built(config, 86)
    head = lm_head(model)
    out["scheme"] = type(getattr(head, "scheme", None)).__name__
    out["parameters"] = {n: [str(p.dtype), list(p.shape), type(p).__name__] for n, p in head.named_parameters()}
    tensors = read_tensors(snapshot, lambda n: n.startswith("lm_head."))
    model.load_weights(iter(tensors.items()))
    rows = tensors["lm_head.weight_packed"].shape[0]
    out["words_equal"] = torch.equal(head.weight_packed[:rows], tensors["lm_head.weight_packed"])
    out["scales_equal"] = torch.equal(head.weight_scale[:rows], tensors["lm_head.weight_scale"])

    head.scheme.use_batch_invariant = True  # the CPU route of vLLM's scheme (see the module docstring)
    head.quant_method.process_weights_after_loading(head)
    cols = int(tensors["lm_head.weight_shape"][1])
    reference = dequantize_groups(unpack_int32(tensors["lm_head.weight_packed"], 8, cols), tensors["lm_head.weight_scale"])
    # What the logits processor calls (``_apply_head``: ``lm_head.quant_method.apply``), in fp32 (see above).
    hidden = torch.randn(3, cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).float()
    logits = head.quant_method.apply(head, hidden).float()
    want = hidden @ reference.to(torch.bfloat16).float().T  # vLLM dequantizes into the scale's dtype
    out["logits_shape"] = list(logits.shape)
    out["logits_max_error"] = float((logits[:, :rows] - want).abs().max())
    out["logits_max_relative_error"] = float(((logits[:, :rows] - want).abs() / want.abs().clamp_min(1.0)).max())
print(json.dumps(out))
