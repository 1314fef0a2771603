"""Build vLLM 0.34.0's own ``qwen4_exp`` model on the CPU for a VIEW of the demo checkpoint with the
INT6 bit-plane overlay applied, its shared experts (patch int6-bitplane's ``BitplaneLinearMethod``)
and hyper-connection mixers (int8-modules' ``Int8LinearMethod``, mixed by decode-04) loaded by
vLLM's own loader, then serve decode steps of 1..16 rows through those layers' own call sites,
recording what flashnext's code allocates and which Triton variants it launches; prints JSON. Run by
tests/serving/test_engine_ledger_decode_mma.py: ``python engine_ledger_decode_mma_scenario.py VIEW
PORT CAPTURE_SIZES WARM_UP`` (CAPTURE_SIZES comma-separated; WARM_UP 0: the load does not warm the
bit-plane kernels, as on the CPU without the stand-in below).

Start-up, in the engine's order: the model built by vLLM's model class through flashnext's registered
compressed-tensors config, the shared experts' and mixers' tensors loaded by the model's own
``load_weights``, vLLM's post-load step over the model (``process_weights_after_loading``:
``BitplaneLinearMethod`` moves the planes and warms ``bitplane_matmul``'s tensor-core and prefill
kernels); then one decode step of each CUDA-graph capture size. Serving: decode steps of 1..16 rows.
A step is what a decode step asks of these layers in each decoder layer: its two mixers' ``mix``
(vLLM's ``GatedResidual.mix``, which decode-04's hook takes at 1..16 tokens), its shared expert's
``gate_up_proj``, ``act_fn`` and ``down_proj`` (vLLM's linear layers' ``forward``, whose method is
the bit-plane one), then the final mixer's ``mix``.

Recorded (support/allocations.py, support/triton_launches.py): each step's allocations whose call
stack passes through flashnext's code, with site and bytes, whether each outlived its step and each
site's peak within it; every Triton launch as its cache key for an RTX 3090, with the module that
defines the kernel; what start-up left in ``_common``'s split-K counters.

Stood in for: CUDA, as the load sees it: ``BitplaneLinearMethod`` warms its kernels where launching
compiles them (CUDA weights, ``bitplane._compiles_kernels``), and these weights are the CPU's, so the
stand-in says yes (WARM_UP 1), as it would on the GPU; CUDA-graph capture, by one eager step of each
capture size (on a GPU capture runs those steps' kernels once, which compiles their variants); the
kernels, recorded and not run (their arithmetic is held by tests/quant/kernels/); the other layers'
weights (the quantization config keeps only the shared experts' INT6 group and the mixers' INT8 one:
the CPU has no kernels for the rest); the routed experts' post-load step (no CPU MoE kernel).
"""
import json, sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

import flashnext.quant
import flashnext.serving
from support import SUPPORT_DIR
from support.allocations import Allocations
from support.triton_launches import Launches
from support.vllm_demo import build_model, demo_vllm, read_tensors

view, port = sys.argv[1], sys.argv[2]
capture_sizes = [int(n) for n in sys.argv[3].split(",")]
warm_up = sys.argv[4] == "1"
MAX_ROWS = 16  # decode_mma's tokens


def shared_experts_and_mixers(config):
    """The quantization config's INT6 group narrowed to the shared experts, and the mixers' INT8 one."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:  # vLLM asks first of a config without one
        return config
    groups = {}
    for name, g in qc["config_groups"].items():
        if g["weights"]["num_bits"] == 6:
            g["targets"] = [r"re:.*mlp\.shared_expert\.(gate|up|down)_proj$"]
            groups[name] = g
        elif g["weights"]["num_bits"] == 8 and any("hyper_connection" in t for t in g["targets"]):
            groups[name] = g
    qc["config_groups"] = groups
    return config


if warm_up:
    from flashnext.serving.quantization import bitplane

    bitplane._compiles_kernels = lambda weights: True

code = [Path(package.__file__).resolve().parent for package in (flashnext.serving, flashnext.quant)]
recorder = Allocations(code, code[0].parent, stand_ins=(SUPPORT_DIR,))


class KernelModules(Launches):
    """The launches, and the module that defines each kernel launched (flashnext's, or vLLM's)."""

    def __init__(self):
        super().__init__()
        self.modules: dict[str, str] = {}

    def key(self, kernel, args, kwargs):
        self.modules[kernel.fn.__qualname__] = kernel.fn.__module__
        return super().key(kernel, args, kwargs)


launches = KernelModules()
steps = []
out = {"steps": steps}


@contextmanager
def recorded(name: str, phase: str):
    first = len(launches.keys)
    with recorder.step(name) as step:
        yield
    keys = launches.keys[first:]
    steps.append({**step.to_json(), "phase": phase,
                  "keys": sorted({json.dumps([name, repr(spec), options]) for name, spec, options in keys}),
                  "launches": dict(Counter(name for name, _, _ in keys))})


with demo_vllm(view, port, shared_experts_and_mixers) as (config, _), recorder, launches.recording(), \
        torch.no_grad():
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from flashnext.quant.kernels import _common

    with recorded("load", "start-up"):
        model = build_model(config)
        model.load_weights(iter(read_tensors(view, lambda n: n.startswith("model.language_model.") and (
            ".mlp.shared_expert." in n or "hyper_connection" in n)).items()))
        for module in model.modules():
            # The CPU's packed bf16 GEMM needs vllm._C, which this CUDA build of vLLM cannot load
            # without libcuda; vLLM's own flag for a layer that skips it gives torch's F.linear.
            module._cpu_skip_gemm_dispatch = True
            if isinstance(module, RoutedExperts):  # no CPU MoE kernel in this build: nothing to prepare
                module.quant_method.process_weights_after_loading = lambda layer: None
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    text = model.language_model.model
    decoders = list(text.layers)
    mixers = [m for d in decoders for m in (d.attn_hyper_connection, d.mlp_hyper_connection)]
    mixers += [text.hyper_connection_mixer] if text.hyper_connection_mixer is not None else []
    experts = [d.mlp.shared_expert for d in decoders]
    out["methods"] = sorted({type(layer.quant_method).__name__ for e in experts
                             for layer in (e.gate_up_proj, e.down_proj)})
    out["mixer_methods"] = sorted({type(m.quant_method).__name__ for gr in mixers for m in gr.modules()
                                   if hasattr(m, "quant_method")})
    out["counters"] = {kernel: t.numel() * t.element_size() for (_, kernel), t in _common._COUNTERS.items()}
    hidden = config.model_config.hf_text_config.hidden_size
    streams = mixers[0].hyper_hidden_size
    g = torch.Generator().manual_seed(0)

    def step(name: str, phase: str, rows: int):
        x = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
        h = torch.randn(rows, streams, generator=g).to(torch.bfloat16)
        with recorded(name, phase):
            for d, expert in zip(decoders, experts):
                d.attn_hyper_connection.mix(h)
                d.mlp_hyper_connection.mix(h)
                expert.down_proj(expert.act_fn(expert.gate_up_proj(x)[0]))
            if text.hyper_connection_mixer is not None:
                text.hyper_connection_mixer.mix(h)

    for size in capture_sizes:  # CUDA-graph capture, stood in for
        step(f"capture {size}", "start-up", size)
    for rows in range(1, MAX_ROWS + 1):
        step(f"decode {rows}", "serving", rows)
    out["counters_after"] = {kernel: t.numel() * t.element_size() for (_, kernel), t in _common._COUNTERS.items()}
    out["flashnext_kernels"] = sorted(k for k, m in launches.modules.items() if m.startswith("flashnext."))
print(json.dumps(out))
