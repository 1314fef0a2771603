"""vLLM 0.33.0's own ``qwen4_exp`` model for the demo checkpoint, built on the CPU by the scenario
scripts (run in their own processes against stock and patched vLLM trees).

What cannot exist on the CPU is stood in for, and only that: FlashAttention's availability probe
(QSA never runs flash-attn over its cache; the probe only guards the import).
"""
import importlib
import json
import os
from contextlib import contextmanager

import torch
from vllm.config import (
    CacheConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config,
)
from vllm.distributed import init_distributed_environment, initialize_model_parallel


@contextmanager
def demo_vllm(snapshot: str, port: str, hf_overrides=None, cache_config: CacheConfig | None = None,
              mtp: bool = False):
    """A current ``VllmConfig`` for the demo checkpoint with one gloo rank (``mtp``: with MTP
    speculative decoding, as ``--speculative-config '{"method": "mtp"}'`` sets it); yields it and
    vLLM's ``qsa`` module (imported after the model module, which it imports back). vLLM's general
    plugins are loaded first, as its engine and workers load them before building a config:
    flashnext's among them unless ``VLLM_PLUGINS`` leaves it out."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    model_config = ModelConfig(model=snapshot, max_model_len=4096, skip_tokenizer_init=True, dtype="bfloat16",
                               hf_overrides=hf_overrides if hf_overrides is not None else {})
    speculative = None
    if mtp:
        speculative = SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=model_config,
                                        target_parallel_config=ParallelConfig())
    config = VllmConfig(model_config=model_config, cache_config=cache_config or CacheConfig(),
                        speculative_config=speculative)
    config.engram_config.cpu_offload = False  # the PLE table in (CPU) device memory, not pinned
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:" + port,
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.bfloat16)
        importlib.import_module("vllm.models.qwen4_exp.nvidia.model")
        qsa = importlib.import_module("vllm.models.qwen4_exp.nvidia.qsa")
        qsa.is_flash_attn_varlen_func_available = lambda: True
        yield config, qsa


def build_model(config):
    """The model class vLLM resolves for the config, built on the CPU; the quantization config gets
    the class's module mappings first, as vLLM's ``initialize_model`` does."""
    from vllm.model_executor.model_loader.utils import configure_quant_config
    from vllm.model_executor.models import ModelRegistry

    model_cls, _ = ModelRegistry.resolve_model_cls(config.model_config.architecture, model_config=config.model_config)
    if config.quant_config is not None:
        configure_quant_config(config.quant_config, model_cls)
    return model_cls(vllm_config=config, prefix="")


def read_tensors(snapshot: str, predicate) -> dict:
    """The snapshot's tensors whose names satisfy ``predicate``, read through its index."""
    from safetensors import safe_open

    index = json.load(open(os.path.join(snapshot, "model.safetensors.index.json")))["weight_map"]
    out = {}
    for name in filter(predicate, index):
        with safe_open(os.path.join(snapshot, index[name]), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def only_int6_shared_experts(config):
    """``hf_overrides``: the quantization config keeps only its INT6 group, narrowed to the shared
    experts (the CPU has no kernel for the other INT6 layers, nor for the INT4 routed experts)."""
    qc = getattr(config, "quantization_config", None)
    if qc is not None:
        groups = {k: g for k, g in qc["config_groups"].items() if g["weights"]["num_bits"] == 6}
        for g in groups.values():
            g["targets"] = [r"re:.*mlp\.shared_expert\.(gate|up|down)_proj$"]
        qc["config_groups"] = groups
    return config


def stand_in_experts_kernel(experts, received: list) -> None:
    """This vLLM build has no CPU MoE kernels (its CPU ops are not compiled in), so the routed
    experts' kernel, and only it, is stood in for by the arithmetic it implements, at the same
    boundary: the quant method's ``apply(layer, x, topk_weights, topk_ids)``. Each call appends what
    vLLM's router gave it, ``(topk_ids, topk_weights)``, to ``received``."""

    def apply(layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        received.append((topk_ids.long().clone(), topk_weights.float().clone()))
        out = torch.zeros(x.shape, dtype=torch.float32)
        for t in range(x.shape[0]):
            for e, w in zip(topk_ids[t].tolist(), topk_weights[t].tolist()):
                gate, up = (x[t].float() @ layer.w13_weight[e].float().T).chunk(2)
                out[t] += w * ((torch.nn.functional.silu(gate) * up) @ layer.w2_weight[e].float().T)
        return out.to(x.dtype)

    experts.quant_method.apply = apply


def finish_layers(root, skip=None) -> None:
    """Run each layer's ``process_weights_after_loading`` under ``root`` as vLLM's loader does
    (``skip``: a module left alone, e.g. experts a stand-in kernel serves).

    The CPU's packed bf16 GEMM needs vllm._C, which this CUDA build of vLLM cannot load without
    libcuda; vLLM's own flag for a layer that skips it gives torch's F.linear (what a CUDA run's
    default_unquantized_gemm calls)."""
    for module in root.modules():
        module._cpu_skip_gemm_dispatch = True
        method = getattr(module, "quant_method", None)
        if method is not None and module is not skip:
            method.process_weights_after_loading(module)
