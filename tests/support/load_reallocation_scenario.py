"""vLLM 0.34.0's own ``qwen4_exp`` model for the demo checkpoint with the INT6 bit-plane overlay
applied, built on the CPU; its INT8 hyper-connection mixers (patch int8-modules) and bit-plane
shared experts (patch int6-bitplane) loaded by vLLM's own loader, then vLLM's own post-load step
(``model_loader.utils.process_weights_after_loading``) with every allocation and free during it
recorded, per layer. Prints JSON.

Run by tests/serving/patches/test_load_reallocation.py: ``python load_reallocation_scenario.py VIEW
PORT``. The quantization config keeps the mixers' INT8 group and the INT6 group narrowed to the
shared experts (the CPU has no kernels for the INT4 experts and the dense INT6 layers, which vLLM
repacks on a GPU). Stood in for, as they need vllm._C, which this CUDA build of vLLM cannot load
here: vLLM's CPU GEMM set-up (every layer skips it by vLLM's own ``_cpu_skip_gemm_dispatch``
flag) and the routed experts' CPU prepack (their post-load step does nothing).

An allocation is an operator's output whose storage none of its inputs has (a dispatch mode over
torch's operators); a free is a loaded storage's finalizer running.
"""
import json, sys, weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase

from support.vllm_demo import build_model, demo_vllm, read_tensors

view, port = sys.argv[1], sys.argv[2]
KEPT_AS_LOADED = ("Int8LinearMethod", "BitplaneLinearMethod")  # flashnext's methods that keep the words
TENSORS = ("weight_packed", "weight_scale")


def mixers_and_int6_shared_experts(config):
    qc = getattr(config, "quantization_config", None)
    if qc is not None:
        groups = {}
        for name, group in qc["config_groups"].items():
            bits, size = group["weights"]["num_bits"], group["weights"]["group_size"]
            if bits == 6:
                group["targets"] = [r"re:.*mlp\.shared_expert\.(gate|up|down)_proj$"]
            if bits == 6 or (bits, size) == (8, 64):
                groups[name] = group
        qc["config_groups"] = groups
    return config


events: dict[str, list] = {}  # per layer, in order: ["alloc", bytes] and ["free", bytes, tensor]
processing = [""]  # the layer whose post-load step runs


class Allocations(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                events.setdefault(processing[0], []).append(["alloc", t.untyped_storage().nbytes()])
        return out


def no_prepack(layer) -> None:
    pass


def attributed(name, post_load):
    def process_weights_after_loading(layer):
        processing[0] = name
        try:
            return post_load(layer)
        finally:
            processing[0] = ""

    return process_weights_after_loading


out = {}
with demo_vllm(view, port, mixers_and_int6_shared_experts) as (config, _):
    model = build_model(config)
    model.load_weights(iter(read_tensors(view, lambda n: n.startswith("model.language_model.") and (
        "hyper_connection" in n or ".mlp.shared_expert." in n)).items()))

    kept = {}
    for name, module in model.named_modules():
        module._cpu_skip_gemm_dispatch = True
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        stood_in = isinstance(method, FusedMoEMethodBase)  # the routed experts' CPU prepack
        method.process_weights_after_loading = attributed(name, no_prepack if stood_in else
                                                          method.process_weights_after_loading)
        if type(method).__name__ in KEPT_AS_LOADED:
            kept[name] = type(method).__name__

    loaded = {}
    for name in kept:
        for tensor in TENSORS:
            data = getattr(model.get_submodule(name), tensor).data
            loaded[(name, tensor)] = (data.clone(), data.untyped_storage().nbytes(), data.data_ptr())
            weakref.finalize(data.untyped_storage(), events.setdefault(name, []).append,
                             ["free", data.untyped_storage().nbytes(), tensor])
    del data  # only the layers hold the loaded tensors now

    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with Allocations():
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))

    out["layers"] = {kind: sum(v == kind for v in kept.values()) for kind in KEPT_AS_LOADED}
    as_repacked, contents_kept, moved = True, True, True
    for name in kept:
        expected = []
        for tensor in TENSORS:
            before, nbytes, pointer = loaded[(name, tensor)]
            now = getattr(model.get_submodule(name), tensor).data
            contents_kept &= torch.equal(now, before) and now.untyped_storage().nbytes() == nbytes
            moved &= now.data_ptr() != pointer
            expected += [["alloc", nbytes], ["free", nbytes, tensor]]
        as_repacked &= events.get(name) == expected
    # each layer: a new region of the loaded tensor's size, then the loaded one freed, weights then scales
    out["each_allocated_then_freed_once"] = as_repacked
    out["contents_and_sizes_kept"] = contents_kept
    out["new_regions"] = moved
    ours = [e for name in kept for e in events.get(name, [])]
    out["allocations"] = sum(e[0] == "alloc" for e in ours)
    out["frees"] = sum(e[0] == "free" for e in ours)
    out["bytes_reallocated"] = sum(e[1] for e in ours if e[0] == "alloc")
print(json.dumps(out))
